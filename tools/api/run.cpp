#include "tetra/run.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "collectives/backends.h"
#include "collectives/build_config.h"
#include "collectives/launch.h"
#include "collectives/local.h"
#include "collectives/monitor.h"
#include "collectives/topology_gather.h"
#include "collectives/watchdog.h"
#include "core/models.h"
#include "core/optim.h"
#include "core/plan.h"
#include "core/preflight.h"
#include "core/runtime.h"
#include "core/telemetry.h"
#include "hardware/host.h"
#include "hardware/topology.h"
#include "pipeline/pipeline.h"
#include "replicate/replicate.h"

namespace tetra {

using namespace tetra::core;

namespace {

TrainerOptions trainer_options(const RunOptions& options) {
  TrainerOptions t;
  t.out = options.out;
  t.model = options.model;
  t.data = options.data;
  t.on_step = options.on_step;
  return t;
}

// The collectives' health settings from the job, before any communicator exists
// (Note [Health checks], Note [Flight recorder]).
void set_up_health(const JobSpec& spec) {
  collectives::HealthOptions health = collectives::health_options();
  if (spec.collectives.check) health.check = *spec.collectives.check;
  health.stall_warning = collectives::Duration(static_cast<int64_t>(spec.collectives.stall_warning_s * 1000));
  health.timeout = collectives::Duration(static_cast<int64_t>(spec.collectives.timeout_s * 1000));
  collectives::set_health_options(health);
  if (!spec.log.dir.empty()) collectives::FlightRecorder::set_dump_dir(spec.log.dir + "/flight");
  collectives::install_flight_recorder_signals();
}

TrainResult run_in(const JobSpec& spec, const RunOptions& options, const Plan& plan,
                   const collectives::LaunchInfo& launch, const collectives::Planes& planes);

}  // namespace

TrainResult run(const JobSpec& spec, const RunOptions& options) {
  const Plan plan(spec);  // a broken composition never launches
  // SIGTERM/SIGINT from here on: finish the step, checkpoint, PreemptedError (Note [Stop requests]).
  install_stop_handlers();
  const collectives::LaunchInfo launch = collectives::detect_launch();
  // The mesh must fit the launch before any rank communicates.
  if (launch.world_size != 0)
    plan.check_world(launch.world_size,
                     launch.launcher != "single"  ? launch.launcher + ": " + launch.evidence
                     : launch.evidence.empty()    ? "a single process, no launcher"
                                                  : "a single process (" + launch.evidence + "; srun starts the ranks)");
  // Every path the job reads and writes, before anything is loaded or trained (Note [Preflight]).
  check_paths(spec, /*own_data=*/static_cast<bool>(options.data));
  set_up_health(spec);
  collectives::Planes planes;  // Note [Two planes]
  std::optional<collectives::Monitor> monitor;  // a job of several processes alone
  if (launch.multi_process()) {
    collectives::BackendRegistry backends;
    collectives::register_builtin_backends(backends);
    collectives::WorldOptions wo;
    wo.timeout = collectives::Duration(static_cast<int64_t>(spec.collectives.timeout_s * 1000));
    planes = backends.create_planes(core::backend_of(spec), launch, wo);
    // The out-of-band channel that names a dead or failed rank to the others (Note [Monitor]).
    collectives::MonitorOptions mo;
    mo.timeout = wo.timeout;
    mo.silence = collectives::Duration(static_cast<int64_t>(spec.collectives.peer_silence_s * 1000));
    monitor.emplace(*planes.host, mo);
  }
  try {
    TrainResult result = run_in(spec, options, plan, launch, planes);
    if (monitor) monitor->stop();
    return result;
  } catch (const PreemptedError&) {
    if (monitor) monitor->stop();  // every rank stops at the agreed step: a clean goodbye
    throw;
  } catch (const std::exception& e) {
    // A communication error may be the echo of a peer's death: let the monitor say so
    // (it ends this process with kExitPeerLost) before this rank reports its own failure.
    if (monitor && dynamic_cast<const CommError*>(&e)) monitor->settle(std::chrono::seconds(2));
    if (monitor) monitor->report_failure(e.what());
    throw;
  }
}

namespace {
TrainResult run_in(const JobSpec& spec, const RunOptions& options, const Plan& plan,
                   const collectives::LaunchInfo& launch, const collectives::Planes& planes) {
  const collectives::CommunicatorPtr& world = planes.data;
  const collectives::HostMap hosts = world ? collectives::gather_hosts(*planes.host) : collectives::HostMap{};
  const int threads = set_threads(spec.train.threads, plan.replicas());
  TrainerOptions topts = trainer_options(options);
  topts.world = world;
  if (world && !planes.shared()) topts.host = planes.host;
  const bool speak = launch.rank == 0;
  topts.on_start = [&](const Trainer& trainer) {
    if (!speak || !trainer.writer() || !options.out) return;
    const std::string ranks = plan.replicas() > 1 ? " x " + std::to_string(plan.replicas()) + " replica threads" : "";
    const size_t n_hosts = std::max<size_t>(1, hosts.hosts.size());
    // Where the launcher put rank 0 (tetra keeps a launcher's binding): its CPUs.
    const std::string where =
        (n_hosts == 1 ? "1 host (" + hardware::hostname() + ")" : std::to_string(n_hosts) + " hosts (" + hosts.describe() + ")") +
        (world ? ", rank 0 on cpus " + hardware::affinity_cpus() : "");
    std::fprintf(options.out, "tetra %s | job %s | %s%s, %s | backend %s | device %s | %d thread%s | %s | %s\n",
                 TETRA_VERSION, spec.name.c_str(), collectives::describe(launch).c_str(), ranks.c_str(), where.c_str(),
                 planes.describe().c_str(), trainer.device().str().c_str(), threads, threads == 1 ? "" : "s",
                 to_string(spec.train.precision).c_str(), blas_description().c_str());
    std::fprintf(options.out, "%s; model %s, %lld parameters; %lld steps\n", trainer.dataset().info().description.c_str(),
                 options.model ? "the program's own" : spec.model.type.c_str(),
                 static_cast<long long>(trainer.model_parameters()), static_cast<long long>(trainer.total_steps()));
    for (const auto& strategy : trainer.strategies())
      if (const std::string d = strategy->decision(); !d.empty()) std::fprintf(options.out, "%s\n", d.c_str());
    std::fflush(options.out);
  };
  return core::train(spec, topts);  // on the ranks the plan makes (Note [Ranks a plan makes])
}

}  // namespace

}  // namespace tetra
