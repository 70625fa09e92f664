#include "core/optim.h"

#include <torch/types.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>

#include <cmath>
#include <experimental/simd>
#include <type_traits>

#include "collectives/error.h"

namespace tetra::core {

// ---- one update of one range ---------------------------------------------------------

namespace {

namespace stdx = std::experimental;

// Ranges longer than this are split across the intra-op threads.
constexpr int64_t kGrain = 16384;

// The kernels: one element's update, written once for V = a SIMD vector of T and for
// V = T (the tail), so that both round alike. Explicit SIMD rather than a plain loop left
// to the compiler: GCC keeps sqrt's errno (no -ffast-math / -fno-math-errno here, and the
// optimize attribute does not lift it), and a loop with a sqrt that may set errno is not
// vectorized at all. Each comment names the ATen op of
// reference_update that the line repeats; the scalars are T, as ATen casts them.
// kReadA/kWriteA/kUseB: which of the two slots the kernel loads and stores.
template <typename T, bool kDecay, bool kMomentum, bool kNesterov, bool kFresh>
struct SgdKernel {
  static constexpr bool kReadA = kMomentum && !kFresh, kWriteA = kMomentum, kUseB = false;
  T wd, momentum, neg_lr;

  template <typename V>
  void operator()(V& p, const V& g, V& buf, V& /*unused*/) const {
    V d = g;
    if constexpr (kDecay) d = g + wd * p;  // d = grad.add(p, wd)
    if constexpr (kMomentum) {
      if constexpr (kFresh) {
        buf = d;  // buf = d.clone()
      } else {
        buf = buf * momentum;  // buf.mul_(momentum)
        buf = buf + d;         //    .add_(d)
      }
      if constexpr (kNesterov) {
        d = d + momentum * buf;  // d = d.add(buf, momentum)
      } else {
        d = buf;
      }
    }
    p = p + neg_lr * d;  // p.add_(d, -lr)
  }
};

template <typename T, bool kDecoupled, bool kL2>
struct AdamKernel {
  static constexpr bool kReadA = true, kWriteA = true, kUseB = true;
  T keep, wd, b1, one_minus_b1, b2, one_minus_b2, sqrt_bc2, eps, neg_step;

  template <typename V>
  void operator()(V& p, const V& g, V& m, V& v) const {
    using std::sqrt;                         // and std::experimental::sqrt for V, by ADL
    if constexpr (kDecoupled) p = p * keep;  // p.mul_(1 - lr * wd)
    V d = g;
    if constexpr (kL2) d = g + wd * p;   // d = grad.add(p, wd)
    m = m * b1;                          // exp_avg.mul_(b1)
    m = m + one_minus_b1 * d;            //        .add_(d, 1 - b1)
    v = v * b2;                          // exp_avg_sq.mul_(b2)
    v = v + one_minus_b2 * d * d;        //           .addcmul_(d, d, 1 - b2)
    V denom = sqrt(v) / sqrt_bc2 + eps;  // (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps)
    p = p + neg_step * m / denom;        // p.addcdiv_(exp_avg, denom, -lr / bc1)
  }
};

// Note [Splitting a range across threads]
// at::parallel_for is header code, and it splits a range only in a translation unit
// compiled with OpenMP (-fopenmp); tetra's are not, so there it would run every range on
// the calling thread. TensorIterator::for_each runs the same parallel_for inside LibTorch,
// on LibTorch's intra-op threads: a one-operand iterator over the (contiguous) range
// splits it, and each chunk's first index is read off the chunk's data pointer. Below
// the grain, at one thread, or inside a parallel region, the range runs on the calling
// thread without building an iterator (so without allocating anything).
template <typename T, typename F>
void split_range(const torch::Tensor& range, const F& chunk) {
  const int64_t n = range.numel();
  if (n <= kGrain || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    chunk(int64_t{0}, n);
    return;
  }
  at::TensorIterator iter = at::TensorIteratorConfig()
                                .add_output(range)
                                .resize_outputs(false)
                                .check_all_same_dtype(false)
                                .set_check_mem_overlap(false)
                                .build();
  TETRA_CHECK(iter.ndim() == 1, "a contiguous range became ", iter.ndim(), " dimensions");
  const char* base = static_cast<const char*>(range.data_ptr());
  iter.for_each(
      [&](char** data, const int64_t* /*strides*/, int64_t size0, int64_t size1) {
        const int64_t begin = (data[0] - base) / static_cast<int64_t>(sizeof(T));
        chunk(begin, begin + size0 * size1);
      },
      kGrain);
}

// Runs `k` over the elements of `range` (p): p and g always, slots a and b as the kernel
// says. One load and one store per element and array, in SIMD vectors of the build's
// native width and then one element at a time.
template <typename T, typename K>
void run_kernel(const K& kernel, const torch::Tensor& range, T* p_base, const T* g_base, T* a_base,
                T* b_base) {
  split_range<T>(range, [&](int64_t begin, int64_t end) {
    // Locals, not captured references: simd stores may alias anything, and the compiler
    // would reload every pointer and scalar after each one.
    const K k = kernel;
    T* const p = p_base;
    const T* const g = g_base;
    T* const a = a_base;
    T* const b = b_base;
    using V = stdx::native_simd<T>;
    constexpr int64_t kLanes = static_cast<int64_t>(V::size());
    constexpr auto kUnaligned = stdx::element_aligned;
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      V pv(p + i, kUnaligned), gv(g + i, kUnaligned), av = T(0), bv = T(0);
      if constexpr (K::kReadA) av.copy_from(a + i, kUnaligned);
      if constexpr (K::kUseB) bv.copy_from(b + i, kUnaligned);
      k(pv, gv, av, bv);
      pv.copy_to(p + i, kUnaligned);
      if constexpr (K::kWriteA) av.copy_to(a + i, kUnaligned);
      if constexpr (K::kUseB) bv.copy_to(b + i, kUnaligned);
    }
    for (; i < end; ++i) {
      T pv = p[i], gv = g[i], av = 0, bv = 0;
      if constexpr (K::kReadA) av = a[i];
      if constexpr (K::kUseB) bv = b[i];
      k(pv, gv, av, bv);
      p[i] = pv;
      if constexpr (K::kWriteA) a[i] = av;
      if constexpr (K::kUseB) b[i] = bv;
    }
  });
}

// Calls f(std::true_type) or f(std::false_type): a runtime flag made a template argument,
// so that the loops carry no per-element branch.
template <typename F>
void with_flag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

template <typename T>
void fused_typed(const OptimizerSpec& spec, double lr, int64_t step, const torch::Tensor& param,
                 const torch::Tensor& grad, UpdateSlots& slots) {
  T* p = param.data_ptr<T>();
  const T* g = grad.data_ptr<T>();
  const double wd = spec.weight_decay;
  if (spec.type == "sgd") {
    T* buf = ptr<T>(slots.momentum);
    with_flag(wd != 0, [&](auto decay) {
      constexpr bool kDecay = decltype(decay)::value;
      if (spec.momentum == 0) {
        run_kernel(SgdKernel<T, kDecay, false, false, false>{T(wd), T(0), T(-lr)}, param, p, g, buf,
                   static_cast<T*>(nullptr));
        return;
      }
      with_flag(spec.nesterov, [&](auto nesterov) {
        with_flag(slots.fresh_momentum, [&](auto fresh) {
          using K = SgdKernel<T, kDecay, true, decltype(nesterov)::value, decltype(fresh)::value>;
          run_kernel(K{T(wd), T(spec.momentum), T(-lr)}, param, p, g, buf,
                     static_cast<T*>(nullptr));
        });
      });
    });
    return;
  }
  // Adam / AdamW: the scalars as reference_update forms them (in double), then cast.
  const bool adamw = spec.type == "adamw";
  const double b1 = spec.beta1, b2 = spec.beta2;
  const double bc1 = 1 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(b2, static_cast<double>(step));
  with_flag(adamw && wd != 0, [&](auto decoupled) {
    with_flag(!adamw && wd != 0, [&](auto l2) {
      using K = AdamKernel<T, decltype(decoupled)::value, decltype(l2)::value>;
      K k{T(1 - lr * wd),    T(wd),       T(b1),       T(1 - b1), T(b2), T(1 - b2),
          T(std::sqrt(bc2)), T(spec.eps), T(-lr / bc1)};
      run_kernel(k, param, p, g, ptr<T>(slots.exp_avg), ptr<T>(slots.exp_avg_sq));
    });
  });
}

// The slots `spec` updates (none, momentum, or exp_avg and exp_avg_sq), checked against
// `param`. A fixed array: fused_update allocates nothing.
struct UsedSlots {
  const torch::Tensor* slot[2] = {nullptr, nullptr};
  int count = 0;
  const torch::Tensor* const* begin() const { return slot; }
  const torch::Tensor* const* end() const { return slot + count; }
};

UsedSlots used_slots(const OptimizerSpec& spec, const torch::Tensor& param,
                     const torch::Tensor& grad, const UpdateSlots& slots) {
  TETRA_CHECK(spec.type == "sgd" || spec.type == "adam" || spec.type == "adamw",
              "unknown optimizer type \"", spec.type, "\"");
  TETRA_CHECK(param.defined() && grad.defined(), "an update needs a parameter and a gradient");
  TETRA_CHECK(grad.numel() == param.numel(), "the gradient has ", grad.numel(),
              " elements, the parameter ", param.numel());
  UsedSlots used;
  if (spec.type != "sgd") {
    TETRA_CHECK(slots.exp_avg.defined() && slots.exp_avg_sq.defined(), spec.type,
                " needs the exp_avg and exp_avg_sq slots");
    used.slot[0] = &slots.exp_avg;
    used.slot[1] = &slots.exp_avg_sq;
    used.count = 2;
  } else if (spec.momentum != 0) {
    TETRA_CHECK(slots.momentum.defined(), "sgd with momentum needs the momentum slot");
    used.slot[0] = &slots.momentum;
    used.count = 1;
  }
  for (const torch::Tensor* s : used)
    TETRA_CHECK(s->numel() == param.numel(), "an optimizer slot has ", s->numel(),
                " elements, the parameter ", param.numel());
  return used;
}

// reference_update's tensors in the parameter's shape (a slot may be flat).
torch::Tensor as_param(const torch::Tensor& t, const torch::Tensor& param) {
  return t.sizes().equals(param.sizes()) ? t : t.view(param.sizes());
}

}  // namespace

int64_t optimizer_slots(const OptimizerSpec& spec) { return spec.type != "sgd" ? 2 : spec.momentum != 0 ? 1 : 0; }

void reference_update(const OptimizerSpec& spec, double lr, int64_t step,
                      const torch::Tensor& param, const torch::Tensor& grad_in,
                      UpdateSlots& slots) {
  used_slots(spec, param, grad_in, slots);
  torch::NoGradGuard no_grad;
  torch::Tensor p = param;
  torch::Tensor grad = as_param(grad_in, p);
  const double wd = spec.weight_decay;
  if (spec.type == "sgd") {
    // torch::optim::SGD: d = g + wd p; buf = m buf + d; d = nesterov ? d + m buf : buf.
    if (wd != 0) grad = grad.add(p, wd);
    if (spec.momentum != 0) {
      torch::Tensor buf = as_param(slots.momentum, p);
      if (slots.fresh_momentum) {
        buf.copy_(grad);
      } else {
        buf.mul_(spec.momentum).add_(grad);
      }
      grad = spec.nesterov ? grad.add(buf, spec.momentum) : buf;
    }
    p.add_(grad, -lr);
    return;
  }
  // Adam / AdamW, as torch::optim::Adam(W).
  if (spec.type == "adamw") {
    if (wd != 0) p.mul_(1 - lr * wd);
  } else if (wd != 0) {
    grad = grad.add(p, wd);
  }
  torch::Tensor exp_avg = as_param(slots.exp_avg, p), exp_avg_sq = as_param(slots.exp_avg_sq, p);
  const double b1 = spec.beta1, b2 = spec.beta2;
  const double bc1 = 1 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(b2, static_cast<double>(step));
  exp_avg.mul_(b1).add_(grad, 1 - b1);
  exp_avg_sq.mul_(b2).addcmul_(grad, grad, 1 - b2);
  torch::Tensor denom = (exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(spec.eps);
  p.addcdiv_(exp_avg, denom, -lr / bc1);
}

void fused_update(const OptimizerSpec& spec, double lr, int64_t step, const torch::Tensor& param,
                  const torch::Tensor& grad, UpdateSlots& slots) {
  const UsedSlots used = used_slots(spec, param, grad, slots);
  const torch::ScalarType dtype = param.scalar_type();
  auto plain = [&](const torch::Tensor& t) {
    return t.layout() == torch::kStrided && t.device().is_cpu() && t.scalar_type() == dtype &&
           t.is_contiguous();
  };
  bool fusable = (dtype == torch::kFloat || dtype == torch::kDouble) && plain(param) && plain(grad);
  for (const torch::Tensor* s : used) fusable = fusable && plain(*s);
  if (!fusable) return reference_update(spec, lr, step, param, grad, slots);
  if (dtype == torch::kFloat) {
    fused_typed<float>(spec, lr, step, param, grad, slots);
  } else {
    fused_typed<double>(spec, lr, step, param, grad, slots);
  }
  // As an in-place ATen op would: autograd sees that the tensors changed.
  auto bump = [](const torch::Tensor& t) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  };
  bump(param);
  for (const torch::Tensor* s : used) bump(*s);
}

Optimizer::Optimizer(const OptimizerSpec& spec, std::vector<NamedParam> params)
    : spec_(spec), params_(std::move(params)), state_(params_.size()) {
  TETRA_CHECK(spec_.type == "sgd" || spec_.type == "adam" || spec_.type == "adamw",
              "unknown optimizer type \"", spec_.type, "\"");
}

void Optimizer::zero_grad() {
  for (auto& p : params_) {
    auto& g = p.tensor.mutable_grad();
    if (g.defined()) g.zero_();
  }
}

void Optimizer::step(double lr) {
  torch::NoGradGuard no_grad;
  ++steps_;
  const bool sgd = spec_.type == "sgd";
  for (size_t i = 0; i < params_.size(); ++i) {
    const torch::Tensor& p = params_[i].tensor;
    const torch::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    // The state is created on the parameter's first update, as torch::optim does.
    State& st = state_[i];
    UpdateSlots slots;
    if (sgd) {
      if (spec_.momentum != 0) {
        if (!st.momentum.defined()) {
          st.momentum = torch::empty_like(grad, torch::MemoryFormat::Preserve);  // set to d
          slots.fresh_momentum = true;
        }
        slots.momentum = st.momentum;
      }
    } else {
      if (!st.exp_avg.defined()) {
        st.exp_avg = torch::zeros_like(p, torch::MemoryFormat::Preserve);
        st.exp_avg_sq = torch::zeros_like(p, torch::MemoryFormat::Preserve);
      }
      slots.exp_avg = st.exp_avg;
      slots.exp_avg_sq = st.exp_avg_sq;
    }
    fused_update(spec_, lr, steps_, p, grad, slots);
  }
}

std::map<std::string, torch::Tensor> Optimizer::state_dict() const {
  std::map<std::string, torch::Tensor> out;
  out["__step__"] = torch::tensor(steps_, torch::kInt64);
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& n = params_[i].name;
    const State& st = state_[i];
    if (st.exp_avg.defined()) out[n + ".exp_avg"] = st.exp_avg;
    if (st.exp_avg_sq.defined()) out[n + ".exp_avg_sq"] = st.exp_avg_sq;
    if (st.momentum.defined()) out[n + ".momentum"] = st.momentum;
  }
  return out;
}

void Optimizer::load_state_dict(const std::map<std::string, torch::Tensor>& state) {
  auto step = state.find("__step__");
  if (step == state.end()) throw Error("optimizer state has no step count");
  steps_ = step->second.item<int64_t>();
  torch::NoGradGuard no_grad;
  auto take = [&](const std::string& key, const torch::Tensor& like) -> torch::Tensor {
    auto it = state.find(key);
    if (it == state.end()) return {};
    if (!it->second.sizes().equals(like.sizes()))
      throw Error("optimizer state " + key + " has shape " + c10::str(it->second.sizes()) +
                  ", the parameter has " + c10::str(like.sizes()));
    return it->second.to(like.options()).clone();
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& n = params_[i].name;
    const auto& p = params_[i].tensor;
    state_[i].exp_avg = take(n + ".exp_avg", p);
    state_[i].exp_avg_sq = take(n + ".exp_avg_sq", p);
    state_[i].momentum = take(n + ".momentum", p);
    bool adam = spec_.type != "sgd";
    if (adam && steps_ > 0 && !state_[i].exp_avg.defined() && p.requires_grad())
      throw Error("optimizer state for " + n + " is missing (was it saved by " + spec_.type + "?)");
  }
}

double grad_norm_sq(const std::vector<NamedParam>& params) {
  torch::NoGradGuard no_grad;
  double total = 0;
  for (const auto& p : params) {
    if (!p.tensor.grad().defined()) continue;
    double n = p.tensor.grad().norm().item<double>();
    total += n * n;
  }
  return total;
}

void scale_gradients(const std::vector<NamedParam>& params, double factor) {
  torch::NoGradGuard no_grad;
  for (const auto& p : params)
    if (p.tensor.grad().defined()) p.tensor.mutable_grad().mul_(factor);
}

double grad_norm(const std::vector<NamedParam>& params) { return std::sqrt(grad_norm_sq(params)); }

double clip_grad_norm(const std::vector<NamedParam>& params, double max_norm) {
  return clip_grad_norm(params, max_norm, [](double sq) { return sq; });
}

double clip_grad_norm(const std::vector<NamedParam>& params, double max_norm,
                      const std::function<double(double)>& reduce_sq) {
  double norm = std::sqrt(reduce_sq(grad_norm_sq(params)));
  if (max_norm > 0 && norm > max_norm) scale_gradients(params, clip_scale(max_norm, norm));
  return norm;
}

LrSchedule::LrSchedule(const ScheduleSpec& spec, double peak_lr, int64_t total_steps)
    : spec_(spec), peak_(peak_lr), total_(total_steps) {}

double LrSchedule::at(int64_t step) const {
  const int64_t warm = spec_.warmup_steps;
  if (warm > 0 && step < warm) return peak_ * static_cast<double>(step + 1) / static_cast<double>(warm);
  if (spec_.type == "constant") return peak_;
  int64_t decay = spec_.decay_steps > 0 ? spec_.decay_steps : std::max<int64_t>(1, total_ - warm);
  double t = std::min(1.0, static_cast<double>(step - warm) / static_cast<double>(decay));
  if (t < 0) t = 0;
  if (spec_.type == "linear") return spec_.min_lr + (peak_ - spec_.min_lr) * (1 - t);
  // cosine
  return spec_.min_lr + 0.5 * (peak_ - spec_.min_lr) * (1 + std::cos(M_PI * t));
}

}  // namespace tetra::core
