// bench-pipeline — what a 2-stage pipeline costs and buys: bubble, activation memory,
// throughput.
//
//   mpirun --oversubscribe --bind-to none -np 2 build/bin/bench-pipeline [--steps 20] [--balance "[8, 10]"] [--set k=v]...
//
// On a deep MLP (784-512x8-10, batch 256, one thread per rank, a fixed cut), for gpipe,
// 1f1b, interleaved 1F1B (two chunks per rank), zbh1 and zbv at 8 and 16 micro-batches:
//   throughput  samples/s against one process with one thread (rank 0 alone, while rank
//               1 sleeps in a barrier) and the ratio to the bound 2m/(m+1) x one process
//               on the same micro-batches;
//   bubble      the idle fraction of each stage measured over the run (time blocked on
//               a neighbour / step wall time), beside the simulator's for the schedule;
//   memory      per rank at batch 2048: the peak bytes a step allocates above what the
//               stage holds between steps (LibTorch's CPU allocator, reporting on the
//               stage's thread) and the process's peak RSS over the run.
// Every figure comes from this one run, so the ratios share the machine's conditions.
#include <CLI/CLI.hpp>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <malloc.h>
#include <fstream>
#include <string>
#include <memory>

#include "collectives/backends.h"
#include "collectives/error.h"
#include "collectives/launch.h"
#include "core/job_file.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "hardware/topology.h"
#include "pipeline/pipeline.h"

using namespace tetra;
using namespace tetra::core;
using hardware::ByteDigits;
using hardware::format_bytes;

namespace {

const char* kJob = R"(
name: bench-pipeline
model: {type: mlp, hidden: [512, 512, 512, 512, 512, 512, 512, 512]}
data: {type: fashion-mnist, batch_size: 256, eval_samples: 1}
optimizer: {type: sgd, lr: 0.01}
train: {threads: 1, eval_every: 0}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

// Bytes this thread's CPU allocations hold, and their peak since the last reset (the
// allocator reports every allocation and free while this is installed).
class MemoryMeter final : public c10::MemoryReportingInfoBase {
 public:
#if TORCH_VERSION_MAJOR >= 2
  using Total = size_t;
#else
  using Total = int64_t;
#endif
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, Total /*allocated*/, Total /*reserved*/,
                         c10::Device device) override {
    if (!device.is_cpu()) return;
    now_ += alloc_size;
    peak_ = std::max(peak_, now_);
  }
  bool memoryProfilingEnabled() const override { return true; }
  void reset() {
    base_ = now_;
    peak_ = now_;
  }
  int64_t peak_above_base() const { return peak_ - base_; }

 private:
  int64_t now_ = 0, peak_ = 0, base_ = 0;
};

struct Run {
  double samples_per_s = 0;
  double bubble = 0;       // this rank
  int64_t step_bytes = 0;  // this rank's peak above its resting state (memory runs)
  int64_t peak_rss = 0;    // the process's peak RSS over the run above its RSS before (memory runs)
  double busy_ms = 0;      // this rank's forward + backward per step
  pipeline::Schedule schedule;
};

// The process's resident set now (VmRSS) or at its peak (VmHWM), in bytes.
int64_t status_bytes(const char* key) {
  std::ifstream f("/proc/self/status");
  const std::string k = key;
  for (std::string line; std::getline(f, line);)
    if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size())) * 1024;
  return 0;
}
// Starts the peak again from the resident set, after handing the heap's free pages back
// (what earlier runs freed would otherwise absorb this run's growth); returns the RSS.
int64_t reset_peak_rss() {
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";  // Linux: resets VmHWM to VmRSS
  return status_bytes("VmRSS:");
}

}  // namespace

int main(int argc, char** argv) {
  prepare_process(argc, argv);
  CLI::App app{"bench-pipeline: bubble, activation memory and throughput of a 2-stage pipeline", "bench-pipeline"};
  int64_t steps = 20;
  std::vector<std::string> sets;
  // A fixed cut, so that every bubble run has the same stages (by_time measures anew
  // each run, and its noise moves the cut); [8, 10] is what by_time picks most often.
  std::string balance = "[8, 10]";
  app.add_option("--balance", balance, "pipeline.balance of the bubble runs (default [8, 10]; by_time)");
  app.add_option("--steps", steps, "steps per measurement")->check(CLI::PositiveNumber);
  app.add_option("--set", sets, "override a job key")
      ->type_size(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  CLI11_PARSE(app, argc, argv);
  try {
    collectives::LaunchInfo launch = collectives::detect_launch();
    if (!launch.multi_process() || launch.world_size != 2)
      throw ConfigError("bench-pipeline runs on 2 processes: mpirun --oversubscribe --bind-to none -np 2 " +
                        std::string(argv[0]));
    collectives::BackendRegistry backends;
    collectives::register_builtin_backends(backends);
    collectives::CommunicatorPtr world = backends.create_world("mpi", launch);
    const bool rank0 = world->rank() == 0;
    SectionRegistry plugins;
    pipeline::register_pipeline(plugins);
    // The pipelined runs are for the launch's 2 processes; a baseline on rank 0 alone is a
    // world of one (Note [Auto axis]: under mpirun the data axis would size itself to 2).
    auto parse = [&](std::vector<std::string> extra, const JobWorld& where) {
      std::vector<std::string> all = sets;
      all.push_back("train.max_steps=" + std::to_string(steps));
      all.insert(all.end(), extra.begin(), extra.end());
      return parse_job_string(kJob, "bench-pipeline", all, plugins, {}, where).spec;
    };
    const JobWorld alone{1, "the one-process baseline"};
    set_threads(1);
    auto pipelined = [&](int m, const std::string& checkpoint, bool meter, std::vector<std::string> extra) {
      Run r;
      int64_t rss_before = 0;
      TrainerOptions o;
      o.world = world;
      auto mm = std::make_shared<MemoryMeter>();
      std::unique_ptr<c10::DebugInfoGuard> guard;
      if (meter) {
        guard = std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PROFILER_STATE, mm);
        // The first step allocates the gradients for good; measure the later steps.
        o.on_step = [&](int64_t step, double) {
          if (step == 1) mm->reset();
        };
        rss_before = reset_peak_rss();
      }
      extra.insert(extra.end(), {"mesh.pipeline=2", "pipeline.micro_batches=" + std::to_string(m),
                                 "pipeline.checkpoint=" + checkpoint});
      Trainer t(parse(extra, launch_world()), o);
      TrainResult res = t.run();
      r.samples_per_s = res.samples_per_s;
      for (const auto& s : t.strategies())
        if (auto* p = dynamic_cast<const pipeline::PipelineStrategy*>(s.get())) {
          r.bubble = p->stats().bubble();
          r.busy_ms = 1e3 * p->stats().busy_s / std::max<int64_t>(1, p->stats().steps);
          r.schedule = p->schedule();
        }
      r.step_bytes = mm->peak_above_base();
      r.peak_rss = meter ? status_bytes("VmHWM:") - rss_before : 0;
      return r;
    };
    // Each rank's figure, on rank 0: [rank 0's, rank 1's].
    auto both = [&](double mine) {
      at::Tensor t = at::zeros({2}, at::kDouble);
      t[world->rank()] = mine;
      world->allreduce(t)->wait();
      return std::make_pair(t[0].item<double>(), t[1].item<double>());
    };

    if (rank0)
      std::printf("bench-pipeline: mlp 784-512x8-10, batch 256, sgd, %lld steps, 2 ranks x 1 thread, %s\n",
                  static_cast<long long>(steps), blas_description().c_str());

    // The schedules side by side: gpipe, 1f1b and zbh1 on the 2-stage cut, interleaved
    // 1F1B and ZBV on 4 stages (two chunks per rank, each rank holding 8 or 10 layers as
    // the 2-stage cut does: [4, 4, 4, 6] puts stages 0+2 / 1+3 on ranks 0 / 1 interleaved,
    // 0+3 / 1+2 in the V).
    struct Kind {
      const char* name;
      std::vector<std::string> sets;
    };
    const std::vector<Kind> kinds = {
        {"gpipe", {"pipeline.schedule=gpipe", "pipeline.balance=" + balance}},
        {"1f1b", {"pipeline.schedule=1f1b", "pipeline.balance=" + balance}},
        {"interleaved", {"pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2", "pipeline.balance=[4, 4, 4, 6]"}},
        {"zbh1", {"pipeline.schedule=zbh1", "pipeline.balance=" + balance}},
        {"zbv", {"pipeline.schedule=zbv", "pipeline.balance=[4, 4, 4, 6]"}},
    };
    // Two baselines on one process with one thread (rank 0 alone; rank 1 sleeps in a
    // barrier): the same arithmetic (the batch as m accumulated micro-batches, what the
    // bound 2m/(m+1) compares against), and the whole batch at once (what a user would
    // otherwise run; its larger matrix products are faster per sample). Runs of 3x the
    // steps, each 3 times alternating with the pipeline's, the best kept: a shared
    // machine's noise only ever slows a run down.
    collectives::BarrierOptions bo;
    bo.timeout = std::chrono::minutes(30);
    const std::string longer = "train.max_steps=" + std::to_string(3 * steps);
    double whole = 0;
    for (int rep = 0; rep < 3 && rank0; ++rep) whole = std::max(whole, Trainer(parse({longer}, alone)).run().samples_per_s);
    world->barrier(bo)->wait();
    if (rank0)
      std::printf("\none process x 1 thread, the whole batch: %.0f samples/s\n"
                  "\n%-11s %3s %10s %9s %9s %9s %8s %8s %10s %10s %15s\n",
                  whole, "schedule", "m", "samples/s", "bubble 0", "bubble 1", "simulated", "x bound", "x whole",
                  "1 proc, m", "bound", "busy ms 0 / 1");
    for (int m : {8, 16}) {
      double same = 0;
      for (int rep = 0; rep < 3 && rank0; ++rep)
        same = std::max(same, Trainer(parse({longer, "train.accumulation_steps=" + std::to_string(m)}, alone)).run().samples_per_s);
      world->barrier(bo)->wait();  // rank 1 sleeps here while rank 0 runs alone
      const double bound = 2.0 * m / (m + 1);
      for (const Kind& k : kinds) {
        Run r;
        for (int rep = 0; rep < 3; ++rep) {
          std::vector<std::string> extra = k.sets;
          extra.push_back(longer);
          Run got = pipelined(m, "never", false, extra);
          if (got.samples_per_s > r.samples_per_s) r = got;
        }
        auto [b0, b1] = both(r.bubble);
        auto [u0, u1] = both(r.busy_ms);
        const auto& sched = r.schedule;
        const pipeline::Simulation sim = pipeline::simulate(sched);
        if (rank0)
          std::printf("%-11s %3d %10.0f %8.1f%% %8.1f%% %8.1f%% %8.2f %8.2f %10.0f %9.2fx %7.1f / %5.1f\n", k.name, m,
                      r.samples_per_s, 100 * b0, 100 * b1, 100 * sim.bubble_fraction, r.samples_per_s / same / bound,
                      r.samples_per_s / whole, same, bound, u0, u1);
      }
    }
    if (rank0)
      std::printf("bubble: time a stage waited for a neighbour / its step time (PipelineStats); simulated: the\n"
                  "schedule's idle fraction for backward = 2 forwards (B = W = 1); x bound: samples/s over\n"
                  "(one process on the same m micro-batches x 2m/(m+1)); x whole: over the whole-batch process;\n"
                  "busy: a rank's forward and backward (B and W) time per step\n");

    // Memory with a batch of 2048 (micro-batches of 128): activations then dwarf the
    // few MiB of per-step workspace (weight-gradient temporaries, buffers in flight).
    if (rank0)
      std::printf("\nmemory at 16 micro-batches of 128 (batch 2048), per rank: the peak a step allocates above\n"
                  "the resting state (LibTorch's allocator) and how far the process's RSS rose over the run\n"
                  "(VmHWM, reset before it, less the RSS then)\n%-11s %-11s %11s %11s %11s %11s\n",
                  "schedule", "checkpoint", "alloc 0", "alloc 1", "RSS 0", "RSS 1");
    for (const Kind& k : kinds)
      for (const char* ck : {"never", "always"}) {
        if (std::string(ck) == "always" && std::string(k.name) != "1f1b" && std::string(k.name) != "zbh1") continue;
        std::vector<std::string> extra = k.sets;
        extra.insert(extra.end(), {"data.batch_size=2048", "train.max_steps=4"});
        Run r = pipelined(16, ck, true, extra);
        auto [m0, m1] = both(static_cast<double>(r.step_bytes));
        auto [r0, r1] = both(static_cast<double>(r.peak_rss));
        if (rank0)
          std::printf("%-11s %-11s %11s %11s %11s %11s\n", k.name, ck,
                      format_bytes(static_cast<int64_t>(m0), ByteDigits::kWhole).c_str(),
                      format_bytes(static_cast<int64_t>(m1), ByteDigits::kWhole).c_str(),
                      format_bytes(static_cast<int64_t>(r0), ByteDigits::kWhole).c_str(),
                      format_bytes(static_cast<int64_t>(r1), ByteDigits::kWhole).c_str());
      }
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "bench-pipeline: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-pipeline: error: %s\n", e.what());
    return 1;
  }
}
