// The tensor group as a tensor-parallel layer sees it: Megatron's four mappings.
//
// Note [Tensor-parallel maps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor-parallel layer splits its weight over the T ranks of the tensor axis and joins
// the parts with one collective each way. Megatron writes the joins as autograd functions
// that are conjugate (tensor_parallel/mappings.py):
//
//   copy   (f)  forward: identity              backward: sum over the group
//   reduce (g)  forward: sum over the group    backward: identity
//   gather      forward: all-gather along dim  backward: reduce-scatter along dim
//   scatter     forward: reduce-scatter        backward: all-gather along dim
//
// A column-parallel Linear (weight split by output rows) takes copy(x): every rank holds
// the whole input and computes its block of the output, and in backward the input's
// gradient is the sum of every block's. A row-parallel Linear (split by input columns)
// takes its block of the input and gives reduce(x W_t^T): the partial products summed.
// Sequence parallelism (Korthikanti et al.) replaces copy / reduce around a block half by
// gather / scatter along the sequence, the same volume as one allreduce.
//
// Layers (core) call these and never a communicator; the tensor_parallel plugin
// implements them over its axis' communicator and binds them to the layers at attach.
// Until then a layer holds shapes_only(): the same shapes, nothing communicated, so that
// the pipeline's probes (which run a layer alone at its own attach) see a rank's shapes.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

#include "collectives/communicator.h"
#include "core/placement.h"

namespace tetra::core {

class TensorGroup {
 public:
  virtual ~TensorGroup() = default;
  virtual int size() const = 0;  // T
  virtual int rank() const = 0;  // this rank's part, 0..T-1

  virtual at::Tensor copy(const at::Tensor& x) = 0;    // f
  virtual at::Tensor reduce(const at::Tensor& x) = 0;  // g
  // x.size(dim) x T along dim: this rank's block at rank() (sequence parallelism).
  virtual at::Tensor gather(const at::Tensor& x, int64_t dim) = 0;
  // The sum over the group, then this rank's block of x.size(dim) / T along dim.
  virtual at::Tensor scatter(const at::Tensor& x, int64_t dim) = 0;
  // In place, outside autograd: t becomes the reduction of every rank's t.
  virtual void allreduce(at::Tensor& t, collectives::ReduceOp op) = 0;
  // A column-parallel Linear's input join and matmul: linear(copy(x), w, b), or with
  // seq_dim >= 0 (sequence parallelism) linear(gather(x, seq_dim), w, b). A group may fuse
  // them to overlap the input gradient's sum with the weight gradient's matmul (Note
  // [Overlapped input gradient], tensor_parallel/mappings.cpp); this is the plain one.
  virtual at::Tensor column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t seq_dim);
};

// Note [Vocabulary-parallel loss]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The output projection of a language model split by vocabulary leaves each rank the
// logits of its block of tokens [vocab_begin, vocab_begin + V/T). Megatron's
// vocab_parallel_cross_entropy takes the loss from them without gathering [N, V]: the
// row maximum (one allreduce max), then the sum of exp(z - max) over each block and the
// target's logit from the rank whose block holds it (one allreduce sum of both, packed);
// loss = log(sum) - z_target. Its backward needs no communication: softmax minus the
// target's one-hot, in the rank's own block. The arithmetic is one process's in another
// order: the sums over the vocabulary are taken block by block.
//
// Per-token losses [N] of logits [N, V/T] (fp32 inside, as model_loss) against targets [N]
// (indices into the whole vocabulary).
at::Tensor vocab_cross_entropy(TensorGroup& group, const at::Tensor& logits, const at::Tensor& targets,
                               int64_t vocab_begin);
// The whole vocabulary's argmax of each row (the first of equal maxima, as at::argmax) from
// logits [N, V/T] split by vocabulary: an allreduce max, then an allreduce min of the
// indices that reach it.
at::Tensor vocab_argmax(TensorGroup& group, const at::Tensor& logits, int64_t vocab_begin);

// The whole tensor that `part` (this rank's, at `at`; any shape) is part of, assembled from
// every rank's part over `group` (an allgather, then whole_of): on every rank. Collective;
// checkpoints and exports of split tensors.
at::Tensor gather_whole(collectives::Communicator& group, const Placement& at, const at::Tensor& part,
                        collectives::Duration timeout);

// A group of T ranks that communicates nothing: copy and reduce give x, gather repeats
// x T times along dim, scatter narrows to this rank's block. Shapes are a bound group's;
// values are not (except at T = 1, where it is exact).
std::shared_ptr<TensorGroup> shapes_only(int size, int rank);

// A layer that holds part of its weights (Note [Placements]) and joins the parts through
// a TensorGroup: it starts with shapes_only(T, index) and is bound to the real one by the
// tensor_parallel plugin at attach.
class TensorParallelLayer {
 public:
  virtual ~TensorParallelLayer() = default;
  virtual void bind(std::shared_ptr<TensorGroup> group) = 0;
};

}  // namespace tetra::core
