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

// ---- ParallelLinear --------------------------------------------------------------------

ParallelLinearImpl::ParallelLinearImpl(int64_t in_features, int64_t out_features, Split split,
                                       TensorSlot slot, bool bias, std::optional<Init> weight_init,
                                       std::optional<Init> bias_init, int64_t groups)
    : in_(in_features),
      out_(out_features),
      split_(split),
      slot_(slot),
      has_bias_(bias),
      weight_init_(weight_init),
      bias_init_(bias_init),
      groups_(groups) {
  TETRA_CHECK(slot_.parts >= 1 && slot_.index >= 0 && slot_.index < slot_.parts,
              "ParallelLinear: part ", slot_.index, " of ", slot_.parts, " does not exist");
  TETRA_CHECK(groups_ >= 1 && (split_ == Split::kColumn || groups_ == 1) && out_ % groups_ == 0,
              "ParallelLinear: ", groups_, " groups of outputs need a column split of ", out_, " outputs");
  const int64_t split_size = split_ == Split::kColumn ? out_ / groups_ : in_;
  TETRA_CHECK(split_size % slot_.parts == 0, "ParallelLinear(", in_, " -> ", out_, "): ", slot_.parts,
              " tensor-parallel parts do not divide its ",
              split_ == Split::kColumn ? "outputs" : "inputs", " (", split_size, ")");
  group_ = shapes_only(slot_.parts, slot_.index);
  reset();
}

std::optional<Placement> ParallelLinearImpl::placement_of(const std::string& name) const {
  if (split_ == Split::kRow)
    return name == "weight" ? std::optional<Placement>(Placement::split({out_, in_}, 1, slot_.parts, slot_.index))
                            : std::nullopt;
  if (name == "weight")
    return Placement::split({groups_, out_ / groups_, in_}, 1, slot_.parts, slot_.index).of_shape({out_, in_});
  return Placement::split({groups_, out_ / groups_}, 1, slot_.parts, slot_.index).of_shape({out_});
}

void ParallelLinearImpl::reset() {
  const int64_t t = slot_.parts;
  const bool column = split_ == Split::kColumn;
  weight = register_parameter("weight", shape_parameter({column ? out_ / t : out_, column ? in_ : in_ / t}, weight));
  if (has_bias_) bias = register_parameter("bias", shape_parameter({column ? out_ / t : out_}, bias));
}

at::Tensor ParallelLinearImpl::forward(const at::Tensor& x) {
  const int64_t seq = x.dim() - 2;  // the sequence's dimension, [..., T, features]
  if (split_ == Split::kColumn) return group_->column_linear(x, weight, bias, slot_.sequence ? seq : -1);
  const at::Tensor partial = at::linear(x, weight);
  at::Tensor y = slot_.sequence ? group_->scatter(partial, seq) : group_->reduce(partial);
  return has_bias_ ? y + bias : y;
}

Init ParallelLinearImpl::init_of(const std::string& name) const {
  if (name == "weight") return weight_init_.value_or(Init::fan_in_uniform(in_));
  return bias_init_.value_or(Init::fan_in_uniform(in_));
}

void ParallelLinearImpl::pretty_print(std::ostream& os) const {
  os << (split_ == Split::kColumn ? "ColumnParallelLinear" : "RowParallelLinear") << "(in_features=" << in_
     << ", out_features=" << out_ << ", bias=" << (has_bias_ ? "true" : "false") << ", part " << slot_.index
     << " of " << slot_.parts;
  if (groups_ > 1) os << ", groups=" << groups_;
  os << ")";
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

// ---- ParallelEmbedding -----------------------------------------------------------------

ParallelEmbeddingImpl::ParallelEmbeddingImpl(int64_t num, int64_t dim, TensorSlot slot, std::optional<Init> init)
    : num_(num), dim_(dim), slot_(slot), init_(init) {
  TETRA_CHECK(num_ >= 1 && dim_ >= 1, "ParallelEmbedding needs sizes >= 1, got ", num_, " x ", dim_);
  TETRA_CHECK(slot_.parts >= 1 && slot_.index >= 0 && slot_.index < slot_.parts && num_ % slot_.parts == 0,
              "ParallelEmbedding: ", slot_.parts, " tensor-parallel parts do not divide its ", num_, " rows");
  group_ = shapes_only(slot_.parts, slot_.index);
  reset();
}

void ParallelEmbeddingImpl::reset() {
  weight = register_parameter("weight", shape_parameter({num_ / slot_.parts, dim_}, weight));
}

at::Tensor ParallelEmbeddingImpl::forward(const at::Tensor& indices) {
  if (slot_.parts == 1) return at::embedding(weight, indices);
  const int64_t rows = num_ / slot_.parts;
  const at::Tensor local = indices - first();
  const at::Tensor outside = local.lt(0).logical_or(local.ge(rows));
  at::Tensor out = at::embedding(weight, local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0);
  // Sequence parallelism: the sum's block of the sequence (Megatron's reduce-scattered embeddings).
  return slot_.sequence ? group_->scatter(out, out.dim() - 2) : group_->reduce(out);
}

Init ParallelEmbeddingImpl::init_of(const std::string&) const { return init_.value_or(Init::normal(0, 1)); }

std::optional<Placement> ParallelEmbeddingImpl::placement_of(const std::string&) const {
  return Placement::split({num_, dim_}, 0, slot_.parts, slot_.index);
}

void ParallelEmbeddingImpl::pretty_print(std::ostream& os) const {
  os << "VocabParallelEmbedding(num_embeddings=" << num_ << ", embedding_dim=" << dim_ << ", part "
     << slot_.index << " of " << slot_.parts << ")";
}

}  // namespace tetra::core
