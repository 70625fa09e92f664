// tetra's layers with parameters: the arithmetic of torch::nn's Linear, Conv2d, LayerNorm
// and Embedding (the same functional calls, the same parameter names), built as shapes.
//
// Each creates its parameters on LibTorch's meta device (Note [Layout-invariant
// initialisation] in core/init.h) and says how each is drawn (Initialized), so a model of
// them costs no memory until the plan has decided what each rank holds and the
// Materializer creates that. They print as torch::nn's do ("Linear(in_features=784,
// out_features=1024, bias=true)"). A clone of a created layer is created (on the original's
// device); a clone of a shape is a shape.
#pragma once

#include <torch/nn/cloneable.h>

#include <optional>
#include <vector>

#include "core/init.h"
#include "core/tensor_group.h"

namespace tetra::core {

// y = x W^T + b. W [out, in], b [out]. Default draws: torch::nn::Linear's (uniform
// +-1/sqrt(in) for both).
class LinearImpl : public torch::nn::Cloneable<LinearImpl>, public Initialized {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true,
             std::optional<Init> weight_init = {}, std::optional<Init> bias_init = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  Init init_of(const std::string& name) const override;
  void pretty_print(std::ostream& os) const override;
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

  at::Tensor weight, bias;

 private:
  int64_t in_, out_;
  bool has_bias_;
  std::optional<Init> weight_init_, bias_init_;
};
TORCH_MODULE(Linear);

// This rank's part of a tensor-parallel layer: `parts` (the tensor axis' T) and which.
// `sequence`: sequence parallelism (Korthikanti et al., Note [Tensor-parallel maps]): the
// activations between the split layers are this rank's block of the sequence (dim -2), and
// the layers gather and reduce-scatter along it where they would copy and reduce.
struct TensorSlot {
  int parts = 1;
  int index = 0;
  bool sequence = false;
};

// Megatron's tensor-parallel Linear pair (Note [Tensor-parallel maps], core/tensor_group.h),
// the weight W [out, in] of the Linear it splits held in part (Note [Placements]):
//  - kColumn: W's rows (and b) split into T blocks; y_t = copy(x) W_t^T + b_t, this
//    rank's block of the output features (Megatron's ColumnParallelLinear without
//    gather_output). With `groups` > 1 the output is `groups` stacked blocks (a fused
//    query/key/value projection) and each is split: the rank holds its rows of every one.
//  - kRow: W's columns split; x is this rank's block of the input features and
//    y = reduce(x_t W_t^T) + b, b whole and added once (RowParallelLinear with
//    input_is_parallel).
// Under sequence parallelism (slot.sequence) a kColumn layer takes this rank's block of
// the sequence and gathers it (instead of copy), and a kRow layer reduce-scatters its
// partial product along the sequence (instead of reduce), adding b to its block.
// Drawn as the whole Linear is (torch::nn::Linear's fan-in is the whole `in`), so each
// rank's part holds the bytes one process holds there.
class ParallelLinearImpl : public torch::nn::Cloneable<ParallelLinearImpl>,
                           public Initialized,
                           public TensorParallelLayer {
 public:
  enum class Split { kColumn, kRow };
  ParallelLinearImpl(int64_t in_features, int64_t out_features, Split split, TensorSlot slot,
                     bool bias = true, std::optional<Init> weight_init = {},
                     std::optional<Init> bias_init = {}, int64_t groups = 1);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  Init init_of(const std::string& name) const override;
  std::optional<Placement> placement_of(const std::string& name) const override;
  void bind(std::shared_ptr<TensorGroup> group) override { group_ = std::move(group); }
  void pretty_print(std::ostream& os) const override;
  int64_t in_features() const { return in_; }    // the whole layer's
  int64_t out_features() const { return out_; }  // the whole layer's
  Split split() const { return split_; }
  TensorSlot slot() const { return slot_; }

  at::Tensor weight, bias;  // this rank's parts (a kRow layer's bias is whole)

 private:
  int64_t in_, out_;
  Split split_;
  TensorSlot slot_;
  bool has_bias_;
  std::optional<Init> weight_init_, bias_init_;
  int64_t groups_;
  std::shared_ptr<TensorGroup> group_;
};
TORCH_MODULE(ParallelLinear);

// A 2-d convolution with square kernels (stride 1 unless given), torch::nn::Conv2d's draws.
class Conv2dImpl : public torch::nn::Cloneable<Conv2dImpl>, public Initialized {
 public:
  Conv2dImpl(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t padding = 0,
             int64_t stride = 1);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  Init init_of(const std::string& name) const override;
  void pretty_print(std::ostream& os) const override;
  int64_t in_channels() const { return in_; }
  int64_t out_channels() const { return out_; }
  int64_t kernel() const { return kernel_; }

  at::Tensor weight, bias;

 private:
  int64_t in_, out_, kernel_, padding_, stride_;
};
TORCH_MODULE(Conv2d);

// Layer normalisation over the last dimension(s) with an elementwise affine (ones, zeros).
class LayerNormImpl : public torch::nn::Cloneable<LayerNormImpl>, public Initialized {
 public:
  explicit LayerNormImpl(std::vector<int64_t> shape, double eps = 1e-5);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  Init init_of(const std::string& name) const override;
  void pretty_print(std::ostream& os) const override;

  at::Tensor weight, bias;

 private:
  std::vector<int64_t> shape_;
  double eps_;
};
TORCH_MODULE(LayerNorm);

// A lookup table [num, dim] (torch::nn::Embedding's default draw: normal(0, 1)).
class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl>, public Initialized {
 public:
  EmbeddingImpl(int64_t num, int64_t dim, std::optional<Init> init = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& indices);
  Init init_of(const std::string& name) const override;
  void pretty_print(std::ostream& os) const override;

  at::Tensor weight;

 private:
  int64_t num_, dim_;
  std::optional<Init> init_;
};
TORCH_MODULE(Embedding);

// Megatron's VocabParallelEmbedding: the table [num, dim] split by rows (the vocabulary),
// this rank holding rows [index x num / T, (index + 1) x num / T); an id outside them looks
// up zeros, and the parts are summed over the tensor group (reduce): every rank ends with
// the whole lookup (under sequence parallelism, reduce-scattered: its block of the
// sequence of the whole lookup). Drawn as the whole table is.
class ParallelEmbeddingImpl : public torch::nn::Cloneable<ParallelEmbeddingImpl>,
                              public Initialized,
                              public TensorParallelLayer {
 public:
  ParallelEmbeddingImpl(int64_t num, int64_t dim, TensorSlot slot, std::optional<Init> init = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& indices);
  Init init_of(const std::string& name) const override;
  std::optional<Placement> placement_of(const std::string& name) const override;
  void bind(std::shared_ptr<TensorGroup> group) override { group_ = std::move(group); }
  void pretty_print(std::ostream& os) const override;
  int64_t first() const { return num_ / slot_.parts * slot_.index; }  // this rank's first row

  at::Tensor weight;  // this rank's rows

 private:
  int64_t num_, dim_;
  TensorSlot slot_;
  std::optional<Init> init_;
  std::shared_ptr<TensorGroup> group_;
};
TORCH_MODULE(ParallelEmbedding);

// A parameter of `shape` for a layer's reset(): on the device of `previous` when it is
// defined (a clone of a created layer), else a meta tensor (a shape).
at::Tensor shape_parameter(const std::vector<int64_t>& shape, const at::Tensor& previous);

}  // namespace tetra::core
