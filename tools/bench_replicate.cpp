// bench-replicate — replicas as threads against threads and against processes.
//
//   build/bin/bench-replicate [--steps 60] [--repeats 3] [--3d]
//
// The quickstart MLP (configs/quickstart.yaml's model and batch), side by side in one
// run, alternating the modes --repeats times and keeping each one's best:
//   threads    1 process x 2 intra-op threads
//   processes  2 MPI processes x 1 thread, data parallel (mpirun, started from here)
//   replicas   1 process x 2 replicas x 1 thread (replicate: {replicas: 2})
// Replicas share the process's memory and reduce over it without MPI, so on the same
// cores they should be at least as fast as processes.
//
// --3d adds configs/3d.yaml (pipeline 2 x data 2 x ZeRO-1, a GPT) on 4 MPI processes
// against the same model and batch on one process (2 threads).
//
// Each mode is run by this binary itself in worker mode (--worker), under mpirun where
// the mode needs processes; rank 0 prints one RESULT line that the parent reads.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include "collectives/backends.h"
#include "collectives/build_config.h"
#include "collectives/launch.h"
#include "core/job_file.h"
#include "core/plan.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "data_parallel/data_parallel.h"
#include "hardware/env.h"
#include "hardware/host.h"
#include "pipeline/pipeline.h"
#include "replicate/replicate.h"
#include "zero/zero.h"

using namespace tetra;
using namespace tetra::core;

namespace {

const std::vector<std::string> kQuiet = {"train.eval_every=0", "data.eval_samples=1", "checkpoint.dir=", "log.metrics=", "log.dir=",
                                         "log.progress=off", "checkpoint.safetensors="};

// Worker: trains `job` with `sets` for `steps` steps under whatever launched it and
// prints "RESULT <samples/s>" on the writer.
int worker(const std::string& job, std::vector<std::string> sets, int64_t steps) {
  SectionRegistry plugins;
  data_parallel::register_data_parallel(plugins);
  pipeline::register_pipeline(plugins);
  zero::register_zero(plugins);
  replicate::register_replicate(plugins);
  sets.insert(sets.end(), kQuiet.begin(), kQuiet.end());
  sets.push_back("train.max_steps=" + std::to_string(steps));
  const JobSpec spec = parse_job_file(job, sets, plugins).spec;
  const Plan plan(spec);
  const collectives::LaunchInfo launch = collectives::detect_launch();
  collectives::CommunicatorPtr world;
  if (launch.multi_process()) {
    collectives::BackendRegistry backends;
    collectives::register_builtin_backends(backends);
    world = backends.create_world(core::backend_of(spec), launch);
    plan.check_world(world->size(), "this launch");
  }
  set_threads(spec.train.threads, plan.replicas());
  TrainerOptions o;
  o.world = world;
  const TrainResult r = plan.replicas() > 1 ? replicate::train(spec, o) : Trainer(spec, o).run();
  if (!world || world->rank() == 0) std::printf("RESULT %.3f\n", r.samples_per_s);
  return 0;
}

// Runs `command` (this binary in worker mode, maybe under mpirun) and returns the
// samples/s its RESULT line reports (0 and the output on failure).
double measure(const std::string& command) {
  std::string out;
  if (FILE* p = popen((command + " 2>&1").c_str(), "r")) {
    char buf[4096];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    if (pclose(p) != 0) out += "(exit status non-zero)\n";
  }
  const size_t at = out.rfind("RESULT ");
  if (at == std::string::npos) {
    std::fprintf(stderr, "bench-replicate: no result from: %s\n%s", command.c_str(), out.c_str());
    return 0;
  }
  return std::atof(out.c_str() + at + 7);
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

}  // namespace

int main(int argc, char** argv) {
  prepare_process(argc, argv);
  CLI::App app{"bench-replicate: replicas as threads against threads and processes", "bench-replicate"};
  int64_t steps = 60;
  int repeats = 3;
  bool three_d = false;
  std::string worker_job;
  std::vector<std::string> worker_sets;
  app.add_option("--steps", steps, "steps per measurement")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "measurements of each mode, alternating; the best is kept")->check(CLI::PositiveNumber);
  app.add_flag("--3d", three_d, "also configs/3d.yaml on 4 processes against one process");
  app.add_option("--worker", worker_job, "(internal) run one mode of JOB and print its samples/s");
  app.add_option("--set", worker_sets, "(internal) a job key for --worker")
      ->type_size(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  CLI11_PARSE(app, argc, argv);
  try {
    if (!worker_job.empty()) return worker(worker_job, worker_sets, steps);

    const std::string self = "/proc/self/exe";
    char exe[4096] = {0};
    const ssize_t n = readlink(self.c_str(), exe, sizeof exe - 1);
    const std::string me = n > 0 ? std::string(exe, static_cast<size_t>(n)) : std::string(argv[0]);
    const std::string root = TETRA_SOURCE_DIR;
    const std::string mpirun = std::string(TETRA_MPIEXEC) + " --oversubscribe --bind-to none -np ";
    auto run = [&](const std::string& job, const std::string& sets, int np) {
      const std::string cmd = me + " --worker " + quote(root + "/configs/" + job) + " --steps " + std::to_string(steps) + sets;
      return measure(np > 0 ? mpirun + std::to_string(np) + " " + cmd : cmd);
    };
    env::set(env::kOmpiAllowRunAsRoot, "1");
    env::set(env::kOmpiAllowRunAsRootConfirm, "1");

    struct Mode {
      std::string name, job, sets;
      int np;
    };
    std::vector<Mode> modes = {
        {"1 process x 2 threads", "quickstart.yaml", " --set train.threads=2", 0},
        {"2 processes x 1 thread (mpi)", "quickstart.yaml", " --set train.threads=1 --set mesh.data=2", 2},
        {"1 process x 2 replicas x 1 thread", "quickstart.yaml", " --set train.threads=1 --set replicate.replicas=2", 0}};
    if (three_d) {
      modes.push_back({"3d: 1 process x 2 threads", "3d.yaml",
                       " --set mesh.pipeline=1 --set mesh.data=1 --set zero.stage=0 --set pipeline.micro_batches=1 "
                       "--set train.threads=2",
                       0});
      modes.push_back({"3d: pipeline 2 x data 2 x zero-1, 4 processes", "3d.yaml", " --set train.threads=1", 4});
    }
    std::printf("bench-replicate: %lld steps x %d repeats per mode, %d usable cores, %s\n", static_cast<long long>(steps),
                repeats, hardware::usable_cores(), blas_description().c_str());
    std::map<std::string, double> best;
    for (int r = 0; r < repeats; ++r)
      for (const Mode& m : modes) best[m.name] = std::max(best[m.name], run(m.job, m.sets, m.np));
    const double base = best[modes[0].name];
    std::printf("%-48s %12s %10s\n", "mode", "samples/s", "vs first");
    for (const Mode& m : modes) {
      const double ref = m.job == "3d.yaml" ? best[modes[3].name] : base;
      std::printf("%-48s %12.0f %9.2fx\n", m.name.c_str(), best[m.name], ref > 0 ? best[m.name] / ref : 0.0);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-replicate: error: %s\n", e.what());
    return 1;
  }
}
