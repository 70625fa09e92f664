#include "core/init.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>

#include "collectives/error.h"
#include "core/device.h"
#include "core/random.h"

namespace tetra::core {

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;  // SplitMix64's increment
constexpr double kTwoToMinus53 = 1.0 / 9007199254740992.0;
constexpr double kTwoPi = 6.283185307179586476925286766559;

// FNV-1a, 64 bits: a name's hash that is the same in every build (std::hash is not).
uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t bits(uint64_t key, int64_t k) {
  return splitmix64(key + static_cast<uint64_t>(k) * kGamma);
}

}  // namespace

Init Init::fan_in_uniform(int64_t fan_in) {
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  return uniform(-bound, bound);
}

std::string Init::str() const {
  char buf[96];
  switch (kind) {
    case Kind::kUniform:
      std::snprintf(buf, sizeof buf, "uniform(%.4g, %.4g)", a, b);
      break;
    case Kind::kNormal:
      std::snprintf(buf, sizeof buf, "normal(%.4g, %.4g)", a, b);
      break;
    case Kind::kConstant:
      std::snprintf(buf, sizeof buf, "constant(%.4g)", a);
      break;
  }
  return buf;
}

void draw(const Init& init, uint64_t seed, const std::string& name, int64_t first,
          const at::Tensor& out) {
  TETRA_CHECK(out.device().is_cpu() && out.is_contiguous() && out.is_floating_point(),
              "draw: needs a contiguous floating-point CPU tensor, got ", out.toString(), " for ",
              name);
  const int64_t n = out.numel();
  if (n == 0) return;
  if (init.kind == Init::Kind::kConstant) {
    out.fill_(init.a);
    return;
  }
  const uint64_t key = splitmix64(splitmix64(seed) ^ fnv1a64(name));
  const double a = init.a, b = init.b;
  const bool uniform = init.kind == Init::Kind::kUniform;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "draw", [&] {
    scalar_t* p = out.data_ptr<scalar_t>();
    // Each element is a function of its own index alone: any split among threads, and
    // any slice of the tensor, writes the same values.
    at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
      if (uniform) {
        for (int64_t i = begin; i < end; ++i) {
          const double u = static_cast<double>(bits(key, first + i) >> 11) * kTwoToMinus53;
          p[i] = static_cast<scalar_t>(a + (b - a) * u);
        }
        return;
      }
      for (int64_t i = begin; i < end;) {
        const int64_t k = first + i, q = k >> 1;
        const double u1 = static_cast<double>((bits(key, 2 * q) >> 11) + 1) * kTwoToMinus53;
        const double u2 = static_cast<double>(bits(key, 2 * q + 1) >> 11) * kTwoToMinus53;
        const double r = std::sqrt(-2.0 * std::log(u1));
        double s = 0, c = 0;
        ::sincos(kTwoPi * u2, &s, &c);  // one call for both, whichever this slice needs
        if ((k & 1) == 0) {
          p[i++] = static_cast<scalar_t>(a + b * r * c);
          if (i < end) p[i++] = static_cast<scalar_t>(a + b * r * s);
        } else {
          p[i++] = static_cast<scalar_t>(a + b * r * s);
        }
      }
    });
  });
}

at::Tensor part_of(const Placement& part, const at::Tensor& whole, const at::Tensor& like) {
  TETRA_CHECK(whole.numel() == part.whole_numel(), "part_of: a tensor of ", whole.numel(), " elements is not ",
              part.str());
  if (!part.is_split()) return whole.reshape(like.sizes());
  const int64_t block = part.view[static_cast<size_t>(part.dim)] / part.parts;
  return whole.reshape(part.view).narrow(part.dim, part.index * block, block).contiguous().view(like.sizes());
}

at::Tensor whole_of(const Placement& any_part, const std::vector<at::Tensor>& parts) {
  TETRA_CHECK(static_cast<int>(parts.size()) == any_part.parts, "whole_of: ", parts.size(), " parts of ",
              any_part.str());
  if (!any_part.is_split()) return parts.at(0).reshape(any_part.whole_shape());
  std::vector<at::Tensor> views;
  for (const at::Tensor& p : parts) views.push_back(p.reshape(any_part.local()));
  return at::cat(views, any_part.dim).reshape(any_part.whole_shape());
}

void place(const at::Tensor& t, const at::Tensor& data) {
  TETRA_CHECK(t.sizes() == data.sizes() && t.scalar_type() == data.scalar_type(),
              "place: ", t.toString(), t.sizes(), " cannot take the storage of ", data.toString(),
              data.sizes());
  TETRA_CHECK(t.is_leaf(),
              "place: only a leaf tensor (a parameter or buffer) can be created in place");
  // As Tensor::set_data does when a tensor moves: autograd's accumulator of the old tensor
  // (a finished graph's: probes run layers) would hand gradients of the old kind.
  if (auto* meta = torch::autograd::impl::get_autograd_meta(t)) {
    std::lock_guard<std::mutex> lock(meta->mutex_);
    meta->grad_accumulator_.reset();
  }
  t.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
}

at::Tensor meta_like(const at::Tensor& t) {
  return at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).device(at::kMeta));
}

Materializer::Materializer(torch::nn::Module& model, uint64_t seed, torch::Device device)
    : seed_(seed), device_(device) {
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const torch::nn::Module& m = *item.value();
    auto full = [&](const std::string& key) {
      return item.key().empty() ? key : item.key() + "." + key;
    };
    std::vector<std::pair<std::string, at::Tensor>> own;
    for (const auto& p : m.named_parameters(/*recurse=*/false))
      own.emplace_back(p.key(), p.value());
    for (const auto& b : m.named_buffers(/*recurse=*/false)) own.emplace_back(b.key(), b.value());
    for (const auto& [key, t] : own) {
      if (!t.is_meta()) continue;
      const auto* init = dynamic_cast<const Initialized*>(&m);
      if (!init)
        throw ConfigError("the model's tensor " + full(key) + " (of " + layer_text(m) +
                          ") was built on the meta device, but its module does not say how to draw "
                          "it: build it of "
                          "tetra's layers (core/layers.h), make the module a "
                          "tetra::core::Initialized, or build it "
                          "with its values");
      rules_[full(key)] = init->init_of(key);
      if (std::optional<Placement> part = init->placement_of(key)) {
        TETRA_CHECK(part->local_numel() == t.numel(), "the model's tensor ", full(key), " (of ",
                    layer_text(m), ") has the shape ", t.sizes(), ", but its placement ",
                    part->str(), " gives its part ", part->local_numel(), " elements");
        placements_.emplace(full(key), std::move(*part));
      }
    }
  }
}

const Init& Materializer::rule(const std::string& name) const {
  auto it = rules_.find(name);
  TETRA_CHECK(it != rules_.end(), "the model has no tensor ", name, " built as a shape");
  return it->second;
}

const Placement* Materializer::placement(const std::string& name) const {
  auto it = placements_.find(name);
  return it == placements_.end() ? nullptr : &it->second;
}

void Materializer::draw_part(const std::string& name, int64_t first, const at::Tensor& out) const {
  const Init& init = rule(name);
  const Placement* part = placement(name);
  const at::Tensor flat = out.view({-1});
  // Elements [whole_begin, +n) of the whole tensor into `into`: the source's, else drawn.
  auto value = [&](int64_t whole_begin, const at::Tensor& into) {
    if (!source_ || !source_(name, whole_begin, into)) draw(init, seed_, name, whole_begin, into);
  };
  if (!part) {
    value(first, flat);
    return;
  }
  for (const Placement::Run& r : part->runs(first, out.numel()))
    value(r.whole_begin, flat.narrow(0, r.local_begin - first, r.length));
}

void Materializer::fill(const NamedParam& p, int64_t first, const at::Tensor& out) const {
  TETRA_CHECK(first >= 0 && first + out.numel() <= p.tensor.numel(), "fill: elements [", first,
              ", ", first + out.numel(), ") are outside ", p.name, " of ", p.tensor.numel());
  if (p.tensor.is_meta()) {
    // Drawn on the CPU (Note [One device]): into `out` itself there, else through a copy.
    const at::Tensor host = out.is_cpu() ? out : at::empty(out.sizes(), out.options().device(at::kCPU));
    draw_part(p.name, first, host);
    if (!out.is_cpu()) out.copy_(host);
  } else {
    at::NoGradGuard no_grad;
    out.copy_(p.tensor.detach().reshape({-1}).narrow(0, first, out.numel()));
  }
}

void Materializer::create(const NamedParam& p) const {
  if (!p.tensor.is_meta()) return;
  at::Tensor data = at::empty(p.tensor.sizes(), at::TensorOptions().dtype(p.tensor.scalar_type()));
  draw_part(p.name, 0, data);
  place(p.tensor, in_host_memory(device_) ? data : data.to(device_));
}

void Materializer::create_all(torch::nn::Module& model) const {
  for (const auto& p : model.named_parameters()) create({p.key(), p.value()});
  for (const auto& b : model.named_buffers()) create({b.key(), b.value()});
}

std::string layer_text(const torch::nn::Module& layer) {
  std::ostringstream os;
  layer.pretty_print(os);
  std::string text = os.str();
  const std::string anonymous = "(anonymous namespace)::";
  for (size_t at; (at = text.find(anonymous)) != std::string::npos;) text.erase(at, anonymous.size());
  // The type is what comes before the first '(' (its options follow).
  const size_t open = text.find('(');
  std::string type = text.substr(0, open);
  const std::string rest = open == std::string::npos ? "" : text.substr(open);
  if (type.rfind("::") != std::string::npos) type = type.substr(type.rfind("::") + 2);
  if (type.size() > 4 && type.compare(type.size() - 4, 4, "Impl") == 0) type.resize(type.size() - 4);
  return type + rest;
}

int64_t created_bytes(const torch::nn::Module& model) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) {
    if (!t.defined() || t.is_meta() || !seen.insert(t.storage().unsafeGetStorageImpl()).second)
      return;
    bytes += static_cast<int64_t>(t.storage().nbytes());
  };
  for (const auto& p : model.parameters()) add(p);
  for (const auto& b : model.buffers()) add(b);
  return bytes;
}

MaterializedScope::MaterializedScope(torch::nn::Module& module) {
  std::vector<at::Tensor> all = module.parameters();
  for (const auto& b : module.buffers()) all.push_back(b);
  for (const auto& t : all) {
    if (!t.is_meta()) continue;
    place(t, at::zeros(t.sizes(), at::TensorOptions().dtype(t.scalar_type())));
    made_.push_back(t);
  }
}

MaterializedScope::~MaterializedScope() {
  for (auto& t : made_) {
    if (t.grad().defined()) t.mutable_grad() = at::Tensor();
    place(t, meta_like(t));
  }
}

}  // namespace tetra::core
