// A backward in two passes, B and W, for the zero-bubble schedules (schedule.h).
//
// Note [B and W on the autograd graph]
// A stage's backward does two kinds of work: the gradients of its activations, down to
// its input (B: what the previous stage waits for), and its weights' gradients (W: what
// nobody waits for until the optimizer step). Zero-bubble schedules run B at once and
// move W into the bubbles. The split is made on the autograd graph, as PyTorch's
// stage_backward_input / stage_backward_weight do, not per layer type (the zero-bubble
// repository's WeightGradStore patches Megatron's Linear): it works for every layer a
// stage holds — Linear, LayerNorm, embeddings, tensor-parallel layers — with no layer
// changed, and each gradient is computed once.
//
// After the forward, the graph's nodes are of two kinds. A node is parameter-derived when
// all it differentiates is parameters, directly or through other parameter-derived nodes
// (a weight's transpose, its cast under autocast); every other node carries activations.
// An activation node with an edge into a parameter or a parameter-derived node is a
// boundary: a Linear's addmm (input, weight^T, bias), a LayerNorm, the dropout over the
// embeddings. B runs the graph from the output's gradient to the stage's input, capturing
// the gradient that reaches each boundary: autograd then computes only what the input
// needs (a boundary on the way computes its input's gradient and skips its weight's:
// Node::should_compute_output), and a boundary off the way (the first layer of stage 0)
// only captures. The activations the graph saved are then let go, except the boundaries'
// (the inputs the weight gradients need: what the paper's M_W counts). W runs each
// boundary once from its captured gradient with the parameters as the only outputs, so
// autograd computes the weights' part alone and accumulates it into .grad, firing the
// gradient hooks the data-parallel and ZeRO buckets listen to.
//
// After B the activation nodes other than the boundaries let go of what they saved (as a
// fused backward's nodes do once run), so between B and W a micro-batch holds only what
// its weight gradients need. W is one autograd pass from every boundary at once, each
// through a proxy node that carries only the boundary's weight edges: the pass cannot walk
// down an activation edge to another boundary (and compute its weights a second time),
// and the boundary, called inside it, computes only its weights' outputs. A weight several
// boundaries reach (tied inside a stage) has their contributions summed before it
// accumulates, as in the fused backward. Every gradient is the fused backward's: the same
// nodes run on the same incoming gradients.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

namespace tetra::pipeline {

class SplitBackward {
 public:
  // B: from `root` (the stage's output, or the last stage's loss) with gradient `grad`
  // (undefined for a scalar loss: one), returns the gradient of `input` (undefined when
  // `input` does not require one) and keeps what W needs.
  at::Tensor input_pass(const at::Tensor& root, const at::Tensor& grad, const at::Tensor& input);
  // W: accumulates the weights' gradients; frees what B kept. Runs once, after B.
  void weight_pass();
  // True when B ran the whole backward (no weights under an activation): W does nothing.
  bool fused() const { return fused_; }

 private:
  std::vector<std::shared_ptr<torch::autograd::Node>> proxies_;  // one per boundary (split_backward.cpp)
  std::vector<at::Tensor> grads_;                                 // what B captured for them, in order
  std::vector<torch::autograd::Edge> params_;                     // the weights W accumulates
  bool fused_ = false;
};

}  // namespace tetra::pipeline
