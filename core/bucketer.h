// The gradient bucketer that data parallelism and ZeRO share (DESIGN.md: one bucketer
// in core, used by both gradient synchronisers).
//
// Note [Gradient buckets]
// Parameters are grouped into buckets: by size (about cap bytes each, in reverse order of
// definition — the order backward produces their gradients — one dtype per bucket), or
// in explicit groups (ZeRO-3: one bucket per layer of the model's sequence). Each bucket
// is a flat range of `padded` elements: the slots of its parameters back to back, then
// zeros up to a multiple of `pad_to` (so that a reduce-scatter can cut it into equal
// shards). A post hook on each parameter's AccumulateGrad node (as PyTorch DDP's reducer
// does) reports the moment autograd has accumulated that parameter's gradient; mark()
// counts a bucket's slots and says when the last one arrived, which is when its
// communication can start while backward goes on computing earlier layers.
//
// Gradient as bucket view (DDP's gradient_as_bucket_view): bind() makes a parameter's
// .grad a view of its slot in a flat buffer the caller owns, so autograd accumulates
// straight into the buffer that is communicated. Something that replaces a .grad
// instead of writing into it is noticed by bind() (by data pointer) and copied back.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "core/optim.h"

namespace torch::autograd {
struct Node;
}

namespace tetra::core {

class GradientBuckets {
 public:
  struct Slot {
    NamedParam param;
    int bucket = 0;
    int64_t offset = 0, numel = 0;  // within the bucket
    at::Tensor view;                // the slot of the bound buffer (bind_views), shaped like the parameter
    std::shared_ptr<torch::autograd::Node> accumulator;  // kept alive: it carries the hook
  };
  struct Bucket {
    std::vector<int> slots;  // consecutive slot indices
    int64_t numel = 0;       // the slots' elements
    int64_t padded = 0;      // numel rounded up to pad_to
    at::ScalarType dtype = at::kFloat;
    int pending = 0;         // slots still to report this step
    std::vector<bool> filled;
  };

  // Buckets of about cap_bytes in reverse order of `params` (backward's order). Only
  // parameters that require a gradient take part.
  static GradientBuckets by_size(const std::vector<NamedParam>& params, int64_t cap_bytes, int64_t pad_to);
  // One bucket per group, in the given order (empty groups are skipped); parameters in
  // a group keep their order. Every parameter takes part, frozen ones included (ZeRO-3
  // must gather them); only those that require a gradient are counted by mark().
  static GradientBuckets by_groups(const std::vector<std::vector<NamedParam>>& groups, int64_t pad_to);

  GradientBuckets() = default;
  GradientBuckets(GradientBuckets&&) = default;
  GradientBuckets& operator=(GradientBuckets&&) = default;
  ~GradientBuckets();

  std::vector<Slot>& slots() { return slots_; }
  const std::vector<Slot>& slots() const { return slots_; }
  std::vector<Bucket>& buckets() { return buckets_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  int64_t max_padded() const;

  // Calls on_ready(slot) after autograd accumulated each parameter's gradient (called on
  // the thread that runs backward). Safe to outlive: hooks go quiet when this is destroyed.
  void hook(std::function<void(int slot)> on_ready);
  // Counts slot s as ready for this step; true when it completed its bucket. A slot
  // reported twice in a step counts once.
  bool mark(int slot);
  bool complete(int bucket) const { return buckets_[bucket].pending == 0; }
  // Forgets this step's readiness (of every bucket, or of one).
  void reset();
  void reset_bucket(int bucket);

  // Gradient as bucket view: buffers[b] (padded elements) backs bucket b; every slot's
  // .grad becomes its view.
  void bind_views(const std::vector<at::Tensor>& buffers);
  // Makes slot s's .grad its view again if something replaced it (copying what it held,
  // or zeros when it was left undefined).
  void bind(int slot);
  // Copies bucket b's gradients into `flat` (its padded length: the padding is zeroed)
  // and leaves each .grad undefined, so its memory goes back (ZeRO 2 and 3). A missing
  // .grad contributes zeros.
  void take_gradients(int bucket, const at::Tensor& flat);

 private:
  static void finish_layout(GradientBuckets& g, int64_t pad_to);
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);
};

}  // namespace tetra::core
