// bench-train — training throughput, and where a step's time goes.
//
//   build/bin/bench-train [JOB.yaml] [--steps 100] [--repeats 3] [--set k=v]...
//   mpirun -np 2 build/bin/bench-train --set mesh.data=2
//
// Runs the job's model for --steps steps (no evaluation, no checkpoints) in each mode,
// alternating the modes --repeats times in one run and keeping each mode's best:
//   one process:  "single"
//   data-parallel: "overlap" (allreduce during backward), "no-overlap" (one pass after
//                  backward), "no-comm" (gradient allreduce skipped: the compute-only
//                  ceiling of this many ranks on this machine), "checked" (overlap with
//                  collectives.check on: every op's fingerprint agreed first)
// and prints samples/s (the whole job's), step time, the time per step in data,
// forward, backward, gradients (what backward did not hide) and the optimizer, and how
// much of the communication backward hid: 1 - exposed(overlap) / exposed(no-overlap),
// where exposed = gradients time beyond no-comm's.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "collectives/backends.h"
#include "collectives/communicator.h"
#include "collectives/error.h"
#include "collectives/launch.h"
#include "core/job_file.h"
#include "core/models.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "data_parallel/data_parallel.h"

using namespace tetra;
using namespace tetra::core;

namespace {

const char* kDefaultJob = R"(
name: bench-train
model: {type: mlp, hidden: [1024, 1024]}
data: {type: fashion-mnist, batch_size: 256}
optimizer: {type: adamw, lr: 1.0e-3, weight_decay: 0.01}
train: {threads: 1}
)";

struct Measure {
  double sps = 0, step_ms = 0;
  TrainResult::Phases per_step;  // ms
};

}  // namespace

int main(int argc, char** argv) {
  prepare_process(argc, argv);
  CLI::App app{"bench-train: throughput and the time of each phase of a step", "bench-train"};
  std::string job;
  std::vector<std::string> sets;
  int64_t steps = 100;
  int repeats = 3;
  bool json = false;
  app.add_option("job", job, "job file (default: the Fashion-MNIST MLP 784-1024-1024-10, batch 256, 1 thread)");
  app.add_option("--steps", steps, "steps per measurement")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "measurements of each mode, alternating; the best is kept")
      ->check(CLI::PositiveNumber);
  app.add_option("--set", sets, "override a job key")
      ->type_size(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_flag("--json", json, "one JSON object per mode");
  CLI11_PARSE(app, argc, argv);
  try {
    SectionRegistry plugins;
    data_parallel::register_data_parallel(plugins);
    for (const char* s : {"train.eval_every=0", "data.eval_samples=1", "checkpoint.dir=", "log.metrics=", "log.dir=",
                          "log.progress=off"})
      sets.push_back(s);
    sets.push_back("train.max_steps=" + std::to_string(steps));
    auto parse = [&](std::vector<std::string> extra) {
      std::vector<std::string> all = sets;
      all.insert(all.end(), extra.begin(), extra.end());
      return job.empty() ? parse_job_string(kDefaultJob, "bench-train", all, plugins).spec
                         : parse_job_file(job, all, plugins).spec;
    };
    JobSpec base = parse({});
    collectives::LaunchInfo launch = collectives::detect_launch();
    collectives::CommunicatorPtr world;
    if (launch.multi_process()) {
      collectives::BackendRegistry backends;
      collectives::register_builtin_backends(backends);
      world = backends.create_world(core::backend_of(base), launch);
      check_mesh_fits(base.mesh, world->size(), "this launch");
    }
    const bool rank0 = !world || world->rank() == 0;
    const int threads = set_threads(base.train.threads);
    std::vector<std::pair<std::string, std::vector<std::string>>> modes;
    if (base.mesh.size("data") > 1)
      modes = {{"overlap", {"data_parallel.overlap=true"}},
               {"no-overlap", {"data_parallel.overlap=false"}},
               {"no-comm", {}},  // data_parallel::Options::compute_only
               {"checked", {"data_parallel.overlap=true"}}};  // the fingerprints' cost
    else
      modes = {{"single", {}}};
    if (rank0 && !json)
      std::printf("bench-train: %s, model %s, batch %lld, %lld steps x %d repeats, %d rank%s x %d thread%s, %s\n",
                  base.data.type.c_str(), base.model.type.c_str(), static_cast<long long>(base.data.batch_size),
                  static_cast<long long>(steps), repeats, world ? world->size() : 1, world && world->size() > 1 ? "s" : "",
                  threads, threads == 1 ? "" : "s", blas_description().c_str());
    std::map<std::string, Measure> best;
    for (int r = 0; r < repeats; ++r)
      for (const auto& [mode, extra] : modes) {
        TrainerOptions o;
        o.world = world;
        collectives::HealthOptions health = collectives::health_options();
        health.check = mode == "checked";  // the trainer's groups take it when they are made
        collectives::set_health_options(health);
        JobSpec spec = parse(extra);
        // The compute-only ceiling: a switch of the C++ API, not of the job spec.
        if (auto on = spec.plugin<data_parallel::Options>("data_parallel"); on && mode == "no-comm") {
          auto dp = std::make_shared<data_parallel::Options>(*on);
          dp->compute_only = true;
          spec.plugins["data_parallel"] = dp;
        }
        Trainer t(spec, o);
        if (r == 0 && mode == modes.front().first && rank0 && !json)
          std::printf("model: %lld parameters\n", static_cast<long long>(parameter_count(*t.model())));
        TrainResult res = t.run();
        Measure m;
        m.sps = res.samples_per_s;
        m.step_ms = 1e3 * res.train_seconds / static_cast<double>(res.steps);
        const double k = 1e3 / static_cast<double>(res.steps);
        m.per_step = {res.phases.data * k, res.phases.forward * k, res.phases.backward * k, res.phases.gradients * k,
                      res.phases.optimizer * k};
        if (m.sps > best[mode].sps) best[mode] = m;
      }
    if (rank0) {
      if (!json)
        std::printf("%-11s %12s %9s %8s %9s %9s %10s %10s\n", "mode", "samples/s", "step ms", "data", "forward",
                    "backward", "gradients", "optimizer");
      for (const auto& [mode, extra] : modes) {
        const Measure& m = best[mode];
        if (json)
          std::printf("%s\n", nlohmann::json({{"mode", mode}, {"samples_per_s", m.sps}, {"step_ms", m.step_ms},
                                              {"data_ms", m.per_step.data}, {"forward_ms", m.per_step.forward},
                                              {"backward_ms", m.per_step.backward},
                                              {"gradients_ms", m.per_step.gradients},
                                              {"optimizer_ms", m.per_step.optimizer}}).dump().c_str());
        else
          std::printf("%-11s %12.0f %9.2f %8.2f %9.2f %9.2f %10.2f %10.2f\n", mode.c_str(), m.sps, m.step_ms,
                      m.per_step.data, m.per_step.forward, m.per_step.backward, m.per_step.gradients,
                      m.per_step.optimizer);
      }
      if (best.count("no-comm") && !json) {
        const double ceiling = best["no-comm"].sps;
        const double exposed_on = std::max(0.0, best["overlap"].step_ms - best["no-comm"].step_ms);
        const double exposed_off = std::max(1e-9, best["no-overlap"].step_ms - best["no-comm"].step_ms);
        std::printf("overlap: %.3f of the compute-only ceiling; no-overlap: %.3f; backward hid %.0f%% of the communication\n",
                    best["overlap"].sps / ceiling, best["no-overlap"].sps / ceiling,
                    100.0 * std::max(0.0, 1.0 - exposed_on / exposed_off));
        std::printf("collectives.check on: %.3f of the samples/s with it off (overlap)\n",
                    best["checked"].sps / best["overlap"].sps);
      }
    }
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "bench-train: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-train: error: %s\n", e.what());
    return 1;
  }
}
