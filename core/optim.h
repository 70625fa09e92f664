// Optimizers and learning-rate schedules.
//
// tetra's own, rather than torch::optim: ZeRO later shards exactly this state (one set
// of tensors per parameter, addressable by name), and checkpoints store it by parameter
// name so a run can resume on another layout. The update arithmetic is torch::optim's
// (same formulas, same order of operations), so results match a bare LibTorch loop.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/job_spec.h"

namespace tetra::core {

struct NamedParam {
  std::string name;  // "3.weight": the model's own parameter name
  at::Tensor tensor;
};

// How many slots of a parameter's size `spec` keeps per parameter: adam and adamw 2
// (exp_avg, exp_avg_sq), sgd 1 with momentum, else 0 (what memory estimates count).
int64_t optimizer_slots(const OptimizerSpec& spec);

// The optimizer's state slots for one contiguous range of elements (a parameter, or a
// ZeRO shard): each defined slot has the range's length and dtype.
struct UpdateSlots {
  at::Tensor exp_avg, exp_avg_sq;  // adam, adamw
  at::Tensor momentum;             // sgd with momentum > 0
  bool fresh_momentum = false;        // sgd: first update of `momentum` (torch sets buf = d, not m*buf + d)
};

// One update of `param` from `grad` in a single pass over the elements, with the formulas
// and order of operations of torch::optim (SGD with momentum/nesterov/weight decay; Adam
// with L2 weight decay; AdamW with decoupled decay). `step` is the 1-based update count
// (bias corrections), `lr` this step's rate. param, grad and the slots: contiguous CPU
// tensors of equal numel and the same floating dtype (float or double; other dtypes or
// non-contiguous tensors fall back to reference_update). Allocates no tensors (and at one
// intra-op thread nothing at all). The caller allocates the slots `spec` needs (a missing
// one, or one of another length, is a tetra::Error); with fresh_momentum, `momentum` is
// only written.
//
// Note [One pass per range]
// Each element of param, grad and the slots is loaded once, updated in registers (SIMD
// vectors of the build's native width, std::experimental::simd, then one element at a
// time for the tail) and stored once; a range above 16384 elements is split across
// LibTorch's intra-op threads (Note [Splitting a range across threads] in optim.cpp).
// Float is computed in float with each scalar argument formed in double and rounded to
// float, as ATen does, so the result is ATen's bit for bit where ATen's kernels round
// every operation (ATEN_CPU_CAPABILITY=default); its AVX2/AVX-512 kernels fuse some
// multiply-adds (add with alpha) that this loop rounds twice: a last-bit difference.
void fused_update(const OptimizerSpec& spec, double lr, int64_t step, const at::Tensor& param,
                  const at::Tensor& grad, UpdateSlots& slots);
// The same update as today's ATen ops (kept as the reference for tests and bench-optim).
void reference_update(const OptimizerSpec& spec, double lr, int64_t step, const at::Tensor& param,
                      const at::Tensor& grad, UpdateSlots& slots);

class Optimizer {
 public:
  Optimizer(const OptimizerSpec& spec, std::vector<NamedParam> params);

  // One update with learning rate `lr` from each parameter's .grad() (parameters whose
  // grad is undefined are skipped, as torch::optim does): fused_update per parameter,
  // its state created on the parameter's first update.
  void step(double lr);
  void zero_grad();

  int64_t steps() const { return steps_; }
  const std::vector<NamedParam>& params() const { return params_; }
  const OptimizerSpec& spec() const { return spec_; }

  // "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.momentum" and "__step__".
  std::map<std::string, at::Tensor> state_dict() const;
  // Restores what state_dict() saved; a missing or misshapen entry is a tetra::Error.
  void load_state_dict(const std::map<std::string, at::Tensor>& state);

 private:
  struct State {
    at::Tensor exp_avg, exp_avg_sq, momentum;
  };
  OptimizerSpec spec_;
  std::vector<NamedParam> params_;
  std::vector<State> state_;
  int64_t steps_ = 0;
};

// Scales every gradient so that their global L2 norm is at most max_norm (when
// max_norm > 0) and returns the norm before scaling.
double clip_grad_norm(const std::vector<NamedParam>& params, double max_norm);
// As above when `params` are one part of the model (a pipeline stage's): reduce_sq
// turns this part's squared norm into the whole model's.
double clip_grad_norm(const std::vector<NamedParam>& params, double max_norm,
                      const std::function<double(double)>& reduce_sq);
// The global L2 norm of a set of gradients, and its square.
double grad_norm(const std::vector<NamedParam>& params);
double grad_norm_sq(const std::vector<NamedParam>& params);
// Multiplies every defined gradient by `factor`.
void scale_gradients(const std::vector<NamedParam>& params, double factor);
// What clipping multiplies the gradients by when their norm is above max_norm
// (torch.nn.utils.clip_grad_norm_'s epsilon).
inline double clip_scale(double max_norm, double norm) { return max_norm / (norm + 1e-6); }

// Learning rate at optimizer step `step` (0-based) of a run of `total_steps`.
class LrSchedule {
 public:
  LrSchedule(const ScheduleSpec& spec, double peak_lr, int64_t total_steps);
  double at(int64_t step) const;

 private:
  ScheduleSpec spec_;
  double peak_;
  int64_t total_;
};

}  // namespace tetra::core
