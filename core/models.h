// The model zoo. Every model is a torch::nn::Sequential of layers: that is what pipeline
// stages cut and what ZeRO-3 gathers layer by layer. Users of the C++ API bring their own
// Sequential; these are the ones a job spec names.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <string>

#include "core/data.h"
#include "core/job_spec.h"
#include "core/layers.h"

namespace tetra::core {

// Builds model.type for the data it will see (input shape, classes or vocabulary) as
// shapes: tetra's layers (core/layers.h), every parameter on the meta device, no storage
// (Note [Layout-invariant initialisation] in core/init.h). A Materializer creates what a
// rank holds. Its dropouts are tetra::core::Dropout, numbered in order
// (number_dropout_layers): in training mode they draw from the key a RandomContext::Scope
// sets (Note [Layout-invariant dropout]). Incompatible pairs (gpt on images, mlp on text)
// are ConfigErrors.
// `slot`: this rank's part of a tensor-parallel model (mesh.tensor parts, its coordinate):
// the gpt's layers split their matrices (Note [Tensor-parallel maps], core/tensor_group.h)
// and each rank builds its parts only; other models take parts = 1.
torch::nn::Sequential model_shapes(const ModelSpec& spec, const DataInfo& data, TensorSlot slot = {});
// The same model created whole, with the initial weights every layout draws at `seed`.
torch::nn::Sequential build_model(const ModelSpec& spec, const DataInfo& data, uint64_t seed);

// Note [Recompute] (models.cpp): what the gpt's blocks of `model` (built by model_shapes
// or build_model) keep for backward. A ConfigError when it asks to recompute and the
// model has no transformer block.
void set_recompute(torch::nn::Sequential& model, Recompute recompute);

// Text from a whole gpt (build_model's, or any model of the zoo's gpt layers with every
// parameter created), one position at a time: each block keeps the keys and values of the
// positions it has seen (a key-value cache), so a new token costs one position's forward.
// Eval mode (no dropout); the logits are the full forward's at the same positions (to
// float rounding: the products run on fewer rows).
class GptDecoder {
 public:
  explicit GptDecoder(torch::nn::Sequential model);
  int64_t context() const { return context_; }  // the longest sequence: the positional table's
  int64_t vocab() const { return vocab_; }
  int64_t length() const { return length_; }    // positions held
  // Forgets every position.
  void reset();
  // Runs `tokens` (int64, t of them) after the positions held; returns the logits [vocab]
  // of the last of them. The positions held plus t must fit the context.
  torch::Tensor next(const torch::Tensor& tokens);

 private:
  torch::nn::Sequential model_;
  std::vector<torch::Tensor> keys_, values_;  // per block: [1, heads, context, head dim], length() filled
  int64_t context_ = 0, vocab_ = 0, length_ = 0;
};

// The training loss of a model's output against targets: cross-entropy over classes,
// or over next tokens (output [n, seq, vocab] against targets [n, seq]), averaged over
// the examples (and tokens) of the batch.
torch::Tensor model_loss(const torch::Tensor& output, const torch::Tensor& targets);

// Number of correct top-1 predictions (classifiers) or correct next tokens.
int64_t count_correct(const torch::Tensor& output, const torch::Tensor& targets);

int64_t parameter_count(const torch::nn::Module& model);

// The weight of a Linear or Conv2d module, tetra's or torch::nn's (a tensor-parallel
// Linear's: this rank's part); undefined for others.
at::Tensor linear_weight(const torch::nn::Module& m);
at::Tensor conv_weight(const torch::nn::Module& m);

// One sample's input and output of each layer (no gradients, eval mode; a layer built as
// shapes is created for its forward and freed after, MaterializedScope; a layer of the
// signature of one already run takes that one's output, layer_signature). A sample of
// more than `max_tokens` tokens (64) runs as its first 64, and `scale` is how many times
// longer the whole one is: every layer of the zoo but attention works position by
// position, so the whole sample's outputs are `scale` times the probe's (forward_flops
// scales attention's seq x seq term itself). A billion-parameter model's plan then costs
// a 64-token forward of each kind of layer.
struct LayerShapes {
  torch::Tensor input, output;
};
struct LayerProbe {
  std::vector<LayerShapes> layers;
  double scale = 1;
  // measure_kept's, per layer, for one whole sample (empty until it runs).
  std::vector<int64_t> kept;       // what the layer's forward keeps for backward, its output included
  std::vector<int64_t> recompute;  // what its recomputation holds at once in backward, beyond that
};
// max_tokens 0 runs the whole sample, whatever its length (the pipeline's boundaries).
LayerProbe probe_layers(torch::nn::Sequential& model, const torch::Tensor& sample, int64_t max_tokens = 64);

// Note [Kept bytes] (models.cpp): fills probe.kept and probe.recompute by running each
// kind of layer forward with its graph, in training mode, under the layers' recompute
// setting and the caller's autocast, and counting the bytes the graph keeps (CountedBytes).
// A sample the probe cut to its first 64 tokens is measured at 16, 32 and 64 and the
// whole length taken from the quadratic through them (a transformer keeps a x T + b x T^2
// bytes, and a constant: exact, not a guess).
void measure_kept(torch::nn::Sequential& model, LayerProbe& probe);

// What makes two layers cost the same and give outputs of the same shape: the layer's
// printed type and options, its parameters' and buffers' names, shapes and dtypes, and the
// input's shape and dtype. A model's repeated blocks share one; a probe runs (and the
// pipeline times) each signature once.
std::string layer_signature(const torch::nn::Module& layer, const torch::Tensor& input);

// Each layer's forward FLOPs for one sample (2 per multiply-add), for the cost model
// (Note [Cost model]): the matmuls of its Linear and Conv2d modules, and attention's two
// seq x seq products in a module that holds a `qkv` Linear. Elementwise work (norms,
// activations, softmax) is not counted. `sample` is one input with its batch dimension
// of 1 (probe_layers).
std::vector<double> forward_flops(torch::nn::Sequential& model, const torch::Tensor& sample);
// The same from a probe already taken (probe_layers), running nothing.
std::vector<double> forward_flops(torch::nn::Sequential& model, const LayerProbe& probe);

// "Sequential(Flatten, Linear(784->1024), ReLU, ...)" one layer a line, with params.
std::string describe(const torch::nn::Sequential& model);

}  // namespace tetra::core
