// bench-zero — ZeRO stages against data parallelism: throughput and model state per rank.
//
//   mpirun -np 2 build/bin/bench-zero                      # the issue's 104M-parameter MLP
//   mpirun -np 2 build/bin/bench-zero --set 'model.hidden=[1024,1024]' --steps 20
//
// Runs the same job at stage 0 (the data_parallel allreduce), 1, 2 and 3, alternating the
// stages --repeats times in one run (this machine is shared and noisy: only ratios measured
// side by side mean much) and keeping each stage's best. For each it prints samples/s
// (the whole job's), the ratio to stage 0 and to the stage before, the time per step in
// forward, backward, gradients (communication backward did not hide) and the optimizer
// (the fused step; under ZeRO also the all-gather of the updated shards; these phases
// average every step, the first included), and the
// model-state bytes of every rank (parameters, gradients, optimizer state, buffers)
// against ZeRO's formula for fp32 Adam: 16P, 8P + 8P/N, 4P + 12P/N, 16P/N.
// Data: seeded synthetic samples of 784 features (no files to read).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include "collectives/backends.h"
#include "collectives/error.h"
#include "collectives/launch.h"
#include "core/job_file.h"
#include "core/models.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "data_parallel/data_parallel.h"
#include "hardware/topology.h"
#include "zero/zero.h"

using namespace tetra;
using namespace tetra::core;
using hardware::ByteDigits;
using hardware::format_bytes;

namespace {

// 784-4096x7-10: about 104M parameters (the size of the ZeroRedundancyOptimizer figures).
const char* kDefaultJob = R"(
name: bench-zero
model: {type: mlp, hidden: [4096, 4096, 4096, 4096, 4096, 4096, 4096]}
data: {type: synthetic, shape: [784], classes: 10, train_samples: 4096, test_samples: 16, batch_size: 16}
optimizer: {type: adam, lr: 1.0e-4}
train: {threads: 1}
zero: {bucket_mb: 25}
)";

struct Measure {
  double sps = 0, step_ms = 0;
  TrainResult::Phases per_step;  // ms
  std::vector<ModelStateBytes> memory;  // per rank
};

}  // namespace

int main(int argc, char** argv) {
  prepare_process(argc, argv);
  CLI::App app{"bench-zero: ZeRO stages 1-3 against data parallelism, throughput and memory", "bench-zero"};
  std::vector<std::string> sets;
  int64_t steps = 6;
  int repeats = 2;
  std::vector<int> stages = {0, 1, 2, 3};
  app.add_option("--steps", steps, "timed steps per measurement (after one untimed step)")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "measurements of each stage, alternating; the best is kept")
      ->check(CLI::PositiveNumber);
  app.add_option("--stages", stages, "the stages to run")->check(CLI::Range(0, 3));
  app.add_option("--set", sets, "override a job key")
      ->type_size(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  CLI11_PARSE(app, argc, argv);
  try {
    SectionRegistry plugins;
    data_parallel::register_data_parallel(plugins);
    zero::register_zero(plugins);
    for (const char* s : {"train.eval_every=0", "data.eval_samples=1", "checkpoint.dir=", "log.metrics=", "log.dir=",
                          "log.progress=off"})
      sets.push_back(s);
    sets.push_back("train.max_steps=" + std::to_string(steps + 1));
    collectives::LaunchInfo launch = collectives::detect_launch();
    const int n = launch.multi_process() ? launch.world_size : 1;
    sets.push_back("mesh.data=" + std::to_string(n));
    auto parse = [&](int stage) {
      std::vector<std::string> all = sets;
      all.push_back("zero.stage=" + std::to_string(stage));
      return parse_job_string(kDefaultJob, "bench-zero", all, plugins).spec;
    };
    JobSpec base = parse(0);
    collectives::CommunicatorPtr world;
    if (launch.multi_process()) {
      collectives::BackendRegistry backends;
      collectives::register_builtin_backends(backends);
      world = backends.create_world(core::backend_of(base), launch);
    }
    const bool rank0 = !world || world->rank() == 0;
    const int threads = set_threads(base.train.threads);
    std::map<int, Measure> best;
    int64_t params = 0;
    for (int r = 0; r < repeats; ++r)
      for (int stage : stages) {
        TrainerOptions o;
        o.world = world;
        // The first step is not timed: it allocates the gradients and the optimizer state.
        using Clock = std::chrono::steady_clock;
        Clock::time_point after_first, after_last;
        o.on_step = [&](int64_t step, double) {
          if (step == 1) after_first = Clock::now();
          if (step == steps + 1) after_last = Clock::now();
        };
        Trainer t(parse(stage), o);
        params = t.model_parameters();
        TrainResult res = t.run();
        const double timed = std::chrono::duration<double>(after_last - after_first).count();
        const ModelStateBytes mine = res.memory;
        at::Tensor all = at::zeros({4 * n}, at::kLong);
        at::Tensor m4 = at::tensor({mine.parameters, mine.gradients, mine.optimizer, mine.buffers}, at::kLong);
        if (world)
          world->allgather(m4, all)->wait();
        else
          all.copy_(m4);
        Measure m;
        m.sps = static_cast<double>(steps * base.data.batch_size) / timed;
        m.step_ms = 1e3 * timed / static_cast<double>(steps);
        const double k = 1e3 / static_cast<double>(res.steps);
        m.per_step = {res.phases.data * k, res.phases.forward * k, res.phases.backward * k, res.phases.gradients * k,
                      res.phases.optimizer * k};
        for (int i = 0; i < n; ++i) {
          auto a = all.accessor<int64_t, 1>();
          ModelStateBytes b;
          b.parameters = a[4 * i];
          b.gradients = a[4 * i + 1];
          b.optimizer = a[4 * i + 2];
          b.buffers = a[4 * i + 3];
          m.memory.push_back(b);
        }
        if (m.sps > best[stage].sps) best[stage] = m;
        if (rank0)
          std::fprintf(stderr, "  round %d stage %d: %.1f samples/s\n", r + 1, stage, m.sps);
      }
    if (rank0) {
      std::printf("bench-zero: model %s, %lld parameters (P), batch %lld, %d rank%s x %d thread, %lld steps x %d repeats, %s\n",
                  base.model.type.c_str(), static_cast<long long>(params), static_cast<long long>(base.data.batch_size),
                  n, n == 1 ? "" : "s", threads, static_cast<long long>(steps + 1), repeats, blas_description().c_str());
      std::printf("%-6s %10s %8s %8s %8s %9s %9s %9s   %s\n", "stage", "samples/s", "vs 0", "vs prev", "fwd ms",
                  "bwd ms", "grads ms", "optim ms", "model state per rank (params + grads + optimizer + buffers) vs formula");
      const double psi = 4.0 * static_cast<double>(params);
      double prev = 0;
      for (int stage : stages) {
        const Measure& m = best[stage];
        const double formula[4] = {4 * psi, 2 * psi + 2 * psi / n, psi + 3 * psi / n, 4 * psi / n};
        std::printf("%-6d %10.2f %8.3f %8s %8.1f %9.1f %9.1f %9.1f  ", stage, m.sps,
                    best.count(0) ? m.sps / best[0].sps : 0.0,
                    prev > 0 ? std::to_string(m.sps / prev).substr(0, 5).c_str() : "-", m.per_step.forward,
                    m.per_step.backward, m.per_step.gradients, m.per_step.optimizer);
        for (size_t i = 0; i < m.memory.size(); ++i) {
          const auto& b = m.memory[i];
          const int64_t state = b.parameters + b.gradients + b.optimizer;
          std::printf(" r%zu %s (%s+%s+%s+%s, %.3f of formula)", i, format_bytes(b.total(), ByteDigits::kWhole).c_str(),
                      format_bytes(b.parameters, ByteDigits::kWhole).c_str(),
                      format_bytes(b.gradients, ByteDigits::kWhole).c_str(),
                      format_bytes(b.optimizer, ByteDigits::kWhole).c_str(),
                      format_bytes(b.buffers, ByteDigits::kWhole).c_str(),
                      static_cast<double>(state) / formula[stage]);
        }
        std::printf("\n");
        prev = m.sps;
      }
    }
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "bench-zero: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-zero: error: %s\n", e.what());
    return 1;
  }
}
