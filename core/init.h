// Models as shapes first, and initial weights that do not depend on the layout.
//
// Note [Layout-invariant initialisation]
// The model a job names is first built as shapes: tetra's layers (core/layers.h) create
// their parameters on LibTorch's meta device (sizes, dtype, names; no storage). The plan
// then decides what each rank holds — its pipeline stage's layers, its ZeRO-3 chunks of
// each flat unit — and each rank creates only those, at their final size, here. No rank
// ever holds the whole model unless the plan gives it the whole model.
//
// So that every layout starts from the same numbers without a broadcast or a full copy,
// an initial value is a pure function of where it belongs, as dropout's masks are (Note
// [Layout-invariant dropout] in core/random.h):
//
//   key(tensor)  = splitmix64(splitmix64(seed) ^ fnv1a64(the tensor's single-process name))
//   bits(k)      = splitmix64(key + k * gamma)          k: the element's index in the whole
//                                                          tensor, flattened row-major
//   uniform(a,b) = a + (b - a) * u,  u = the top 53 bits of bits(k) / 2^53
//   normal(m,s)  = elements 2q and 2q+1 are Box-Muller's pair from u1 = (bits(2q) >> 11 + 1)
//                  / 2^53 and u2 = (bits(2q+1) >> 11) / 2^53: m + s r cos(2 pi u2) and
//                  m + s r sin(2 pi u2), r = sqrt(-2 ln u1)
//   constant(c)  = c
//
// computed in double, one element at a time, and rounded once to the tensor's dtype. Any
// slice of any tensor — a pipeline stage's layer, a ZeRO chunk that starts in the middle
// of a weight, any number of ranks — therefore holds exactly the bytes one process holds
// for those elements. The distributions are each layer type's usual ones (Kaiming-uniform
// for Linear and Conv2d, as torch::nn's reset_parameters draws them; normal for
// embeddings; ones and zeros for norms; GPT's normal(0, 0.02) and zero biases); the
// numbers are tetra's own, not torch's generator's.
//
// A program's own model (TrainerOptions::model) built of torch::nn layers arrives with its
// values: nothing is drawn, and a strategy that replicates it starts every rank from the
// first one's (broadcast_from_first), as before. Built of tetra's layers, it is shapes
// like the zoo's.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/optim.h"
#include "core/placement.h"

namespace tetra::core {

// How a tensor's initial elements are drawn.
struct Init {
  enum class Kind { kUniform, kNormal, kConstant };
  Kind kind = Kind::kConstant;
  double a = 0, b = 0;  // uniform: [a, b); normal: mean a, std b; constant: a
  static Init uniform(double lo, double hi) { return {Kind::kUniform, lo, hi}; }
  static Init normal(double mean, double std) { return {Kind::kNormal, mean, std}; }
  static Init constant(double value) { return {Kind::kConstant, value, 0}; }
  // torch::nn's Linear and Conv reset_parameters: Kaiming-uniform with a = sqrt(5), which
  // is uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), for the weight and the bias alike.
  static Init fan_in_uniform(int64_t fan_in);
  std::string str() const;  // "uniform(-0.0357, 0.0357)", "normal(0, 0.02)", "constant(1)"
};

// Elements [first, first + out.numel()) of the flattened initial value of the tensor
// `name` into `out` (contiguous, floating point). Pure: any slicing gives the same bytes.
void draw(const Init& init, uint64_t seed, const std::string& name, int64_t first,
          const at::Tensor& out);

// A module that says how each of its own parameters and buffers (not its children's) is
// drawn: tetra's layers, and a program's own modules built as shapes.
class Initialized {
 public:
  virtual ~Initialized() = default;
  virtual Init init_of(const std::string& name) const = 0;
  // Where this rank's part of tensor `name` lies in the whole tensor, for a tensor the
  // module holds only part of (a tensor-parallel layer: Note [Placements], core/placement.h);
  // none: it holds the whole. The part is drawn as those elements of the whole tensor.
  virtual std::optional<Placement> placement_of(const std::string& name) const {
    (void)name;
    return std::nullopt;
  }
};

// Note [Placements]: this rank's part of `whole` (the whole tensor, in its own shape), in
// the part's flat order, shaped as the rank's tensor `like`.
at::Tensor part_of(const Placement& part, const at::Tensor& whole, const at::Tensor& like);
// The whole tensor (in its own shape) from every rank's part, `parts[i]` part i.
at::Tensor whole_of(const Placement& any_part, const std::vector<at::Tensor>& parts);

// Gives `t` the storage, device and values of `data` in place: every holder of `t` (the
// module's member, its parameter list, views and autograd's leaf) sees the new tensor,
// and its requires_grad stays. Unlike Tensor::set_data it takes a meta tensor to a real
// one and back (set_data refuses to change a tensor's kind). `t` must be a leaf whose
// gradient accumulator has not been made yet (before any strategy hooks it).
void place(const at::Tensor& t, const at::Tensor& data);

// A meta tensor of `t`'s sizes and dtype (what a materialised tensor goes back to).
at::Tensor meta_like(const at::Tensor& t);

// The one place that creates the model's tensors (Note [Layout-invariant initialisation]).
// Made from the whole model as built, before any strategy cuts or wraps it: it records,
// under each tensor's single-process name, how that tensor is drawn. A meta tensor whose
// module does not say (not an Initialized module) is a ConfigError naming it.
class Materializer {
 public:
  // Tensors it creates are placed on `device` (Note [One device]); values are drawn on
  // the CPU, so every device draws the same.
  Materializer(torch::nn::Module& model, uint64_t seed, torch::Device device = torch::kCPU);

  uint64_t seed() const { return seed_; }
  // True when the model came with its values (no meta tensor at all): nothing is drawn,
  // and replicating strategies start every rank from the first one's.
  bool given() const { return rules_.empty(); }
  // The rule of tensor `name` (throws when it has none: a tensor that came with values).
  const Init& rule(const std::string& name) const;
  // Where the part of tensor `name` this rank creates lies in the whole tensor; nullptr
  // when it creates the whole (Note [Placements]).
  const Placement* placement(const std::string& name) const;

  // Elements [first, first + out.numel()) of p's flattened initial value into `out`:
  // drawn when p is a meta tensor (a part of a split tensor: the whole tensor's elements
  // it holds there), copied from its values otherwise.
  void fill(const NamedParam& p, int64_t first, const at::Tensor& out) const;
  // Creates p whole on the CPU with its initial values, in place (place()); a tensor that
  // already has storage is left as it is.
  void create(const NamedParam& p) const;
  // Creates every parameter and buffer of `model` that is still on the meta device.
  // Their names in `model` must be the single-process names (the pipeline's kept stage
  // and ZeRO-3's wrappers keep them).
  void create_all(torch::nn::Module& model) const;

  // Note [Weights from elsewhere]: where initial values come from instead of the seeded
  // draw. `source(name, whole_begin, out)` fills `out` (CPU, contiguous, 1-D) with elements
  // [whole_begin, whole_begin + out.numel()) of the whole tensor `name` and returns true,
  // or returns false for a tensor it does not have (which is then drawn). Set before any
  // tensor is created: every layout creates its part through draw_part, so the values land
  // resharded onto whatever this rank holds.
  using ValueSource = std::function<bool(const std::string& name, int64_t whole_begin, const at::Tensor& out)>;
  void take_values_from(ValueSource source) { source_ = std::move(source); }

 private:
  uint64_t seed_;
  torch::Device device_;
  std::map<std::string, Init> rules_;             // meta tensors only
  std::map<std::string, Placement> placements_;   // those of them a module holds part of
  ValueSource source_;                            // none: every value is drawn
  // Draws elements [first, first + out.numel()) of p's part into `out` (CPU, contiguous).
  void draw_part(const std::string& name, int64_t first, const at::Tensor& out) const;
};

// Bytes of the tensors of `model` that hold storage (parameters and buffers), each storage
// once: what a rank has created of its model.
int64_t created_bytes(const torch::nn::Module& model);

// A layer's pretty print without the namespaces and the Impl of its type:
// "Linear(in_features=784, ...)", "GptBlock(d_model=128, ...)", "Residual" for a program's
// own "(anonymous namespace)::ResidualImpl". Here, with the module helpers, since the
// Materializer names a layer in its errors; models.h's describe() and the tables use it too.
std::string layer_text(const torch::nn::Module& layer);

// For running one layer of a model built as shapes (probing its output, timing it): while
// it lives, every meta parameter and buffer of `module` has real storage (zeros: the
// values do not matter to a probe's shapes or to a layer's time); afterwards they are
// meta again and the bytes are freed. Tensors that have storage are left alone.
class MaterializedScope {
 public:
  explicit MaterializedScope(torch::nn::Module& module);
  ~MaterializedScope();
  MaterializedScope(const MaterializedScope&) = delete;
  MaterializedScope& operator=(const MaterializedScope&) = delete;

 private:
  std::vector<at::Tensor> made_;
};

}  // namespace tetra::core
