// bench-optim — what does the fused one-pass update save over the ATen ops?
//
// For each optimizer (sgd, sgd with momentum, adam, adamw) and each workload (the
// quickstart MLP's parameters, 784-1024-1024-10 in fp32: six tensors, 1.86M elements;
// one flat fp32 range of --flat elements, as a ZeRO shard), times one optimizer step over
// the workload with reference_update (the ATen ops) and with fused_update (core/optim.h),
// alternating the two --repeats times, and prints the median ms per step of each and
// their ratio. Both copies start from the same parameters and take the same steps with
// the same gradients, so beside each line stands the correctness check: the largest
// relative difference between the two copies' parameters after the timed steps.
//
//   bench-optim [--repeats 50] [--flat 100000000] [--threads 1]
#include <ATen/Version.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <experimental/simd>
#include <string>
#include <vector>

#include "core/optim.h"
#include "core/runtime.h"

using namespace tetra::core;

namespace {

struct Workload {
  std::string name;
  std::vector<std::vector<int64_t>> shapes;
};

struct Variant {
  std::string name;
  OptimizerSpec spec;
};

std::vector<Variant> variants() {
  auto make = [](std::string name, std::string type, double momentum, double wd) {
    OptimizerSpec s;
    s.type = std::move(type);
    s.momentum = momentum;
    s.weight_decay = wd;
    return Variant{std::move(name), s};
  };
  return {make("sgd", "sgd", 0, 0), make("sgd+momentum", "sgd", 0.9, 0), make("adam", "adam", 0, 0),
          make("adamw wd=0.01", "adamw", 0, 0.01)};
}

// One copy of the workload's parameters and optimizer state.
struct Copy {
  std::vector<torch::Tensor> params;
  std::vector<UpdateSlots> slots;

  Copy(const OptimizerSpec& spec, const std::vector<torch::Tensor>& init) {
    for (const auto& p : init) {
      params.push_back(p.clone());
      UpdateSlots s;
      if (spec.type != "sgd") {
        s.exp_avg = torch::zeros_like(p);
        s.exp_avg_sq = torch::zeros_like(p);
      } else if (spec.momentum != 0) {
        s.momentum = torch::empty_like(p);
        s.fresh_momentum = true;
      }
      slots.push_back(s);
    }
  }
};

using UpdateFn = void (*)(const OptimizerSpec&, double, int64_t, const torch::Tensor&,
                          const torch::Tensor&, UpdateSlots&);

// One optimizer step over every tensor of `c`; returns its milliseconds.
double timed_step(UpdateFn update, const OptimizerSpec& spec, int64_t step, Copy& c,
                  const std::vector<torch::Tensor>& grads) {
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < c.params.size(); ++i) {
    update(spec, spec.lr, step, c.params[i], grads[i], c.slots[i]);
    c.slots[i].fresh_momentum = false;
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// "AVX512" etc.: the instruction set of ATen's kernels (reference_update's), from its config.
std::string aten_capability() {
  const std::string config = at::show_config(), key = "CPU capability usage: ";
  auto at = config.find(key);
  if (at == std::string::npos) return "unknown";
  at += key.size();
  return config.substr(at, config.find('\n', at) - at);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// max |fused - ref| / max(|ref|, rms(ref)) over every parameter: relative, except that
// elements near zero are measured on their tensor's scale (as tests/core/test_optim.cpp).
double max_rel_diff(const Copy& fused, const Copy& ref) {
  double worst = 0;
  for (size_t i = 0; i < fused.params.size(); ++i) {
    const torch::Tensor& r = ref.params[i];
    const double rms = r.square().mean().sqrt().item<double>();
    worst = std::max(worst,
                     ((fused.params[i] - r).abs() / r.abs().clamp_min(rms)).max().item<double>());
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  prepare_process(argc, argv);
  CLI::App app{"bench-optim: the fused optimizer update against the ATen ops", "bench-optim"};
  int repeats = 50, threads = 1;
  int64_t flat = 100'000'000;
  app.add_option("--repeats", repeats, "timed steps of each path, alternating")
      ->check(CLI::PositiveNumber);
  app.add_option("--flat", flat, "elements of the flat range (0: skip it)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads, "intra-op threads")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    set_threads(threads);
    torch::NoGradGuard no_grad;
    std::vector<Workload> workloads = {
        {"mlp 784-1024-1024-10", {{1024, 784}, {1024}, {1024, 1024}, {1024}, {10, 1024}, {10}}}};
    if (flat > 0) workloads.push_back({"flat " + std::to_string(flat), {{flat}}});
    std::printf(
        "bench-optim: fp32, %d intra-op thread%s, median of %d steps after 2 warm-up steps; "
        "ATen kernels %s, fused SIMD width %d floats\n",
        threads, threads == 1 ? "" : "s", repeats, aten_capability().c_str(),
        static_cast<int>(std::experimental::native_simd<float>::size()));
    std::printf("%-24s %-14s %11s %10s %10s %8s %13s\n", "workload", "optimizer", "elements",
                "ref ms", "fused ms", "speedup", "max rel diff");
    for (const Workload& w : workloads) {
      torch::manual_seed(0);
      std::vector<torch::Tensor> init, grads;
      int64_t elements = 0;
      for (const auto& shape : w.shapes) {
        init.push_back(torch::randn(shape));
        grads.push_back(torch::randn(shape));
        elements += init.back().numel();
      }
      for (const Variant& v : variants()) {
        Copy ref(v.spec, init), fused(v.spec, init);
        std::vector<double> ref_ms, fused_ms;
        int64_t step = 0;
        for (int r = 0; r < repeats + 2; ++r) {
          ++step;
          double a = timed_step(&reference_update, v.spec, step, ref, grads);
          double b = timed_step(&fused_update, v.spec, step, fused, grads);
          if (r < 2) continue;  // warm-up: first touch of the state and of ATen's temporaries
          ref_ms.push_back(a);
          fused_ms.push_back(b);
        }
        double rm = median(ref_ms), fm = median(fused_ms);
        std::printf("%-24s %-14s %11lld %10.3f %10.3f %7.2fx %13.2e\n", w.name.c_str(),
                    v.name.c_str(), static_cast<long long>(elements), rm, fm, rm / fm,
                    max_rel_diff(fused, ref));
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-optim: error: %s\n", e.what());
    return 1;
  }
}
