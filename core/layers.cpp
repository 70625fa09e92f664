#include "core/layers.h"

#include <ostream>

#include "collectives/error.h"

namespace tetra::core {

at::Tensor shape_parameter(const std::vector<int64_t>& shape, const at::Tensor& previous) {
  const at::Device device = previous.defined() ? previous.device() : at::Device(at::kMeta);
  return at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(device));
}

namespace {

void print_list(std::ostream& os, const std::vector<int64_t>& v) {
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
}

}  // namespace

// ---- Linear ----------------------------------------------------------------------------

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool bias,
                       std::optional<Init> weight_init, std::optional<Init> bias_init)
    : in_(in_features),
      out_(out_features),
      has_bias_(bias),
      weight_init_(weight_init),
      bias_init_(bias_init) {
  TETRA_CHECK(in_ >= 0 && out_ >= 0, "Linear needs sizes >= 0, got ", in_, " -> ", out_);
  reset();
}

void LinearImpl::reset() {
  weight = register_parameter("weight", shape_parameter({out_, in_}, weight));
  if (has_bias_) bias = register_parameter("bias", shape_parameter({out_}, bias));
}

at::Tensor LinearImpl::forward(const at::Tensor& x) { return at::linear(x, weight, bias); }

Init LinearImpl::init_of(const std::string& name) const {
  if (name == "weight") return weight_init_.value_or(Init::fan_in_uniform(in_));
  return bias_init_.value_or(Init::fan_in_uniform(in_));
}

void LinearImpl::pretty_print(std::ostream& os) const {
  os << "Linear(in_features=" << in_ << ", out_features=" << out_
     << ", bias=" << (has_bias_ ? "true" : "false") << ")";
}

// ---- Conv2d ----------------------------------------------------------------------------

Conv2dImpl::Conv2dImpl(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t padding,
                       int64_t stride)
    : in_(in_channels), out_(out_channels), kernel_(kernel), padding_(padding), stride_(stride) {
  TETRA_CHECK(in_ >= 1 && out_ >= 1 && kernel_ >= 1 && stride_ >= 1 && padding_ >= 0, "Conv2d(",
              in_, ", ", out_, ", kernel ", kernel_, ", padding ", padding_, ", stride ", stride_,
              "): sizes out of range");
  reset();
}

void Conv2dImpl::reset() {
  weight = register_parameter("weight", shape_parameter({out_, in_, kernel_, kernel_}, weight));
  bias = register_parameter("bias", shape_parameter({out_}, bias));
}

at::Tensor Conv2dImpl::forward(const at::Tensor& x) {
  return at::conv2d(x, weight, bias, {stride_, stride_}, {padding_, padding_});
}

Init Conv2dImpl::init_of(const std::string&) const {
  return Init::fan_in_uniform(in_ * kernel_ * kernel_);
}

void Conv2dImpl::pretty_print(std::ostream& os) const {
  os << "Conv2d(" << in_ << ", " << out_ << ", kernel_size=[" << kernel_ << ", " << kernel_
     << "], stride=[" << stride_ << ", " << stride_ << "], padding=[" << padding_ << ", "
     << padding_ << "])";
}

// ---- LayerNorm -------------------------------------------------------------------------

LayerNormImpl::LayerNormImpl(std::vector<int64_t> shape, double eps)
    : shape_(std::move(shape)), eps_(eps) {
  reset();
}

void LayerNormImpl::reset() {
  weight = register_parameter("weight", shape_parameter(shape_, weight));
  bias = register_parameter("bias", shape_parameter(shape_, bias));
}

at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  return at::layer_norm(x, shape_, weight, bias, eps_);
}

Init LayerNormImpl::init_of(const std::string& name) const {
  return Init::constant(name == "weight" ? 1.0 : 0.0);
}

void LayerNormImpl::pretty_print(std::ostream& os) const {
  os << "LayerNorm(";
  print_list(os, shape_);
  os << ", eps=" << eps_ << ", elementwise_affine=true)";
}

// ---- Embedding -------------------------------------------------------------------------

EmbeddingImpl::EmbeddingImpl(int64_t num, int64_t dim, std::optional<Init> init)
    : num_(num), dim_(dim), init_(init) {
  TETRA_CHECK(num_ >= 1 && dim_ >= 1, "Embedding needs sizes >= 1, got ", num_, " x ", dim_);
  reset();
}

void EmbeddingImpl::reset() {
  weight = register_parameter("weight", shape_parameter({num_, dim_}, weight));
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& indices) {
  return at::embedding(weight, indices);
}

Init EmbeddingImpl::init_of(const std::string&) const { return init_.value_or(Init::normal(0, 1)); }

void EmbeddingImpl::pretty_print(std::ostream& os) const {
  os << "Embedding(num_embeddings=" << num_ << ", embedding_dim=" << dim_ << ")";
}

}  // namespace tetra::core
