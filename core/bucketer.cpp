#include "core/bucketer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

#include "collectives/error.h"

namespace tetra::core {

namespace {

// Runs `fn` after autograd accumulated a parameter's gradient into .grad. `alive` turns
// it off when the bucketer is gone but a graph still holds the node.
struct AfterAccumulate final : torch::autograd::FunctionPostHook {
  AfterAccumulate(std::shared_ptr<std::atomic<bool>> alive, std::function<void()> fn)
      : alive_(std::move(alive)), fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (alive_->load(std::memory_order_acquire)) fn_();
    return outputs;
  }

 private:
  std::shared_ptr<std::atomic<bool>> alive_;
  std::function<void()> fn_;
};

int64_t round_up(int64_t n, int64_t k) { return k <= 1 ? n : (n + k - 1) / k * k; }

}  // namespace

GradientBuckets::~GradientBuckets() {
  if (alive_) alive_->store(false, std::memory_order_release);
}

void GradientBuckets::finish_layout(GradientBuckets& g, int64_t pad_to) {
  for (auto& b : g.buckets_) {
    b.numel = 0;
    for (int s : b.slots) {
      g.slots_[s].offset = b.numel;
      b.numel += g.slots_[s].numel;
    }
    b.padded = round_up(std::max<int64_t>(b.numel, 1), pad_to);
    b.dtype = g.slots_[b.slots.front()].param.tensor.scalar_type();
    b.filled.assign(b.slots.size(), false);
  }
  g.reset();
}

GradientBuckets GradientBuckets::by_size(const std::vector<NamedParam>& params, int64_t cap_bytes, int64_t pad_to) {
  GradientBuckets g;
  const int64_t cap = std::max<int64_t>(1, cap_bytes);
  int64_t used = cap;  // start a new bucket at once
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    if (!it->tensor.requires_grad()) continue;
    const int64_t bytes = it->tensor.numel() * static_cast<int64_t>(it->tensor.element_size());
    const bool same_dtype = !g.buckets_.empty() &&
                            g.slots_[g.buckets_.back().slots.front()].param.tensor.scalar_type() == it->tensor.scalar_type();
    if (used + bytes > cap || !same_dtype) {
      g.buckets_.emplace_back();
      used = 0;
    }
    Slot s;
    s.param = *it;
    s.bucket = static_cast<int>(g.buckets_.size()) - 1;
    s.numel = it->tensor.numel();
    g.buckets_.back().slots.push_back(static_cast<int>(g.slots_.size()));
    g.slots_.push_back(std::move(s));
    used += bytes;
  }
  finish_layout(g, pad_to);
  return g;
}

GradientBuckets GradientBuckets::by_groups(const std::vector<std::vector<NamedParam>>& groups, int64_t pad_to) {
  GradientBuckets g;
  for (const auto& group : groups) {
    if (group.empty()) continue;
    g.buckets_.emplace_back();
    for (const auto& p : group) {
      TETRA_CHECK(p.tensor.scalar_type() == group.front().tensor.scalar_type(), "parameters ", group.front().name,
                  " and ", p.name, " of one bucket have different dtypes");
      Slot s;
      s.param = p;
      s.bucket = static_cast<int>(g.buckets_.size()) - 1;
      s.numel = p.tensor.numel();
      g.buckets_.back().slots.push_back(static_cast<int>(g.slots_.size()));
      g.slots_.push_back(std::move(s));
    }
  }
  finish_layout(g, pad_to);
  return g;
}

int64_t GradientBuckets::max_padded() const {
  int64_t m = 0;
  for (const auto& b : buckets_) m = std::max(m, b.padded);
  return m;
}

void GradientBuckets::hook(std::function<void(int slot)> on_ready) {
  auto fn = std::make_shared<std::function<void(int)>>(std::move(on_ready));
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& sl = slots_[i];
    if (!sl.param.tensor.requires_grad()) continue;
    sl.accumulator = torch::autograd::impl::grad_accumulator(sl.param.tensor);
    TETRA_CHECK(sl.accumulator, "parameter ", sl.param.name, " has no gradient accumulator");
    const int s = static_cast<int>(i);
    sl.accumulator->add_post_hook(std::make_unique<AfterAccumulate>(alive_, [fn, s] { (*fn)(s); }));
  }
}

bool GradientBuckets::mark(int slot) {
  Bucket& b = buckets_[slots_[slot].bucket];
  const size_t k = static_cast<size_t>(slot - b.slots.front());
  if (b.filled[k]) return false;
  b.filled[k] = true;
  return --b.pending == 0;
}

void GradientBuckets::reset() {
  for (size_t b = 0; b < buckets_.size(); ++b) reset_bucket(static_cast<int>(b));
}

void GradientBuckets::reset_bucket(int bucket) {
  Bucket& b = buckets_[bucket];
  b.pending = 0;
  for (size_t k = 0; k < b.slots.size(); ++k) {
    const bool counted = slots_[b.slots[k]].param.tensor.requires_grad();
    b.filled[k] = !counted;
    if (counted) ++b.pending;
  }
}

void GradientBuckets::bind_views(const std::vector<at::Tensor>& buffers) {
  TETRA_CHECK(buffers.size() == buckets_.size(), "bind_views: ", buffers.size(), " buffers for ", buckets_.size(),
              " buckets");
  at::NoGradGuard no_grad;
  for (auto& sl : slots_)
    sl.view = buffers[sl.bucket].narrow(0, sl.offset, sl.numel).view(sl.param.tensor.sizes());
  for (size_t s = 0; s < slots_.size(); ++s) bind(static_cast<int>(s));
}

void GradientBuckets::bind(int slot) {
  Slot& sl = slots_[slot];
  if (!sl.param.tensor.requires_grad()) return;
  at::Tensor& g = sl.param.tensor.mutable_grad();
  if (g.defined() && g.data_ptr() == sl.view.data_ptr()) return;
  at::NoGradGuard no_grad;
  if (g.defined())
    sl.view.copy_(g);
  else
    sl.view.zero_();
  g = sl.view;
}

void GradientBuckets::take_gradients(int bucket, const at::Tensor& flat) {
  const Bucket& b = buckets_[bucket];
  at::NoGradGuard no_grad;
  for (int s : b.slots) {
    Slot& sl = slots_[s];
    at::Tensor dst = flat.narrow(0, sl.offset, sl.numel);
    at::Tensor& g = sl.param.tensor.mutable_grad();
    if (g.defined()) {
      dst.copy_(g.reshape({-1}));
      g = at::Tensor();
    } else {
      dst.zero_();
    }
  }
  if (b.padded > b.numel) flat.narrow(0, b.numel, b.padded - b.numel).zero_();
}

}  // namespace tetra::core
