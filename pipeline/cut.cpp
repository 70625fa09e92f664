#include "pipeline/cut.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "core/init.h"
#include "core/models.h"
#include "core/optim.h"
#include "core/random.h"
#include "core/runtime.h"
#include "core/torch_compat.h"
#include "hardware/topology.h"

namespace tetra::pipeline {

using hardware::ByteDigits;
using hardware::format_bytes;

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// ---- the layers -----------------------------------------------------------------------

// "Linear(784 -> 512)" from a module's pretty print "torch::nn::Linear(in_features=784, ...)".
std::string layer_name(const torch::nn::Module& m) {
  const std::string s = core::layer_text(m);
  const std::string base = s.substr(0, s.find('('));
  if (base == "Linear")
    if (const at::Tensor w = core::linear_weight(m); w.defined())
      return "Linear(" + std::to_string(w.size(1)) + " -> " + std::to_string(w.size(0)) + ")";
  return base;
}

int64_t param_count(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// Running layers to learn about them must leave no trace: a batch norm updates its
// running statistics, and a layer from outside tetra's zoo may draw from torch's generator
// (torch::nn::Dropout, RReLU), which every thread-rank shares and which seeds each one's
// initial parameters. This puts both back as they were. It holds the process's generator
// lock all along: putting the generator back while another thread-rank seeds it and draws
// its initial parameters would hand that rank other weights (a race CI once lost: a stage
// began from parameters one process never had). tetra's own Dropout draws nothing from
// the generator (Note [Layout-invariant dropout]).
class UntouchedModel {
 public:
  explicit UntouchedModel(torch::nn::Sequential& model)
      : lock_(core::global_rng_mutex()), random_(0, 0, 0), model_(model),
        rng_(at::detail::getDefaultCPUGenerator().get_state()) {
    for (const auto& b : model->named_buffers()) buffers_.push_back({b.value(), b.value().clone()});
  }
  ~UntouchedModel() {
    torch::NoGradGuard no_grad;
    for (auto& [live, saved] : buffers_) live.copy_(saved);
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng_);
    }
    model_->zero_grad(/*set_to_none=*/true);
  }
  UntouchedModel(const UntouchedModel&) = delete;
  UntouchedModel& operator=(const UntouchedModel&) = delete;

 private:
  std::lock_guard<std::mutex> lock_;  // first: taken before the state is read
  // tetra's Dropout needs a key in training mode; the masks of layers run to be measured
  // are never used, so any key does.
  core::RandomContext::Scope random_;
  torch::nn::Sequential& model_;
  at::Tensor rng_;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers_;
};

}  // namespace

std::vector<Boundary> probe_boundaries(torch::nn::Sequential& model, const core::Dataset& data, bool bf16) {
  UntouchedModel untouched(model);
  core::LayerProbe whole;
  {
    core::compat::Autocast autocast(bf16);
    whole = core::probe_layers(model, data.range(core::Split::kTrain, 0, 1).inputs, /*max_tokens=*/0);
  }
  std::vector<Boundary> out;
  for (const core::LayerShapes& s : whole.layers) {
    Boundary bd;
    bd.tail.assign(s.output.sizes().begin() + 1, s.output.sizes().end());
    bd.dtype = s.output.scalar_type();
    out.push_back(bd);
  }
  return out;
}

// ---- stage memory ----------------------------------------------------------------------

StageMemoryModel::StageMemoryModel(const Options& o, const std::vector<LayerCost>& costs, const core::JobSpec& spec)
    : opt_(o), costs_(costs),
      sched_(make_schedule(to_string(o.schedule), o.stages, o.micro_batches, o.virtual_stages)),
      sim_(simulate(sched_)), slots_(core::optimizer_slots(spec.optimizer)) {
  const size_t L = costs.size();
  params_.assign(L + 1, 0);
  acts_.assign(L + 1, 0);
  weight_inputs_.assign(L + 1, 0);
  for (size_t i = 0; i < L; ++i) {
    params_[i + 1] = params_[i] + costs[i].params;
    acts_[i + 1] = acts_[i] + costs[i].kept();
    const int64_t in = i == 0 ? 0 : costs[i - 1].activation_bytes;
    weight_inputs_[i + 1] = weight_inputs_[i] + (costs[i].params > 0 ? in : 0);
  }
}

StageMemoryModel::Bytes StageMemoryModel::operator()(int stage, int first, int end) const {
  Bytes b;
  const int r = sched_.rank_of(stage);
  b.in_flight = sim_.ok ? sim_.peak_in_flight[r] : opt_.micro_batches;
  b.weight_pending = sim_.ok && sched_.split_backward() ? sim_.peak_weight_pending[r] : 0;
  b.state = (params_[end] - params_[first]) * 4 * (2 + slots_);
  const int64_t act = acts_[end] - acts_[first];
  const int64_t in = first == 0 ? 0 : costs_[first - 1].activation_bytes;
  b.activations = opt_.checkpoint == Recompute::kNever ? act * b.in_flight : in * b.in_flight + act;
  int64_t recompute = 0;  // train.recompute: one block's recomputation at a time (Note [Kept bytes])
  for (int i = first; i < end; ++i) recompute = std::max(recompute, costs_[static_cast<size_t>(i)].recompute_bytes);
  b.activations += recompute;
  b.activations += (weight_inputs_[end] - weight_inputs_[first]) * b.weight_pending;
  return b;
}

// ---- the cut --------------------------------------------------------------------------

// By the balance: uniform | by_params | explicit, or by_time from `costs` (under
// pipeline.memory_gb the fastest cut whose every stage fits; when none does, the cut that
// needs least memory, which memory_issues then reports).
Partition cut_stages(const Options& opt, const std::vector<LayerCost>& costs, const core::JobSpec& spec) {
  const int L = static_cast<int>(costs.size());
  const int K = opt.stages * opt.virtual_stages;
  if (opt.balance == Balance::kExplicit) return partition_explicit(opt.balance_counts, L);
  if (opt.balance == Balance::kByParams) {
    std::vector<double> w;
    for (const auto& c : costs) w.push_back(static_cast<double>(c.params));
    return partition_min_max(w, K);
  }
  if (opt.balance == Balance::kByTime) {
    std::vector<double> w;
    for (const auto& c : costs) w.push_back(c.forward_s + c.backward_s);
    if (opt.memory_gb <= 0) return partition_min_max(w, K);
    std::vector<double> prefix(L + 1, 0);
    for (int i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + w[i];
    const StageMemoryModel mem(opt, costs, spec);
    Partition p = partition_min_max(L, K, [&](int k, int a, int e) {
      return static_cast<double>(mem(k, a, e).total()) <= mem.cap() ? prefix[e] - prefix[a]
                                                                     : std::numeric_limits<double>::infinity();
    });
    if (!p.begin.empty()) return p;
    return partition_min_max(L, K, [&](int k, int a, int e) { return static_cast<double>(mem(k, a, e).total()); });
  }
  return partition_uniform(L, K);
}

std::vector<core::PlanIssue> memory_issues(const Options& opt, const Partition& part, const std::vector<LayerCost>& costs,
                                           const core::JobSpec& spec) {
  std::vector<core::PlanIssue> out;
  if (opt.memory_gb <= 0) return out;
  const StageMemoryModel mem(opt, costs, spec);
  const Schedule& sched = mem.schedule();
  for (int k = 0; k < part.stages(); ++k) {
    const auto b = mem(k, part.first(k), part.end(k));
    if (static_cast<double>(b.total()) <= mem.cap()) continue;
    std::ostringstream os;
    os << "stage " << k << " (rank " << sched.rank_of(k) << ", layers " << part.first(k) << "-" << part.end(k) - 1
       << ") needs " << format_bytes(b.total(), ByteDigits::kWhole) << " (" << b.total()
       << " bytes: parameters, gradients and optimizer state " << format_bytes(b.state, ByteDigits::kWhole)
       << ", activations " << format_bytes(b.activations, ByteDigits::kWhole) << " for " << b.in_flight
       << " micro-batches in flight" << (b.weight_pending ? " and " + std::to_string(b.weight_pending) + " waiting for W" : "")
       << "), over pipeline.memory_gb " << opt.memory_gb << " per rank"
       << (opt.virtual_stages > 1
               ? " (" + format_bytes(static_cast<int64_t>(mem.cap()), ByteDigits::kWhole) + " per chunk)"
               : "");
    if (opt.balance == Balance::kByTime)
      os << "; no cut of the " << costs.size() << " layers into " << part.stages()
         << " stages fits, and this one needs least; ";
    else
      os << "; ";
    os << "raise pipeline.memory_gb, add pipeline stages, use more micro-batches or checkpoint: always"
       << (opt.balance == Balance::kByTime ? "" : ", or balance: by_time to cut by time within the cap");
    out.push_back({"pipeline.memory_gb", os.str()});
  }
  return out;
}

Partition partition_for(const Options& opt, torch::nn::Sequential& model, std::vector<LayerCost> costs,
                        const core::JobSpec& spec) {
  if (costs.empty())
    for (int i = 0; i < static_cast<int>(model->size()); ++i) costs.push_back({"", param_count(*layer(model, i).ptr())});
  return cut_stages(opt, costs, spec);
}

// ---- measuring the layers -------------------------------------------------------------

std::vector<LayerCost> measure_layers(torch::nn::Sequential& model, const core::Dataset& data,
                                      int64_t micro_batch, bool bf16, bool time, double max_timed_flops,
                                      const core::LayerProbe* given) {
  UntouchedModel untouched(model);
  std::vector<LayerCost> out;
  const int L = static_cast<int>(model->size());
  const torch::Tensor sample = data.range(core::Split::kTrain, 0, 1).inputs;
  // Output sizes: one sample's probe, at most 64 tokens, scaled (Note [Layer costs]).
  core::LayerProbe probe;
  if (given) {
    probe = *given;
  } else {
    core::compat::Autocast autocast(bf16);
    probe = core::probe_layers(model, sample);
    core::measure_kept(model, probe);
  }
  const double per_micro = static_cast<double>(micro_batch) * probe.scale;  // probe outputs per micro-batch
  for (int i = 0; i < L; ++i) {
    LayerCost c;
    auto& m = layer(model, i);
    c.name = layer_name(*m.ptr());
    c.params = param_count(*m.ptr());
    const torch::Tensor& y = probe.layers[static_cast<size_t>(i)].output;
    c.activation_bytes = static_cast<int64_t>(static_cast<double>(y.numel() * static_cast<int64_t>(y.element_size())) * per_micro);
    if (probe.kept.size() == probe.layers.size()) {
      c.kept_bytes = probe.kept[static_cast<size_t>(i)] * micro_batch;
      c.recompute_bytes = probe.recompute[static_cast<size_t>(i)] * micro_batch;
    }
    out.push_back(c);
  }
  if (!time) return out;

  // Time the micro-batch itself, or (over the budget) the probe's sample, scaled by FLOPs.
  torch::Tensor x;
  std::vector<double> ratio(static_cast<size_t>(L), 1.0);
  const std::vector<double> whole = core::forward_flops(model, probe);  // one whole sample
  double micro_flops = 0;
  for (double f : whole) micro_flops += f * static_cast<double>(micro_batch);
  const bool scaled = micro_flops > max_timed_flops;
  if (scaled) {
    const torch::Tensor short_sample = probe.layers.empty() ? sample : probe.layers.front().input;
    core::LayerProbe as_run = probe;  // the probe's own sample, unscaled
    as_run.scale = 1;
    const std::vector<double> small = core::forward_flops(model, as_run);
    for (int i = 0; i < L; ++i)
      ratio[static_cast<size_t>(i)] = small[static_cast<size_t>(i)] > 0
                                          ? whole[static_cast<size_t>(i)] * static_cast<double>(micro_batch) / small[static_cast<size_t>(i)]
                                          : per_micro;
    x = short_sample;
  } else {
    x = data.range(core::Split::kTrain, 0, std::min<int64_t>(micro_batch, data.size(core::Split::kTrain))).inputs;
  }
  // A layer like one already timed (the same signature: a transformer's repeated blocks)
  // takes that one's times and output.
  std::map<std::string, std::tuple<double, double, torch::Tensor>> timed;
  // In training, a layer's backward computes its input's gradient only when a layer
  // before it has parameters (the data needs none): the first Linear's dX is not work a
  // step does, and timing it made a dry run's compute rate low.
  bool upstream_parameters = false;
  for (int i = 0; i < L; ++i) {
    auto& m = layer(model, i);
    LayerCost& c = out[static_cast<size_t>(i)];
    c.scaled = scaled;
    const bool input_grad = upstream_parameters;
    upstream_parameters = upstream_parameters || c.params > 0;
    const std::string key = core::layer_signature(*m.ptr(), x) + (input_grad ? "" : " (no input gradient)");
    if (auto it = timed.find(key); it != timed.end()) {
      c.forward_s = std::get<0>(it->second) * ratio[static_cast<size_t>(i)];
      c.backward_s = std::get<1>(it->second) * ratio[static_cast<size_t>(i)];
      x = std::get<2>(it->second);
      continue;
    }
    core::MaterializedScope created(*m.ptr());  // before y: the graph goes first
    torch::Tensor in = x.detach();
    if (in.is_floating_point() && input_grad) in.requires_grad_(true);
    torch::Tensor y;
    // The best of several runs: the first pays for allocation, the noise of a shared
    // machine only ever adds. At least 4, and up to 20 until the layer has run for 50 ms
    // (a short layer's best of 4 on two busy cores varied by half). A scaled timing is a
    // rough one anyway: two runs.
    double f = 1e30, bw = 1e30, spent = 0;
    for (int rep = 0; rep < (scaled ? 2 : 20) && (scaled || rep < 4 || spent < 0.05); ++rep) {
      auto t0 = Clock::now();
      {
        core::compat::Autocast autocast(bf16);
        y = m.forward(in);
      }
      auto t1 = Clock::now();
      if (y.requires_grad()) {
        torch::autograd::backward({y}, {torch::ones_like(y)});
      }
      auto t2 = Clock::now();
      f = std::min(f, seconds(t0, t1));
      bw = std::min(bw, seconds(t1, t2));
      spent += seconds(t0, t2);
    }
    c.forward_s = f * ratio[static_cast<size_t>(i)];
    c.backward_s = bw * ratio[static_cast<size_t>(i)];
    x = y.detach();
    timed.emplace(key, std::make_tuple(f, bw, x));
  }
  return out;
}

}  // namespace tetra::pipeline
