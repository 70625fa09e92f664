// Randomness that depends on the batch (dropout), drawn so that every split of the global
// batch draws the same numbers: a counter-based generator keyed by where each number is
// used, instead of a stream whose numbers depend on what was drawn before them.
//
// Note [Layout-invariant dropout]
// The numerics contract (DESIGN.md) asks every layout — data ranks, pipeline and
// accumulation micro-batches, replicas — to compute what one process computes. A mask drawn
// from torch's generator depends on the generator's history: on how many rows this process
// ran before, and in which order. So a mask element here is a pure function of what it
// belongs to instead:
//
//   keep(row i, element j) = bits32(seed, step, first_sample + i, layer, j) >= p * 2^32
//   output = keep ? x / (1 - p) : 0
//
// - seed: train.seed.
// - step: the optimizer step, 0-based. A resumed run continues the uninterrupted run's
//   masks from its step count alone; nothing else needs saving.
// - first_sample + i: row i's position in the step's global batch. Every layout cuts the
//   batch into contiguous slices (BatchPlan::slice), so one offset per forward names every
//   row: the trainer and the pipeline set it from the slice they run (RandomContext).
// - layer: the Dropout's id, numbered when the model is built (number_dropout_layers), so
//   it is the same in every process and pipeline stage, and two dropouts never share masks.
// - j: the element's row-major index within its sample (dim 0 is the batch), whatever the
//   memory layout of x.
//
// The hash: splitmix64 chained over (seed, step, layer, sample) gives each row a key; the
// elements 2q and 2q+1 take the low and high 32 bits of splitmix64(key + q * gamma), which
// is SplitMix64's own output stream started at that key. Cheap (one multiply-xorshift
// mixer per two elements), and nothing is kept between calls: the pipeline's recompute
// under activation checkpointing draws the same mask by calling again under the same key,
// and thread-ranks draw without sharing or locking anything (the context is thread_local).
//
// A training-mode forward of a Dropout with p > 0 and no RandomContext throws: a silent
// default key would draw the same mask at every step, and torch's generator would break
// the contract silently. Eval mode and p = 0 need no context (they draw nothing).
#pragma once

#include <torch/nn/cloneable.h>

#include <cstdint>
#include <ostream>

#include "core/placement.h"

namespace tetra::core {

// SplitMix64's output function (Steele, Lea, Flood 2014): a bijective mixer of 64 bits.
constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// The key of the random draws of the forwards this thread runs now
// (Note [Layout-invariant dropout]).
struct RandomContext {
  uint64_t seed = 0;
  int64_t step = 0;          // the optimizer step (0-based) the forward belongs to
  int64_t first_sample = 0;  // row 0 of the forward's input is this row of the global batch
  bool active = false;       // false: no Scope is open (a training Dropout throws)

  // The same key for a forward whose row 0 comes `rows` further into the global batch
  // (a micro-batch of this rank's slice).
  RandomContext offset(int64_t rows) const {
    RandomContext c = *this;
    c.first_sample += rows;
    return c;
  }

  // This thread's context; inactive when no Scope is open.
  static const RandomContext& current();

  class Scope;
};

// Sets this thread's context for the Scope's lifetime and puts the previous one back after
// (scopes nest: a micro-batch's key inside the step's).
class RandomContext::Scope {
 public:
  Scope(uint64_t seed, int64_t step, int64_t first_sample);
  explicit Scope(RandomContext context);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  RandomContext saved_;
};

// The scaled keep mask of a dropout with probability p on an input of `shape` (dim 0 the
// batch): 1 / (1 - p) where kept, 0 where dropped, in `dtype`, contiguous, without grad.
// Pure: the same arguments give the same mask on any thread, process or machine.
// `part`, for an input that is one rank's part of a tensor split over a tensor group (Note
// [Placements], core/placement.h): where each sample's elements lie in the whole sample
// (its view excludes dim 0). Each element then takes the bit of its index in the whole
// sample, so the ranks' masks are the parts of the mask one process draws.
torch::Tensor dropout_mask(const RandomContext& context, int64_t layer, double p, at::IntArrayRef shape,
                           at::ScalarType dtype, const Placement* part = nullptr);

// Dropout whose masks follow Note [Layout-invariant dropout]. `layer` names it in the key;
// a model built by build_model numbers its dropouts itself, and a Sequential of one's own
// can pass ids here or call number_dropout_layers once it is built. In training mode with
// p > 0 it needs a RandomContext and an id (it throws without either); in eval mode it
// is the identity.
class DropoutImpl : public torch::nn::Cloneable<DropoutImpl> {
 public:
  explicit DropoutImpl(double p = 0.5, int64_t layer = -1);
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x);
  // x is this rank's part of a tensor split over a tensor group: `part` places each sample
  // (dim 0 excluded) in the whole one's (dropout_mask).
  torch::Tensor forward_part(const torch::Tensor& x, const Placement& part);
  void pretty_print(std::ostream& os) const override;

  double p() const { return p_; }
  int64_t layer() const { return layer_; }
  void set_layer(int64_t layer) { layer_ = layer; }

 private:
  double p_;
  int64_t layer_;
};
TORCH_MODULE(Dropout);

// Numbers every Dropout in `model` first, first + 1, ... in the order of model.modules()
// (depth first, in registration order): the same ids wherever the same model is built.
// Returns the next free id.
int64_t number_dropout_layers(torch::nn::Module& model, int64_t first = 0);

}  // namespace tetra::core
