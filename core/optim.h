// Optimizers and learning-rate schedules.
//
// tetra's own, rather than torch::optim: ZeRO later shards exactly this state (one set
// of tensors per parameter, addressable by name), and checkpoints store it by parameter
// name so a run can resume on another layout. The update arithmetic is torch::optim's
// (same formulas, same order of operations), so results match a bare LibTorch loop.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/job_spec.h"

namespace tetra::core {

struct NamedParam {
  std::string name;  // "3.weight": the model's own parameter name
  torch::Tensor tensor;
};

class Optimizer {
 public:
  Optimizer(const OptimizerSpec& spec, std::vector<NamedParam> params);

  // One update with learning rate `lr` from each parameter's .grad() (parameters whose
  // grad is undefined are skipped, as torch::optim does).
  void step(double lr);
  void zero_grad();

  int64_t steps() const { return steps_; }
  const std::vector<NamedParam>& params() const { return params_; }
  const OptimizerSpec& spec() const { return spec_; }

  // "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.momentum" and "__step__".
  std::map<std::string, torch::Tensor> state_dict() const;
  // Restores what state_dict() saved; a missing or misshapen entry is a tetra::Error.
  void load_state_dict(const std::map<std::string, torch::Tensor>& state);

 private:
  struct State {
    torch::Tensor exp_avg, exp_avg_sq, momentum;
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
// The global L2 norm of a set of gradients.
double grad_norm(const std::vector<NamedParam>& params);

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
