#include "tools/planner/measure.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "collectives/local.h"
#include "core/models.h"
#include "core/optim.h"
#include "hardware/env.h"
#include "hardware/host.h"
#include "pipeline/pipeline.h"

namespace tetra::planner {

using namespace tetra::core;

// Note [Figures with their spread]
// A figure timed once on a shared machine is one draw of its noise: the quickstart's three
// dry runs predicted 5,767 to 8,962 samples/s, and under load the dry run predicted 2.5-4.5x
// what ran without saying the machine was busy. So the dry run times this machine's compute
// DryRunOptions::timing_rounds times (3), prices each, answers with the median round and prints the spread;
// and it looks at the machine before and after (the 1-minute load against the cores this
// process may use, the other processes runnable at that moment): on a busy machine it says
// its figures are pessimistic for a quiet one. (The tuner measures its trials in rounds of
// its own: tools/planner/tune.cpp.)
PlanReport::Machine look_at_machine() {
  PlanReport::Machine m;
  m.cores = std::max(1, static_cast<int>(hardware::usable_cores()));
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &m.load) != 1) m.load = 0;
    std::fclose(f);
  }
  std::error_code ec;
  const std::string self = std::to_string(::getpid());
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name == self || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    const size_t close = stat.rfind(')');
    if (close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'R') ++m.others_running;
  }
  m.busy = m.load > 0.75 * m.cores || m.others_running >= std::max(1, m.cores / 2);
  return m;
}

LayerTimes time_layers(ModelPlan& job, int64_t micro) {
  const Plan& plan = job.plan();
  LayerTimes t;
  t.micro = std::max<int64_t>(1, micro);
  t.threads = at::get_num_threads();
  t.costs = pipeline::measure_layers(job.model(), job.dataset(), t.micro,
                                     plan.spec().train.precision == Precision::kBf16, /*time=*/true,
                                     pipeline::kDryRunTimedFlops, &job.probe());
  const Dataset& data = job.dataset();
  const int64_t rows = std::min<int64_t>(t.micro, data.size(Split::kTrain));
  t.load_s = 1e300;
  for (int i = -1; i < 5 && rows > 0; ++i) {  // -1: a warm-up (a lazily read set's first touch)
    const at::Tensor idx = at::randint(data.size(Split::kTrain), {rows}, at::kLong);
    const auto t0 = std::chrono::steady_clock::now();
    data.get(Split::kTrain, idx);
    if (i >= 0) t.load_s = std::min(t.load_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (rows <= 0) t.load_s = 0;
  return t;
}

// One step of the optimizer over `elements` (the model's fused update, then the
// gradients zeroed for the next step), the best of a few: what a rank spends after its
// backward on what it owns. A large model's is timed on 16 Mi elements and scaled (the
// update is one pass over memory, linear in its length), so a dry run allocates little.
double time_optimizer(const OptimizerSpec& spec, int64_t owned) {
  if (owned <= 0) return 0;
  const int64_t elements = std::min<int64_t>(owned, int64_t{1} << 24);
  at::Tensor param = at::randn({elements}), grad = at::randn({elements}).mul_(1e-3);
  UpdateSlots slots;
  if (spec.type != "sgd") {
    slots.exp_avg = at::zeros({elements});
    slots.exp_avg_sq = at::zeros({elements});
  } else if (spec.momentum != 0) {
    slots.momentum = at::zeros({elements});
  }
  double best = 1e300;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fused_update(spec, spec.lr, i + 1, param, grad, slots);
    grad.zero_();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    grad.normal_().mul_(1e-3);
  }
  return best * double(owned) / double(elements);
}

namespace {

// A host's cores as the calibration holds them: "2", or "0.5" where hosts share a machine.
std::string cores_text(double cores) {
  char b[32];
  std::snprintf(b, sizeof(b), "%g", cores);
  return b;
}

// Note [This machine's figures]
// A dry run without a calibration prices the step on the machine it runs on, not on a
// cluster it has never seen:
//   compute  the model's layers timed forward and backward on one rank's micro-batch at
//            the job's threads (pipeline::measure_layers, the timings a by_time cut
//            takes; a large model's are taken on a sample and scaled, Note [Layer
//            costs]), each stage's for the rows it runs in a step, and the optimizer's
//            update of what a rank owns; both divided by the share of a core each rank
//            gets when the host's ranks x threads outnumber its cores.
//   inside   a measured local pair: two thread-ranks of this process over the local
//            backend (shared memory), alpha and beta as bench-collectives measures them.
//   across   nothing here to measure: when the layout spans hosts (--np beyond
//            --ranks-per-host), the GPU-cluster defaults, named as assumed.
// `--calibration gpu-cluster` asks for the GPU-cluster defaults throughout (what
// tools/predict_scale.sh plans with); a calibration file measures a real cluster's links
// (each collective fitted by kind for the backend it ran, Note [Fitted collectives]) and
// its compute rate; with --time-layers the compute is timed here as above instead, for a
// file measured on machines like this one.
Calibration this_machine(ModelPlan& job, const LayerTimes& layers, bool spans_hosts) {
  double seconds = 0, flops = 0;
  for (const auto& c : layers.costs) seconds += c.forward_s + c.backward_s;
  for (double f : forward_flops(job.model(), job.probe())) flops += 3 * f * double(layers.micro);
  Calibration c;
  if (seconds > 0 && flops > 0) c.flops_per_s = flops / seconds;
  c.cores_per_host = hardware::usable_cores();
  // The pair: two thread-ranks measuring each other.
  std::vector<collectives::CommunicatorPtr> pair = collectives::make_local_group(2, "dry-run pair");
  LinkCost link;
  std::thread other([&] { measure_link(*pair[1], 0, 1); });
  link = measure_link(*pair[0], 0, 1);
  other.join();
  c.intra_host = link;
  const int threads = layers.threads;
  c.source = "this machine, measured: compute from the layers timed forward and backward on a micro-batch of " +
             std::to_string(layers.micro) + " at " + std::to_string(threads) + " thread" + (threads == 1 ? "" : "s") +
             " on " + cores_text(c.cores_per_host) + " cores" +
             "; inside a host a local pair (2 thread-ranks, shared memory); across hosts " +
             (spans_hosts ? "assumed: the GPU-cluster defaults (8 x 100 Gbit/s InfiniBand per host), as no second "
                            "host is here to measure (--calibration FILE from bench-collectives --calibrate measures it)"
                          : "not used (every rank on this host)");
  return c;
}

}  // namespace

// The calibration the dry run prices with, and whether its compute is the layers timed
// here (`layers` is filled then).
Calibration calibration_of(const DryRunOptions& how, ModelPlan& job, int64_t micro, bool spans_hosts,
                           std::optional<LayerTimes>& layers) {
  std::string file = how.calibration;
  if (file.empty()) file = env::text(env::kCalibration);
  // A job on cuda runs on GPUs this dry run does not time (it builds nothing on a device):
  // this host's CPU says nothing of them, so without a file measured on them it is priced
  // on the GPU-cluster defaults, and says so.
  const bool on_gpus = job.spec().train.device == DeviceKind::kCuda && file.empty() && !how.time_layers;
  if (file == "gpu-cluster" || on_gpus) {
    Calibration c;
    c.source = std::string("the GPU-cluster defaults, ") +
               (on_gpus ? "as train.device is cuda and no --calibration file measured its GPUs"
                        : "as --calibration gpu-cluster asks") +
               " (an A100-class cluster: NVLink inside a host, 8 x 100 Gbit/s InfiniBand across, 150 TFLOP/s per GPU)";
    return c;
  }
  if (file.empty() || how.time_layers) layers = time_layers(job, micro);
  if (file.empty()) return this_machine(job, *layers, spans_hosts);
  Calibration c = load_calibration(file);
  if (how.time_layers) {
    if (c.cores_per_host <= 0) c.cores_per_host = hardware::usable_cores();
    c.source += "; compute: the layers timed here (--time-layers) at " + std::to_string(layers->threads) + " thread" +
                (layers->threads == 1 ? "" : "s") + ", " + cores_text(c.cores_per_host) + " cores per host";
  }
  return c;
}

}  // namespace tetra::planner
