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
};
// max_tokens 0 runs the whole sample, whatever its length (the pipeline's boundaries).
LayerProbe probe_layers(torch::nn::Sequential& model, const torch::Tensor& sample, int64_t max_tokens = 64);

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

// A layer's pretty print without the namespaces and the Impl of its type:
// "Linear(in_features=784, ...)", "GptBlock(d_model=128, ...)", "Residual" for a program's
// own "(anonymous namespace)::ResidualImpl".
std::string layer_text(const torch::nn::Module& layer);

// "Sequential(Flatten, Linear(784->1024), ReLU, ...)" one layer a line, with params.
std::string describe(const torch::nn::Sequential& model);

}  // namespace tetra::core
