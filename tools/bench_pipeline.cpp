// bench-pipeline — what a 2-stage pipeline costs and buys: bubble, activation memory,
// throughput.
//
//   mpirun --oversubscribe --bind-to none -np 2 build/bin/bench-pipeline [--steps 20] [--balance "[8, 10]"] [--set k=v]...
//
// On a deep MLP (784-512x8-10, batch 256, one thread per rank; by_time balance, but a
// fixed cut for the bubble runs):
//   bubble      the idle fraction of each stage measured over the run (time blocked
//               on a neighbour / step wall time), for gpipe and 1f1b at 2, 4, 8, 16 micro-batches,
//               beside the theoretical (P-1)/(m+P-1);
//   memory      the peak bytes a stage allocates during a step above what it holds
//               between steps (activations, their gradients, received buffers), for
//               gpipe and 1f1b at 16 micro-batches, with and without checkpointing —
//               counted by LibTorch's CPU allocator reporting on the stage's thread;
//   throughput  samples/s of the pipeline against one process with one thread (rank 0
//               alone, while rank 1 sleeps in a barrier), at 8 and 16 micro-batches,
//               beside the bound 2m/(m+1).
// Every figure comes from this one run, so the ratios share the machine's conditions.
#include <CLI/CLI.hpp>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>

#include "collectives/backends.h"
#include "collectives/error.h"
#include "collectives/launch.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "pipeline/pipeline.h"

using namespace tetra;
using namespace tetra::core;

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
};

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
    auto parse = [&](std::vector<std::string> extra) {
      std::vector<std::string> all = sets;
      all.push_back("train.max_steps=" + std::to_string(steps));
      all.insert(all.end(), extra.begin(), extra.end());
      return parse_job_string(kJob, "bench-pipeline", all, plugins).spec;
    };
    set_threads(1);
    auto pipelined = [&](const std::string& schedule, int m, const std::string& checkpoint, bool meter,
                         std::vector<std::string> extra = {}, const std::string& balance = "by_time") {
      Run r;
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
      }
      extra.insert(extra.end(), {"mesh.pipeline=2", "pipeline.schedule=" + schedule,
                                 "pipeline.micro_batches=" + std::to_string(m), "pipeline.checkpoint=" + checkpoint,
                                 "pipeline.balance=" + balance});
      Trainer t(parse(extra), o);
      TrainResult res = t.run();
      r.samples_per_s = res.samples_per_s;
      for (const auto& s : t.strategies())
        if (auto* p = dynamic_cast<const pipeline::PipelineStrategy*>(s.get())) r.bubble = p->stats().bubble();
      r.step_bytes = mm->peak_above_base();
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
    if (rank0) std::printf("\nbubble (idle fraction of each stage over the run)\n%-6s %4s %9s %9s %9s %9s\n",
                           "sched", "m", "stage 0", "stage 1", "theory", "max diff");
    for (const char* sched : {"gpipe", "1f1b"})
      for (int m : {2, 4, 8, 16}) {
        Run r = pipelined(sched, m, "never", false, {}, balance);
        auto [b0, b1] = both(r.bubble);
        const double ideal = 1.0 / (m + 1);
        if (rank0)
          std::printf("%-6s %4d %8.1f%% %8.1f%% %8.1f%% %8.1f pp\n", sched, m, 100 * b0, 100 * b1, 100 * ideal,
                      100 * std::max(std::abs(b0 - ideal), std::abs(b1 - ideal)));
      }

    // Memory with a batch of 2048 (micro-batches of 128): activations then dwarf the
    // few MiB of per-step workspace (weight-gradient temporaries, buffers in flight).
    if (rank0) std::printf("\nactivation memory at 16 micro-batches of 128 (batch 2048; peak a step allocates above the\n"
                           "resting state, per stage)\n%-6s %-11s %11s %11s\n", "sched", "checkpoint", "stage 0", "stage 1");
    for (const char* sched : {"gpipe", "1f1b"})
      for (const char* ck : {"never", "except_last", "always"}) {
        Run r = pipelined(sched, 16, ck, true, {"data.batch_size=2048", "train.max_steps=4"});
        auto [m0, m1] = both(static_cast<double>(r.step_bytes));
        if (rank0)
          std::printf("%-6s %-11s %11s %11s\n", sched, ck, human_bytes(static_cast<int64_t>(m0)).c_str(),
                      human_bytes(static_cast<int64_t>(m1)).c_str());
      }

    // Two baselines on one process with one thread (rank 0 alone; rank 1 sleeps in a
    // barrier): the same arithmetic (the batch as m accumulated micro-batches, what the
    // bound 2m/(m+1) compares against), and the whole batch at once (what a user would
    // otherwise run; its larger matrix products are faster per sample).
    if (rank0) std::printf("\nthroughput, 1f1b on 2 processes x 1 thread against 1 process x 1 thread\n"
                           "%4s %11s %16s %16s %9s %14s %15s\n", "m", "samples/s", "1 proc, m micro", "1 proc, whole",
                           "bound", "speedup (same)", "of bound (same)");
    collectives::BarrierOptions bo;
    bo.timeout = std::chrono::minutes(30);
    // Runs of 3x the steps, each mode 3 times alternating, the best kept: a shared
    // machine's noise only ever slows a run down.
    const std::string longer = "train.max_steps=" + std::to_string(3 * steps);
    double whole = 0;
    for (int rep = 0; rep < 3 && rank0; ++rep) whole = std::max(whole, Trainer(parse({longer})).run().samples_per_s);
    for (int m : {8, 16}) {
      double same = 0;
      Run r;
      for (int rep = 0; rep < 3; ++rep) {
        if (rank0)
          same = std::max(same, Trainer(parse({longer, "train.accumulation_steps=" + std::to_string(m)})).run().samples_per_s);
        world->barrier(bo)->wait();  // rank 1 sleeps here while rank 0 runs alone
        Run got = pipelined("1f1b", m, "never", false, {longer});
        if (got.samples_per_s > r.samples_per_s) r = got;
      }
      const double bound = 2.0 * m / (m + 1);
      if (rank0)
        std::printf("%4d %11.0f %16.0f %16.0f %8.2fx %13.2fx %15.2f   (%.2fx the whole-batch process)\n", m,
                    r.samples_per_s, same, whole, bound, r.samples_per_s / same, r.samples_per_s / same / bound,
                    r.samples_per_s / whole);
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
