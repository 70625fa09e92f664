#include "core/models.h"

#include <torch/torch.h>

#include <cmath>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>

#include "collectives/error.h"
#include "core/allocator.h"
#include "core/init.h"
#include "core/layers.h"
#include "core/torch_compat.h"
#include "core/random.h"
#include "core/text.h"

namespace tetra::core {

using tetra::detail::concat;

namespace {

// ---- the GPT layers: each one a Sequential element, so a pipeline can cut between them --

// GPT-2's draws: weights normal(0, 0.02), biases zero (norms ones and zeros).
const Init kGptWeight = Init::normal(0.0, 0.02);
const Init kGptBias = Init::constant(0.0);

Linear gpt_linear(int64_t in, int64_t out) { return Linear(in, out, true, kGptWeight, kGptBias); }

// A Linear for a decoder's step: one row is a matrix-vector product (BLAS's gemv reads the
// weight once, where a one-row gemm packs it first: half the speed measured here, on a
// step bound by reading the weights); more rows are the Linear's own.
torch::Tensor decode_linear(Linear& l, const torch::Tensor& x) {
  if (x.numel() != x.size(-1)) return l(x);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = l->out_features();
  const torch::Tensor v = x.reshape({-1});
  return (l->bias.defined() ? at::addmv(l->bias, l->weight, v) : at::mv(l->weight, v)).view(shape);
}

// Token embedding + learned positional embedding (+ dropout): int64 [n, T] -> [n, T, d].
// Under tensor parallelism (slot.parts > 1, Note [Tensor-parallel maps]) the token table is
// split by vocabulary (VocabParallelEmbedding); its output, summed over the tensor group,
// is whole on every rank, and so is everything after it here.
class GptEmbeddingImpl : public torch::nn::Cloneable<GptEmbeddingImpl>, public Initialized {
 public:
  GptEmbeddingImpl(int64_t vocab, int64_t seq_len, int64_t d_model, double dropout, TensorSlot slot)
      : vocab_(vocab), seq_len_(seq_len), d_model_(d_model), dropout_(dropout), slot_(slot) {
    reset();
  }
  void reset() override {
    if (slot_.parts > 1)
      tok_part = register_module("tok", ParallelEmbedding(vocab_, d_model_, slot_, kGptWeight));
    else
      tok = register_module("tok", Embedding(vocab_, d_model_, kGptWeight));
    pos = register_parameter("pos", shape_parameter({seq_len_, d_model_}, pos));
    drop = register_module("drop", Dropout(dropout_));
  }
  torch::Tensor forward(torch::Tensor tokens) {
    TETRA_CHECK(tokens.dim() == 2, "GptEmbedding expects int64 tokens [n, T], got ",
                tokens.dim(), " dims");
    const int64_t T = tokens.size(1);
    TETRA_CHECK(T <= seq_len_, "sequence of ", T, " tokens is longer than the context ", seq_len_);
    if (!slot_.sequence) return drop((tok ? tok(tokens) : tok_part(tokens)) + pos.slice(0, 0, T).unsqueeze(0));
    // Sequence parallelism: this rank's block of the sequence, positions and dropout mask
    // included (the mask keyed by each element's place in the whole sample).
    TETRA_CHECK(T % slot_.parts == 0, "tensor.sequence_parallel: a sequence of ", T, " tokens does not split into ",
                slot_.parts, " equal blocks");
    const int64_t block = T / slot_.parts;
    return drop->forward_part(tok_part(tokens) + pos.slice(0, slot_.index * block, (slot_.index + 1) * block).unsqueeze(0),
                              Placement::split({T, d_model_}, 0, slot_.parts, slot_.index));
  }
  Init init_of(const std::string&) const override { return kGptWeight; }  // pos
  void pretty_print(std::ostream& os) const override {
    os << "GptEmbedding(vocab=" << vocab_ << ", seq_len=" << seq_len_ << ", d_model=" << d_model_
       << ", dropout=" << dropout_ << ")";
  }

  Embedding tok{nullptr};
  ParallelEmbedding tok_part{nullptr};  // tensor-parallel: this rank's rows of tok
  torch::Tensor pos;
  Dropout drop{nullptr};

 private:
  int64_t vocab_, seq_len_, d_model_;
  double dropout_;
  TensorSlot slot_;
};
TORCH_MODULE(GptEmbedding);

// Note [Recompute]
// train.recompute trades compute for activation memory, as Megatron's full and selective
// recomputation do, inside the layers, so that it holds under every layout: a data rank, a
// ZeRO-3 layer (whose parameters its BeforeLayerBackward gathers before this backward
// runs), a tensor-parallel block (its recomputed forward repeats the tensor group's sums,
// in the same order on every rank of it), a pipeline stage, a replica. Recomputed is an
// autograd Function over a body of the block's: its forward runs the body without a graph
// and keeps the body's inputs only; its backward runs the body again under the forward's
// dropout key (Note [Layout-invariant dropout]) and autocast, and runs a backward through
// it (reentrant, as PyTorch's checkpoint does): the parameters' gradients accumulate where
// any backward puts them, firing their hooks once (the data-parallel and ZeRO buckets, the
// sequence-parallel sums), and the inputs' gradients are returned. Taking the parameters'
// gradients with autograd::grad and returning them along edges of this node instead fires
// a parameter's tensor hook twice on LibTorch 2.x (hooks run for captured gradients there):
// tensor 2 with sequence parallelism then summed its norms' gradients twice. A zero-bubble
// schedule's B runs this node whole, weights included, so its W has nothing left of it
// (Note [B and W on the autograd graph]).
// blocks: the body is the whole block, whose input (the previous block's output) is all a
// block keeps; selective: the body is attention's core, softmax(QK^T / sqrt(d)) V with its
// mask and dropout, whose seq x seq tensors are what it keeps.
enum class Body : int64_t { kBlock, kAttention };

class GptBlockImpl;
at::Tensor run_body(GptBlockImpl& block, Body body, const std::vector<at::Tensor>& inputs);

struct Recomputed : torch::autograd::Function<Recomputed> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, int64_t block, int64_t body, at::TensorList inputs) {
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    ctx->save_for_backward(in);
    const RandomContext& random = RandomContext::current();
    ctx->saved_data["block"] = block;
    ctx->saved_data["body"] = body;
    ctx->saved_data["random"] = std::vector<int64_t>{static_cast<int64_t>(random.seed), random.step,
                                                     random.first_sample, random.active ? 1 : 0};
    ctx->saved_data["autocast"] = compat::autocast_enabled(in.front().device().type());
    return run_body(*reinterpret_cast<GptBlockImpl*>(block), static_cast<Body>(body), in);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

// Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)). Under tensor
// parallelism (Megatron's ParallelTransformerLayer) qkv is column-parallel by heads (each
// rank its heads' rows of the query, key and value blocks), proj row-parallel, fc1
// column- and fc2 row-parallel: one allreduce forward (proj's, fc2's) and one backward
// (qkv's, fc1's input) per half. The norms, the residual stream and its dropouts are whole
// on every rank; attention's dropout masks this rank's heads with the whole tensor's bits.
// Under sequence parallelism the residual stream, the norms and the dropouts after proj
// and fc2 are this rank's block of the sequence; qkv and fc1 gather it, proj and fc2
// reduce-scatter back to it.
class GptBlockImpl : public torch::nn::Cloneable<GptBlockImpl> {
 public:
  GptBlockImpl(int64_t d_model, int64_t heads, int64_t d_ff, double dropout, TensorSlot slot)
      : d_model_(d_model), heads_(heads), d_ff_(d_ff), dropout_(dropout), slot_(slot) {
    reset();
  }
  ParallelLinear part(const std::string& name, int64_t in, int64_t out, ParallelLinearImpl::Split split,
                      int64_t groups = 1) {
    return register_module(name, ParallelLinear(in, out, split, slot_, true, kGptWeight, kGptBias, groups));
  }
  void reset() override {
    using Split = ParallelLinearImpl::Split;
    ln1 = register_module("ln1", LayerNorm(std::vector<int64_t>{d_model_}));
    if (slot_.parts > 1) {
      qkv_part = part("qkv", d_model_, 3 * d_model_, Split::kColumn, 3);
      proj_part = part("proj", d_model_, d_model_, Split::kRow);
    } else {
      qkv = register_module("qkv", gpt_linear(d_model_, 3 * d_model_));
      proj = register_module("proj", gpt_linear(d_model_, d_model_));
    }
    ln2 = register_module("ln2", LayerNorm(std::vector<int64_t>{d_model_}));
    if (slot_.parts > 1) {
      fc1_part = part("fc1", d_model_, d_ff_, Split::kColumn);
      fc2_part = part("fc2", d_ff_, d_model_, Split::kRow);
    } else {
      fc1 = register_module("fc1", gpt_linear(d_model_, d_ff_));
      fc2 = register_module("fc2", gpt_linear(d_ff_, d_model_));
    }
    // One dropout per place it is used: each is its own layer of the mask key.
    attn_drop = register_module("attn_drop", Dropout(dropout_));
    proj_drop = register_module("proj_drop", Dropout(dropout_));
    mlp_drop = register_module("mlp_drop", Dropout(dropout_));
  }
  torch::Tensor forward(torch::Tensor x) {
    TETRA_CHECK(x.dim() == 3 && x.size(2) == d_model_, "GptBlock expects [n, T, ", d_model_,
                "], got ", x.sizes());
    if (recompute == Recompute::kBlocks && at::GradMode::is_enabled())
      return Recomputed::apply(reinterpret_cast<int64_t>(this), static_cast<int64_t>(Body::kBlock), at::TensorList(x));
    return block(x);
  }
  // The whole block: x + attn(ln1(x)), then x + mlp(ln2(x)).
  torch::Tensor block(torch::Tensor x) {
    const int64_t n = x.size(0), T = x.size(1) * (slot_.sequence ? slot_.parts : 1), hd = d_model_ / heads_;
    const int64_t heads = heads_ / slot_.parts;  // this rank's
    torch::Tensor h = ln1(x);
    torch::Tensor qkv_out = (qkv ? qkv(h) : qkv_part(h)).view({n, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    torch::Tensor q = qkv_out[0], k = qkv_out[1], v = qkv_out[2];  // [n, H, T, hd]
    torch::Tensor y = recompute == Recompute::kSelective && at::GradMode::is_enabled()
                          ? Recomputed::apply(reinterpret_cast<int64_t>(this), static_cast<int64_t>(Body::kAttention),
                                              at::TensorList({q, k, v}))
                          : attention(q, k, v);
    if (!slot_.sequence) {
      x = x + proj_drop(proj ? proj(y) : proj_part(y));
      h = ln2(x);
      return x + mlp_drop(fc2 ? fc2(torch::gelu(fc1(h))) : fc2_part(torch::gelu(fc1_part(h))));
    }
    const Placement block = Placement::split({T, d_model_}, 0, slot_.parts, slot_.index);  // of each sample
    x = x + proj_drop->forward_part(proj_part(y), block);
    h = ln2(x);
    return x + mlp_drop->forward_part(fc2_part(torch::gelu(fc1_part(h))), block);
  }
  // Causal self-attention's core, by hand (scaled_dot_product_attention differs across
  // versions): q, k, v [n, H, T, hd] -> [n, T, H * hd].
  torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    const int64_t n = q.size(0), heads = q.size(1), T = q.size(2), hd = q.size(3);
    torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
    // Built on the fly (not a buffer: buffers would be saved in checkpoints).
    torch::Tensor future =
        torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
    att = torch::softmax(att.masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
    att = slot_.parts > 1 ? attn_drop->forward_part(att, Placement::split({heads_, T, T}, 0, slot_.parts, slot_.index))
                          : attn_drop(att);
    return torch::matmul(att, v).transpose(1, 2).reshape({n, T, heads * hd});
  }
  // One step of a decoder (GptDecoder): x [1, t, d] are the next t positions, after the
  // `past` positions whose keys and values the cache's buffers [1, heads, context, hd] hold
  // (eval mode, whole layers); this step's are written after them, in place.
  torch::Tensor decode(const torch::Tensor& x, torch::Tensor& key_cache, torch::Tensor& value_cache, int64_t past) {
    const int64_t n = x.size(0), t = x.size(1), hd = d_model_ / heads_;
    torch::Tensor qkv_out = decode_linear(qkv, ln1(x)).view({n, t, 3, heads_, hd}).permute({2, 0, 3, 1, 4});
    torch::Tensor q = qkv_out[0];
    key_cache.narrow(2, past, t).copy_(qkv_out[1]);
    value_cache.narrow(2, past, t).copy_(qkv_out[2]);
    const torch::Tensor keys = key_cache.narrow(2, 0, past + t), values = value_cache.narrow(2, 0, past + t);
    const int64_t L = past + t;
    torch::Tensor att = torch::matmul(q, keys.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
    // Query i (position past + i) sees keys 0 .. past + i.
    torch::Tensor future = torch::ones({t, L}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(past + 1);
    att = torch::softmax(att.masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
    torch::Tensor y = torch::matmul(att, values).transpose(1, 2).reshape({n, t, d_model_});
    torch::Tensor h = x + decode_linear(proj, y);
    return h + decode_linear(fc2, torch::gelu(decode_linear(fc1, ln2(h))));
  }
  int64_t heads() const { return heads_; }
  void pretty_print(std::ostream& os) const override {
    os << "GptBlock(d_model=" << d_model_ << ", heads=" << heads_ << ", d_ff=" << d_ff_
       << ", dropout=" << dropout_ << ")";
  }

  LayerNorm ln1{nullptr}, ln2{nullptr};
  Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
  ParallelLinear qkv_part{nullptr}, proj_part{nullptr}, fc1_part{nullptr}, fc2_part{nullptr};  // tensor-parallel
  Dropout attn_drop{nullptr}, proj_drop{nullptr}, mlp_drop{nullptr};
  Recompute recompute = Recompute::kNone;  // Note [Recompute]: set_recompute

 private:
  int64_t d_model_, heads_, d_ff_;
  double dropout_;
  TensorSlot slot_;
};
TORCH_MODULE(GptBlock);

at::Tensor run_body(GptBlockImpl& block, Body body, const std::vector<at::Tensor>& inputs) {
  return body == Body::kBlock ? block.block(inputs.at(0)) : block.attention(inputs.at(0), inputs.at(1), inputs.at(2));
}

torch::autograd::variable_list Recomputed::backward(torch::autograd::AutogradContext* ctx,
                                                    torch::autograd::variable_list grads) {
  const std::vector<at::Tensor> saved = ctx->get_saved_variables();
  auto& block = *reinterpret_cast<GptBlockImpl*>(ctx->saved_data["block"].toInt());
  const auto body = static_cast<Body>(ctx->saved_data["body"].toInt());
  const auto key = ctx->saved_data["random"].toIntVector();
  std::vector<at::Tensor> in;
  for (size_t i = 0; i < saved.size(); ++i) {
    at::Tensor x = saved[i].detach();
    if (ctx->needs_input_grad(i) && x.is_floating_point()) x.requires_grad_(true);
    in.push_back(x);
  }
  at::Tensor y;
  {
    RandomContext context;
    context.seed = static_cast<uint64_t>(key.at(0));
    context.step = key.at(1);
    context.first_sample = key.at(2);
    context.active = key.at(3) != 0;
    RandomContext::Scope random(context);
    compat::Autocast autocast(ctx->saved_data["autocast"].toBool(), in.front().device().type());
    at::AutoGradMode grad(true);
    y = run_body(block, body, in);
  }
  torch::autograd::variable_list out(2);  // block, body: not tensors
  if (y.requires_grad()) torch::autograd::backward({y}, {grads.at(0)});
  for (const at::Tensor& x : in) out.push_back(x.requires_grad() ? x.grad() : at::Tensor());
  return out;
}

// Final LayerNorm + Linear to the vocabulary: [n, T, d] -> [n, T, vocab]. Under tensor
// parallelism the Linear is column-parallel by vocabulary and the output is this rank's
// block of the logits [n, T, vocab / parts], which the vocabulary-parallel loss takes as
// they are (Note [Vocabulary-parallel loss]). Under sequence parallelism the norm runs on
// this rank's block of the sequence and the Linear gathers it.
class GptHeadImpl : public torch::nn::Cloneable<GptHeadImpl> {
 public:
  GptHeadImpl(int64_t d_model, int64_t vocab, bool bias, TensorSlot slot)
      : d_model_(d_model), vocab_(vocab), bias_(bias), slot_(slot) {
    reset();
  }
  void reset() override {
    ln = register_module("ln", LayerNorm(std::vector<int64_t>{d_model_}));
    if (slot_.parts > 1)
      out_part = register_module("out", ParallelLinear(d_model_, vocab_, ParallelLinearImpl::Split::kColumn, slot_,
                                                       bias_, kGptWeight, kGptBias));
    else
      out = register_module("out", Linear(d_model_, vocab_, bias_, kGptWeight, kGptBias));
  }
  torch::Tensor forward(torch::Tensor x) { return out ? out(ln(x)) : out_part(ln(x)); }
  void pretty_print(std::ostream& os) const override {
    os << "GptHead(d_model=" << d_model_ << ", vocab=" << vocab_ << (bias_ ? "" : ", bias=false") << ")";
  }

  LayerNorm ln{nullptr};
  Linear out{nullptr};
  ParallelLinear out_part{nullptr};  // tensor-parallel

 private:
  int64_t d_model_, vocab_;
  bool bias_;
  TensorSlot slot_;
};
TORCH_MODULE(GptHead);

// ---- builders ---------------------------------------------------------------------------


void push_activation(torch::nn::Sequential& seq, const std::string& activation) {
  if (activation == "relu")
    seq->push_back(torch::nn::ReLU());
  else if (activation == "gelu")
    seq->push_back(torch::nn::GELU());
  else if (activation == "tanh")
    seq->push_back(torch::nn::Tanh());
  else
    throw ConfigError(
        concat("unknown model.activation '", activation, "' (known: relu, gelu, tanh)"));
}

void check_common(const ModelSpec& spec) {
  if (!(spec.dropout >= 0.0 && spec.dropout < 1.0))
    throw ConfigError(concat("model.dropout must be in [0, 1), got ", spec.dropout));
  for (size_t i = 0; i < spec.hidden.size(); ++i)
    if (spec.hidden[i] < 1)
      throw ConfigError(concat("model.hidden[", i, "] must be >= 1, got ", spec.hidden[i]));
}

// Dense hidden layers (Linear, activation, dropout) and the final Linear to classes.
void push_dense(torch::nn::Sequential& seq, const ModelSpec& spec, int64_t in, int64_t classes) {
  for (int64_t width : spec.hidden) {
    seq->push_back(Linear(in, width));
    push_activation(seq, spec.activation);
    if (spec.dropout > 0) seq->push_back(Dropout(spec.dropout));
    in = width;
  }
  seq->push_back(Linear(in, classes));
}

torch::nn::Sequential build_mlp(const ModelSpec& spec, const DataInfo& data) {
  check_common(spec);
  int64_t in = 1;
  for (int64_t d : data.input_shape) in *= d;
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Flatten());
  push_dense(seq, spec, in, data.num_classes);
  return seq;
}

torch::nn::Sequential build_cnn(const ModelSpec& spec, const DataInfo& data) {
  check_common(spec);
  if (data.input_shape.size() != 3)
    throw ConfigError(concat("model.type cnn needs image inputs of [C, H, W]; the data (",
                             data.description, ") has examples of shape ",
                             shape_str(data.input_shape)));
  if (spec.channels.empty()) throw ConfigError("model.channels must list at least one conv block");
  int64_t c = data.input_shape[0], h = data.input_shape[1], w = data.input_shape[2];
  torch::nn::Sequential seq;
  for (size_t i = 0; i < spec.channels.size(); ++i) {
    const int64_t out = spec.channels[i];
    if (out < 1)
      throw ConfigError(concat("model.channels[", i, "] must be >= 1, got ", out));
    seq->push_back(Conv2d(c, out, 3, /*padding=*/1));
    push_activation(seq, spec.activation);
    seq->push_back(torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)));
    c = out;
    h /= 2;
    w /= 2;
    if (h < 1 || w < 1)
      throw ConfigError(concat("model.channels has ", spec.channels.size(),
                               " conv blocks, too many for ", data.input_shape[1], "x",
                               data.input_shape[2], " images: each halves the size, and block ",
                               i + 1, " leaves nothing"));
  }
  seq->push_back(torch::nn::Flatten());
  push_dense(seq, spec, c * h * w, data.num_classes);
  return seq;
}

std::string data_name(const DataInfo& data);

torch::nn::Sequential build_gpt(const ModelSpec& spec, const DataInfo& data, TensorSlot slot) {
  if (!(spec.dropout >= 0.0 && spec.dropout < 1.0))
    throw ConfigError(concat("model.dropout must be in [0, 1), got ", spec.dropout));
  if (spec.d_model < 1 || spec.heads < 1 || spec.layers < 0)
    throw ConfigError(concat("model.d_model and model.heads must be >= 1 and model.layers >= 0, got ",
                             spec.d_model, ", ", spec.heads, ", ", spec.layers));
  if (spec.d_model % spec.heads != 0)
    throw ConfigError(concat("model.d_model ", spec.d_model, " is not divisible by model.heads ",
                             spec.heads));
  if (spec.d_ff < 0) throw ConfigError(concat("model.d_ff must be >= 0, got ", spec.d_ff));
  if (data.seq_len < 1)
    throw ConfigError(concat("model.type gpt needs data.seq_len >= 1, got ", data.seq_len));
  const int64_t d_ff = spec.d_ff > 0 ? spec.d_ff : 4 * spec.d_model;
  if (slot.parts > 1) {
    // What the tensor section's --check cannot see: the vocabulary comes with the data.
    if (data.num_classes % slot.parts != 0)
      throw ConfigError(concat("mesh.tensor ", slot.parts, " does not divide the vocabulary of ", data.num_classes,
                               " tokens (", data_name(data), "), which the embedding and the output layer split; "
                               "use a tensor degree that divides it"));
    if (slot.sequence && data.seq_len % slot.parts != 0)
      throw ConfigError(concat("tensor.sequence_parallel splits the sequence of ", data.seq_len, " tokens (",
                               data_name(data), ") into mesh.tensor ", slot.parts,
                               " equal blocks, and it does not divide; use a tensor degree that divides the "
                               "sequence length or sequence_parallel: false"));
    TETRA_CHECK(spec.heads % slot.parts == 0 && d_ff % slot.parts == 0, "mesh.tensor ", slot.parts,
                " must divide model.heads ", spec.heads, " and model.d_ff ", d_ff);
  }
  torch::nn::Sequential seq;
  seq->push_back(GptEmbedding(data.num_classes, data.seq_len, spec.d_model, spec.dropout, slot));
  for (int64_t i = 0; i < spec.layers; ++i)
    seq->push_back(GptBlock(spec.d_model, spec.heads, d_ff, spec.dropout, slot));
  seq->push_back(GptHead(spec.d_model, data.num_classes, spec.head_bias, slot));
  return seq;
}

std::string data_name(const DataInfo& data) {
  if (!data.description.empty()) return data.description;
  return data.language_model ? "a language-model dataset" : "a classification dataset";
}

torch::nn::Sequential build_layers(const ModelSpec& spec, const DataInfo& data, TensorSlot slot) {
  const bool known = spec.type == "mlp" || spec.type == "cnn" || spec.type == "gpt";
  if (!known)
    throw ConfigError(concat("unknown model.type '", spec.type, "' (known: mlp, cnn, gpt)"));
  if (data.num_classes < 1)
    throw ConfigError(concat("the data (", data_name(data), ") has no classes"));
  if (spec.type == "gpt") {
    if (!data.language_model)
      throw ConfigError(concat("model.type gpt is a language model and needs text data "
                               "(data.type text), but the data is ",
                               data_name(data)));
    return build_gpt(spec, data, slot);
  }
  if (slot.parts > 1)
    throw ConfigError(concat("mesh.tensor ", slot.parts, " splits the layers of model.type gpt; model.type ", spec.type,
                             " has no tensor-parallel layers"));
  if (data.language_model)
    throw ConfigError(concat("model.type ", spec.type,
                             " is a classifier and needs fashion-mnist or synthetic data, but "
                             "the data is ",
                             data_name(data), " (use model.type gpt)"));
  return spec.type == "mlp" ? build_mlp(spec, data) : build_cnn(spec, data);
}

}  // namespace

torch::nn::Sequential model_shapes(const ModelSpec& spec, const DataInfo& data, TensorSlot slot) {
  torch::nn::Sequential model = build_layers(spec, data, slot);
  // Ids from the model's structure alone: every process and pipeline stage builds the whole
  // model's shapes, so a dropout has the same id wherever it runs (Note [Layout-invariant
  // dropout]).
  number_dropout_layers(*model);
  return model;
}

torch::nn::Sequential build_model(const ModelSpec& spec, const DataInfo& data, uint64_t seed) {
  torch::nn::Sequential model = model_shapes(spec, data);
  Materializer(*model, seed).create_all(*model);
  return model;
}

void set_recompute(torch::nn::Sequential& model, Recompute recompute) {
  int blocks = 0;
  for (auto& layer : *model)
    if (auto* block = layer.ptr()->as<GptBlockImpl>()) {
      block->recompute = recompute;
      ++blocks;
    }
  if (recompute != Recompute::kNone && blocks == 0)
    throw ConfigError(concat("train.recompute: ", to_string(recompute),
                             " recomputes a gpt's transformer blocks, and this model has none: use none"));
}

GptDecoder::GptDecoder(torch::nn::Sequential model) : model_(std::move(model)) {
  TETRA_CHECK(model_->size() >= 2 && model_->ptr(0)->as<GptEmbeddingImpl>() &&
                  model_->ptr(model_->size() - 1)->as<GptHeadImpl>(),
              "a decoder needs a gpt (an embedding, blocks, a head), got ", describe(model_));
  auto* embedding = model_->ptr(0)->as<GptEmbeddingImpl>();
  TETRA_CHECK(embedding->tok, "a decoder needs the whole model, not a tensor-parallel part of it");
  context_ = embedding->pos.size(0);
  vocab_ = embedding->tok->weight.size(0);
  model_->eval();
  reset();
}

void GptDecoder::reset() {
  // The buffers stay (made at the first next()); only the positions are forgotten.
  const size_t blocks = model_->size() - 2;
  keys_.resize(blocks);
  values_.resize(blocks);
  length_ = 0;
}

torch::Tensor GptDecoder::next(const torch::Tensor& tokens) {
  const int64_t t = tokens.numel();
  TETRA_CHECK(t >= 1 && length_ + t <= context_, "the decoder holds ", length_, " positions of a context of ", context_,
              ": ", t, " more do not fit");
  torch::NoGradGuard no_grad;
  auto* embedding = model_->ptr(0)->as<GptEmbeddingImpl>();
  const torch::Tensor ids = tokens.reshape({1, t}).to(embedding->pos.device(), torch::kLong);
  torch::Tensor x = embedding->tok(ids) + embedding->pos.slice(0, length_, length_ + t).unsqueeze(0);
  for (size_t b = 0; b + 2 < model_->size(); ++b) {
    auto* block = model_->ptr(b + 1)->as<GptBlockImpl>();
    if (!keys_[b].defined()) {  // the whole context's room, once
      keys_[b] = torch::empty({1, block->heads(), context_, x.size(2) / block->heads()}, x.options());
      values_[b] = torch::empty_like(keys_[b]);
    }
    x = block->decode(x, keys_[b], values_[b], length_);
  }
  length_ += t;
  auto* head = model_->ptr(model_->size() - 1)->as<GptHeadImpl>();
  return decode_linear(head->out, head->ln(x.select(1, t - 1)))[0];
}

torch::Tensor model_loss(const torch::Tensor& output, const torch::Tensor& targets) {
  torch::Tensor out = output.scalar_type() == torch::kFloat || output.scalar_type() == torch::kDouble
                          ? output
                          : output.to(torch::kFloat);
  if (out.dim() == 3) {
    const int64_t V = out.size(2);
    return torch::nn::functional::cross_entropy(out.reshape({-1, V}), targets.reshape({-1}));
  }
  return torch::nn::functional::cross_entropy(out, targets);
}

int64_t count_correct(const torch::Tensor& output, const torch::Tensor& targets) {
  torch::NoGradGuard no_grad;
  return output.argmax(-1).eq(targets).sum().item<int64_t>();
}

int64_t parameter_count(const torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters(/*recurse=*/true)) n += p.numel();
  return n;
}

at::Tensor linear_weight(const torch::nn::Module& m) {
  if (auto* lin = dynamic_cast<const LinearImpl*>(&m)) return lin->weight;
  if (auto* lin = dynamic_cast<const torch::nn::LinearImpl*>(&m)) return lin->weight;
  if (auto* lin = dynamic_cast<const ParallelLinearImpl*>(&m)) return lin->weight;  // this rank's part
  return {};
}

at::Tensor conv_weight(const torch::nn::Module& m) {
  if (auto* conv = dynamic_cast<const Conv2dImpl*>(&m)) return conv->weight;
  if (auto* conv = dynamic_cast<const torch::nn::Conv2dImpl*>(&m)) return conv->weight;
  return {};
}

std::string layer_signature(const torch::nn::Module& layer, const torch::Tensor& input) {
  std::ostringstream os;
  os << layer_text(layer) << " on " << input.sizes() << " " << input.scalar_type();
  for (const auto& p : layer.named_parameters()) os << " " << p.key() << p.value().sizes() << p.value().scalar_type();
  for (const auto& b : layer.named_buffers()) os << " " << b.key() << b.value().sizes() << b.value().scalar_type();
  return os.str();
}

LayerProbe probe_layers(torch::nn::Sequential& model, const torch::Tensor& sample, int64_t max_tokens) {
  LayerProbe probe;
  torch::Tensor x = sample;
  // A long token sequence runs as its first max_tokens positions (every layer of the zoo
  // is position-wise but attention, whose seq x seq term forward_flops scales itself).
  if (max_tokens > 0 && !sample.is_floating_point() && sample.dim() == 2 && sample.size(1) > max_tokens) {
    probe.scale = double(sample.size(1)) / double(max_tokens);
    x = sample.narrow(1, 0, max_tokens);
  }
  const bool was_training = model->is_training();
  model->eval();
  {
    torch::NoGradGuard no_grad;
    // A layer like one already run (the same signature: a transformer's repeated blocks)
    // gives an output of the same shape and dtype: its output is reused, not recomputed.
    std::map<std::string, torch::Tensor> seen;
    for (auto& layer : *model) {
      LayerShapes s;
      s.input = x;
      const std::string key = layer_signature(*layer.ptr(), x);
      auto it = seen.find(key);
      if (it != seen.end()) {
        x = it->second;
      } else {
        // A model built as shapes runs one layer at a time in real memory, freed after.
        MaterializedScope created(*layer.ptr());
        x = layer.forward(x);
        seen.emplace(key, x);
      }
      s.output = x;
      probe.layers.push_back(s);
    }
  }
  if (was_training) model->train();
  return probe;
}

// Note [Kept bytes]
// What a step keeps between a layer's forward and its backward is what autograd saved for
// it: inputs of its products, softmax outputs, dropout masks, attention's seq x seq tensors,
// which for a transformer block are many times its output (Korthikanti et al. count
// 34 s b h + 5 a s^2 b bytes at 16 bits). Rather than a formula per layer kind, the probe
// measures it: each kind of layer runs forward once in training mode with its graph, and
// the bytes allocated and still held when it returns (CountedBytes: the graph's saved
// tensors and the output) are what it keeps; the first run warms the kernels' own caches
// and is not counted. Under train.recompute the same measure sees what the recompute keeps
// (a block's output, or all but attention's core), and the block is measured again without
// it: the difference is what its recomputation holds in backward, one block at a time.
// The estimate (Note [Per-rank estimate]) takes the sum of the layers' kept bytes, and
// the largest recomputation, per sample of the micro-batch.
namespace {
void measure_kept_in_training(torch::nn::Sequential& model, LayerProbe& probe);
}  // namespace

void measure_kept(torch::nn::Sequential& model, LayerProbe& probe) {
  probe.kept.clear();
  probe.recompute.clear();
  // Counting sees host memory: a program's own model already on a GPU is left to the
  // outputs' count.
  for (const auto& p : model->parameters())
    if (!p.is_meta() && !p.device().is_cpu()) return;
  const bool was_training = model->is_training();
  try {
    measure_kept_in_training(model, probe);
  } catch (const std::exception&) {
    // A program's own layer that cannot run forward with its graph here: its outputs.
    probe.kept.clear();
    probe.recompute.clear();
  }
  if (!was_training) model->eval();
}

namespace {
void measure_kept_in_training(torch::nn::Sequential& model, LayerProbe& probe) {
  const size_t L = probe.layers.size();
  probe.kept.assign(L, 0);
  probe.recompute.assign(L, 0);
  model->train();
  RandomContext::Scope random(0, 0, 0);
  at::AutoGradMode grad(true);
  auto kept_at = [](torch::nn::AnyModule& layer, const torch::Tensor& x, int64_t T) {
    torch::Tensor in = (T > 0 ? x.narrow(1, 0, T) : x).detach().clone();
    if (in.is_floating_point()) in.requires_grad_(true);
    layer.forward(in);  // warm-up: kernels' first-call allocations
    CountedBytes count;
    torch::Tensor y = layer.forward(in);
    return count.live();
  };
  std::map<std::string, std::pair<int64_t, int64_t>> seen;
  size_t i = 0;
  for (auto& layer : *model) {
    if (i >= L) break;
    const torch::Tensor& x = probe.layers[i].input;
    const std::string key = layer_signature(*layer.ptr(), x);
    auto it = seen.find(key);
    if (it == seen.end()) {
      MaterializedScope created(*layer.ptr());
      auto measure = [&] {
        if (probe.scale <= 1 || x.dim() < 2) return kept_at(layer, x, 0);
        // The quadratic through T = 16, 32, 64 (the probe's length), at the whole length.
        const int64_t T3 = x.size(1), T2 = T3 / 2, T1 = T3 / 4;
        const double f1 = double(kept_at(layer, x, T1)), f2 = double(kept_at(layer, x, T2)),
                     f3 = double(kept_at(layer, x, T3));
        // f(T) = a + b T + c T^2 with T2 = 2 T1, T3 = 4 T1.
        const double t = double(T1);
        const double c = ((f3 - f2) / (2 * t) - (f2 - f1) / t) / (3 * t);
        const double b = (f2 - f1) / t - 3 * c * t;
        const double a = f1 - b * t - c * t * t;
        const double S = double(T3) * probe.scale;
        return static_cast<int64_t>(std::llround(a + b * S + c * S * S));
      };
      int64_t kept = measure(), extra = 0;
      if (auto* block = layer.ptr()->as<GptBlockImpl>(); block && block->recompute != Recompute::kNone) {
        const Recompute mode = block->recompute;
        block->recompute = Recompute::kNone;
        extra = std::max<int64_t>(0, measure() - kept);
        block->recompute = mode;
      }
      it = seen.emplace(key, std::make_pair(kept, extra)).first;
    }
    probe.kept[i] = it->second.first;
    probe.recompute[i] = it->second.second;
    ++i;
  }
}
}  // namespace

std::vector<double> forward_flops(torch::nn::Sequential& model, const torch::Tensor& sample) {
  return forward_flops(model, probe_layers(model, sample));
}

std::vector<double> forward_flops(torch::nn::Sequential& model, const LayerProbe& probe) {
  std::vector<double> out;
  for (size_t i = 0; i < model->size(); ++i) {
    const torch::Tensor& in = probe.layers[i].input;
    const torch::Tensor& y = probe.layers[i].output;
    const std::shared_ptr<torch::nn::Module> layer = model->ptr(i);
    // Rows a Linear of this layer multiplies: the output's positions (1 for an MLP, the
    // sequence for a transformer block or head).
    double rows = (y.dim() > 0 ? double(y.numel()) / double(y.size(-1)) : 1) * probe.scale;
    // Sequence parallelism: the layer's input is this rank's block of the sequence, and its
    // split Linears multiply the gathered sequence (T blocks).
    for (const auto& m : layer->modules(/*include_self=*/true))
      if (const auto* p = dynamic_cast<const ParallelLinearImpl*>(m.get()); p && p->slot().sequence && in.dim() > 0) {
        rows = double(in.numel()) / double(in.size(-1)) * p->slot().parts * probe.scale;
        break;
      }
    // 3x3 "same" convolutions of the zoo: as many output positions as input ones.
    const double positions = in.dim() >= 2 ? double(in.size(-1) * in.size(-2)) : 1;
    double flops = 0;
    for (const auto& m : layer->modules(/*include_self=*/true)) {
      if (const at::Tensor w = linear_weight(*m); w.defined()) flops += 2.0 * double(w.numel()) * rows;
      if (const at::Tensor w = conv_weight(*m); w.defined()) flops += 2.0 * double(w.numel()) * positions;
    }
    for (const auto& child : layer->named_children())
      if (child.key() == "qkv")
        if (const at::Tensor w = linear_weight(*child.value()); w.defined())
          flops += 4.0 * rows * rows * double(w.size(0)) / 3.0;  // QK^T and AV, over this rank's heads
    out.push_back(flops);
  }
  return out;
}

std::string describe(const torch::nn::Sequential& model) {
  std::ostringstream os;
  const size_t n = model->size();
  const int width = static_cast<int>(std::to_string(n ? n - 1 : 0).size());
  for (size_t i = 0; i < n; ++i) {
    const auto layer = model->ptr(i);
    os << std::setw(width) << i << "  " << layer_text(*layer) << "  " << parameter_count(*layer)
       << " params\n";
  }
  os << "total " << parameter_count(*model) << " params\n";
  return os.str();
}

}  // namespace tetra::core
