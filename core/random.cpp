#include "core/random.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "collectives/error.h"

namespace tetra::core {

namespace {

thread_local RandomContext this_thread_context;

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;  // SplitMix64's increment

// The key of every mask element of one layer in one step; a row's key mixes in its sample.
uint64_t layer_key(const RandomContext& c, int64_t layer) {
  uint64_t k = splitmix64(c.seed);
  k = splitmix64(k ^ static_cast<uint64_t>(c.step));
  return splitmix64(k ^ static_cast<uint64_t>(layer));
}

}  // namespace

const RandomContext& RandomContext::current() { return this_thread_context; }

RandomContext::Scope::Scope(uint64_t seed, int64_t step, int64_t first_sample)
    : Scope(RandomContext{seed, step, first_sample, true}) {}

RandomContext::Scope::Scope(RandomContext context) : saved_(this_thread_context) {
  context.active = true;
  this_thread_context = context;
}

RandomContext::Scope::~Scope() { this_thread_context = saved_; }

torch::Tensor dropout_mask(const RandomContext& context, int64_t layer, double p, at::IntArrayRef shape,
                           at::ScalarType dtype, const Placement* part) {
  TETRA_CHECK(0.0 <= p && p < 1.0, "dropout probability must be in [0, 1), got ", p);
  TETRA_CHECK(!shape.empty(), "dropout needs a batch dimension (dim 0), got a scalar");
  torch::Tensor mask = torch::empty(shape, torch::TensorOptions().dtype(dtype));
  const int64_t rows = shape[0];
  const int64_t per_row = rows == 0 ? 0 : mask.numel() / rows;
  if (mask.numel() == 0) return mask;
  // Kept when the 32 bits are >= threshold: probability 1 - threshold / 2^32 = 1 - p
  // (to 2^-33). 64-bit, since p close to 1 rounds the threshold up to 2^32.
  const uint64_t threshold = static_cast<uint64_t>(std::llround(p * 4294967296.0));
  const uint64_t key = layer_key(context, layer);
  const int64_t first = context.first_sample;
  // A part's element j of a sample is element whole[j] of the whole sample's.
  std::vector<int64_t> whole;
  if (part && part->is_split()) {
    TETRA_CHECK(part->local_numel() == per_row, "dropout: a sample of ", per_row, " elements is not the part ",
                part->str(), " (", part->local_numel(), ")");
    whole.resize(static_cast<size_t>(per_row));
    for (const Placement::Run& r : part->runs(0, per_row))
      for (int64_t i = 0; i < r.length; ++i) whole[static_cast<size_t>(r.local_begin + i)] = r.whole_begin + i;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dropout_mask", [&] {
    // The scale rounded to the mask's dtype, as torch::dropout does.
    const scalar_t keep = static_cast<scalar_t>(1.0 / (1.0 - p));
    const scalar_t drop = static_cast<scalar_t>(0);
    scalar_t* out = mask.data_ptr<scalar_t>();
    // Every element is a function of its own index, so any partition of the range among
    // threads writes the same mask.
    at::parallel_for(0, mask.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
      int64_t row = begin / per_row, j = begin % per_row;
      if (!whole.empty()) {
        for (; begin < end; ++begin) {
          const uint64_t row_key = splitmix64(key ^ static_cast<uint64_t>(first + row));
          const int64_t w = whole[static_cast<size_t>(j)];
          const uint64_t bits = splitmix64(row_key + static_cast<uint64_t>(w >> 1) * kGamma);
          const uint64_t half = (w & 1) ? bits >> 32 : bits & 0xFFFFFFFFULL;
          out[begin] = half >= threshold ? keep : drop;
          if (++j == per_row) j = 0, ++row;
        }
        return;
      }
      while (begin < end) {
        const uint64_t row_key = splitmix64(key ^ static_cast<uint64_t>(first + row));
        const int64_t stop = std::min(end, (row + 1) * per_row);
        uint64_t bits = splitmix64(row_key + static_cast<uint64_t>(j >> 1) * kGamma);
        for (; begin < stop; ++begin, ++j) {
          if ((j & 1) == 0) bits = splitmix64(row_key + static_cast<uint64_t>(j >> 1) * kGamma);
          const uint64_t half = (j & 1) ? bits >> 32 : bits & 0xFFFFFFFFULL;
          out[begin] = half >= threshold ? keep : drop;
        }
        ++row;
        j = 0;
      }
    });
  });
  return mask;
}

DropoutImpl::DropoutImpl(double p, int64_t layer) : p_(p), layer_(layer) {
  TETRA_CHECK(0.0 <= p && p < 1.0, "Dropout probability must be in [0, 1), got ", p);
}

torch::Tensor DropoutImpl::forward(const torch::Tensor& x) {
  if (!is_training() || p_ == 0.0) return x;
  // Read here, on the calling thread: the mask's worker threads have contexts of their own.
  const RandomContext& context = RandomContext::current();
  TETRA_CHECK(context.active,
              "Dropout (layer ", layer_, ") ran in training mode without a RandomContext: open a "
              "tetra::core::RandomContext::Scope(seed, step, first_sample) around the forward, or "
              "call eval() on the model (Note [Layout-invariant dropout])");
  TETRA_CHECK(layer_ >= 0,
              "Dropout has no layer id: pass one to its constructor, or call "
              "tetra::core::number_dropout_layers(model) once the model is built");
  TETRA_CHECK(x.is_floating_point(), "Dropout needs a floating-point input, got ", x.scalar_type());
  torch::Tensor mask = dropout_mask(context, layer_, p_, x.sizes(), x.scalar_type());
  // Autograd keeps the mask for the backward: the gradient takes the same mask and scale.
  return x * mask;
}

torch::Tensor DropoutImpl::forward_part(const torch::Tensor& x, const Placement& part) {
  if (!is_training() || p_ == 0.0 || !part.is_split()) return forward(x);
  const RandomContext& context = RandomContext::current();
  TETRA_CHECK(context.active && layer_ >= 0, "Dropout (layer ", layer_,
              ") ran in training mode without a RandomContext or a layer id (Note [Layout-invariant dropout])");
  return x * dropout_mask(context, layer_, p_, x.sizes(), x.scalar_type(), &part);
}

void DropoutImpl::pretty_print(std::ostream& os) const {
  os << "Dropout(p=" << p_ << ", layer=" << layer_ << ")";
}

int64_t number_dropout_layers(torch::nn::Module& model, int64_t first) {
  model.apply([&first](torch::nn::Module& m) {
    if (auto* d = m.as<DropoutImpl>()) d->set_layer(first++);
  });
  return first;
}

}  // namespace tetra::core
