// bench-tensor — the tensor axis against the other ways to use the same cores.
//
//   mpirun -np 2 build/bin/bench-tensor [JOB.yaml] [--steps 10] [--repeats 2] [--set k=v]...
//
// Runs the job (default: a byte-level GPT of d_model 512, 8 heads, 4 layers, seq 128 on
// the GPL text, batch 16, AdamW) for --steps steps in each mode, the modes alternating
// --repeats times in one run, each mode's best kept:
//   tensor        mesh.tensor = N: each rank holds 1/N of the split layers
//   tensor-sp     the same with tensor.sequence_parallel
//   tensor-fused-off  tensor.overlap false (the input gradient summed after the weight
//                 gradient instead of beside it: Note [Overlapped input gradient])
//   data          mesh.data = N: each rank the whole model, 1/N of the batch
//   one-process   rank 0 alone with N intra-op threads (the others wait, asleep)
// and prints the samples/s of the whole job, the step time, each rank's model state
// (parameters, gradients, optimizer state: what Trainer::memory() counts) and the share
// of the step the tensor axis' collectives were busy (Note [Traffic counters]: the wall
// time during which one of its ops was running, waiting for a late peer included).
// Single-thread ranks on distinct cores are the honest comparison (README: Benchmarks).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <map>
#include <thread>

#include "collectives/backends.h"
#include "collectives/communicator.h"
#include "collectives/launch.h"
#include "core/job_file.h"
#include "core/mesh.h"
#include "core/models.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "tetra/tetra.h"

using namespace tetra;
using namespace tetra::core;

namespace {

const char* kDefaultJob = R"(
name: bench-tensor
model: {type: gpt, layers: 4, heads: 8, d_model: 512}
data: {type: text, path: /usr/share/common-licenses/GPL-3, seq_len: 128, batch_size: 16}
optimizer: {type: adamw, lr: 1.0e-3, weight_decay: 0.01}
train: {threads: 1, seed: 1}
)";

struct Measure {
  double sps = 0, step_ms = 0, tensor_share = 0;
  ModelStateBytes memory;
};

std::string mib(int64_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f MiB", double(b) / (1 << 20));
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  prepare_process(argc, argv);
  CLI::App app{"bench-tensor: the tensor axis beside data parallelism and one process", "bench-tensor"};
  std::string job;
  std::vector<std::string> sets;
  int64_t steps = 10;
  int repeats = 2;
  app.add_option("job", job, "job file (default: a GPT of d_model 512, 8 heads, 4 layers, seq 128)");
  app.add_option("--steps", steps, "steps per measurement")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "measurements of each mode, alternating; the best is kept")
      ->check(CLI::PositiveNumber);
  app.add_option("--set", sets, "override a job key")
      ->type_size(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  CLI11_PARSE(app, argc, argv);
  try {
    SectionRegistry plugins;
    register_builtin_plugins(plugins);
    for (const char* s : {"train.eval_every=0", "data.eval_samples=1", "checkpoint.dir=", "log.metrics=", "log.dir=",
                          "log.progress=off"})
      sets.push_back(s);
    sets.push_back("train.max_steps=" + std::to_string(steps));
    auto parse = [&](std::vector<std::string> extra) {
      std::vector<std::string> all = sets;
      all.insert(all.end(), extra.begin(), extra.end());
      return job.empty() ? parse_job_string(kDefaultJob, "bench-tensor", all, plugins).spec
                         : parse_job_file(job, all, plugins).spec;
    };
    collectives::LaunchInfo launch = collectives::detect_launch();
    if (!launch.multi_process()) {
      std::fprintf(stderr, "bench-tensor: run it under mpirun -np N (N ranks, one core each)\n");
      return 2;
    }
    collectives::BackendRegistry backends;
    collectives::register_builtin_backends(backends);
    collectives::CommunicatorPtr world = backends.create_world(backend_of(parse({})), launch);
    const int n = world->size();
    const std::string N = std::to_string(n);
    const bool rank0 = world->rank() == 0;
    const std::vector<std::pair<std::string, std::vector<std::string>>> modes = {
        {"tensor", {"mesh.tensor=" + N}},
        {"tensor-sp", {"mesh.tensor=" + N, "tensor.sequence_parallel=true"}},
        {"tensor-fused-off", {"mesh.tensor=" + N, "tensor.overlap=false"}},
        {"data", {"mesh.data=" + N}},
        {"one-process", {"train.threads=" + N}},
    };
    const JobSpec base = parse({});
    if (rank0)
      std::printf("bench-tensor: %s model %s d_model %lld, %lld heads, %lld layers, seq %lld, batch %lld; %lld steps x %d "
                  "repeats; %d ranks x %d thread (one-process: 1 rank x %d threads)\n",
                  base.data.type.c_str(), base.model.type.c_str(), static_cast<long long>(base.model.d_model),
                  static_cast<long long>(base.model.heads), static_cast<long long>(base.model.layers),
                  static_cast<long long>(base.data.seq_len), static_cast<long long>(base.data.batch_size),
                  static_cast<long long>(steps), repeats, n, base.train.threads, n);
    std::map<std::string, Measure> best;
    for (int r = 0; r < repeats; ++r)
      for (const auto& [mode, extra] : modes) {
        const JobSpec spec = parse(extra);
        Measure m;
        if (mode == "one-process") {
          if (rank0) {
            set_threads(spec.train.threads);
            TrainerOptions o;
            Trainer t(spec, o);
            const TrainResult res = t.run();
            m.sps = res.samples_per_s;
            m.step_ms = 1e3 * res.train_seconds / double(res.steps);
            m.memory = res.memory;
            set_threads(base.train.threads);
          }
          // The other ranks wait asleep, off the cores rank 0 computes on.
          collectives::WorkPtr done = world->barrier();
          while (!done->done()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          done->wait();
        } else {
          set_threads(spec.train.threads);
          TrainerOptions o;
          o.world = world;
          Trainer t(spec, o);
          const double busy0 = t.mesh()->axis("tensor")->busy_seconds();
          const TrainResult res = t.run();
          m.sps = res.samples_per_s;
          m.step_ms = 1e3 * res.train_seconds / double(res.steps);
          m.memory = res.memory;
          if (spec.mesh.size("tensor") > 1)
            m.tensor_share = (t.mesh()->axis("tensor")->busy_seconds() - busy0) / std::max(1e-9, res.train_seconds);
        }
        if (m.sps > best[mode].sps) best[mode] = m;
      }
    if (rank0) {
      std::printf("%-17s %10s %9s %12s %12s %12s %12s %8s\n", "mode", "samples/s", "step ms", "state/rank", "params",
                  "grads", "optimizer", "tensor");
      for (const auto& [mode, extra] : modes) {
        const Measure& m = best[mode];
        std::printf("%-17s %10.1f %9.1f %12s %12s %12s %12s %7.0f%%\n", mode.c_str(), m.sps, m.step_ms,
                    mib(m.memory.total()).c_str(), mib(m.memory.parameters).c_str(), mib(m.memory.gradients).c_str(),
                    mib(m.memory.optimizer).c_str(), 100 * m.tensor_share);
      }
      std::printf("tensor: %.2fx data's samples/s, %.2fx one process's; its model state %.2fx data's per rank\n",
                  best["tensor"].sps / best["data"].sps, best["tensor"].sps / best["one-process"].sps,
                  double(best["tensor"].memory.total()) / double(std::max<int64_t>(1, best["data"].memory.total())));
      std::printf("tensor.overlap: %.3fx the samples/s with it off\n", best["tensor"].sps / best["tensor-fused-off"].sps);
    }
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "bench-tensor: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-tensor: error: %s\n", e.what());
    return 1;
  }
}
