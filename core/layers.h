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

// A parameter of `shape` for a layer's reset(): on the device of `previous` when it is
// defined (a clone of a created layer), else a meta tensor (a shape).
at::Tensor shape_parameter(const std::vector<int64_t>& shape, const at::Tensor& previous);

}  // namespace tetra::core
