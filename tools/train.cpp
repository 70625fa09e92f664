// train — runs a tetra job spec.
//
//   train JOB.yaml [--set key=value]... [--check | --print-config | --dry-run]
//
// Exit status: 0 done; 2 the job, a file it names or the command line is wrong (every
// problem is printed, compiler-style); 1 the run failed (the message says why).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "collectives/backends.h"
#include "collectives/error.h"
#include "collectives/launch.h"
#include "core/job_spec.h"
#include "core/models.h"
#include "core/plan.h"
#include "core/report.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "data_parallel/data_parallel.h"
#include "pipeline/pipeline.h"
#include "replicate/replicate.h"
#include "zero/zero.h"
#include "hardware/host.h"
#include "hardware/topology.h"

namespace {

using namespace tetra;
using namespace tetra::core;

// Distinct hosts among the world's ranks (an allgather of a hash of each hostname).
int count_hosts(collectives::Communicator& world) {
  at::Tensor mine = at::full({1}, static_cast<int64_t>(std::hash<std::string>{}(hardware::hostname()) >> 1), at::kLong);
  at::Tensor all = at::empty({world.size()}, at::kLong);
  world.allgather(mine, all)->wait();
  std::vector<int64_t> v(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel());
  std::sort(v.begin(), v.end());
  return static_cast<int>(std::unique(v.begin(), v.end()) - v.begin());
}

// Every rank finds the same mistake in the job; rank 0 says it. The others wait a
// moment before exiting, since a launcher tears the whole job down at the first
// non-zero exit, which could otherwise cut rank 0 off before its message is out.
int quiet_exit(bool speak, int code) {
  if (!speak) std::this_thread::sleep_for(std::chrono::seconds(2));
  return code;
}

void print_summary(const JobSpec& spec, const TrainResult& r) {
  std::printf("\n== %s: done ==\n", spec.name.c_str());
  std::printf("  steps        %lld this run (%lld in all)\n", static_cast<long long>(r.steps),
              static_cast<long long>(r.final_step));
  std::printf("  time         %s (training %s)\n", human_duration(r.total_seconds).c_str(),
              human_duration(r.train_seconds).c_str());
  std::printf("  throughput   %.0f samples/s\n", r.samples_per_s);
  std::printf("  final loss   %.4f\n", r.final_loss);
  if (r.final_eval) {
    std::printf("  test loss    %.4f\n", r.final_eval->test_loss);
    if (r.final_eval->perplexity)
      std::printf("  perplexity   %.3f\n", *r.final_eval->perplexity);
    else if (r.final_eval->accuracy)
      std::printf("  accuracy     %.2f%% final, %.2f%% best\n", 100 * *r.final_eval->accuracy,
                  100 * r.best_accuracy.value_or(*r.final_eval->accuracy));
  }
  std::printf("  peak memory  %s\n", human_bytes(hardware::peak_rss_bytes()).c_str());
  std::printf("  model state  %s on rank 0: parameters %s, gradients %s, optimizer %s, buffers %s\n",
              human_bytes(r.memory.total()).c_str(), human_bytes(r.memory.parameters).c_str(),
              human_bytes(r.memory.gradients).c_str(), human_bytes(r.memory.optimizer).c_str(),
              human_bytes(r.memory.buffers).c_str());
  if (!r.checkpoint.empty()) std::printf("  checkpoint   %s\n", r.checkpoint.c_str());
  if (!spec.checkpoint.safetensors.empty())
    std::printf("  weights      %s (safetensors)\n", spec.checkpoint.safetensors.c_str());
  if (!spec.log.metrics.empty()) std::printf("  metrics      %s\n", spec.log.metrics.c_str());
  if (!spec.log.trace.empty()) std::printf("  trace        %s\n", spec.log.trace.c_str());
}

// Rank -> (pipeline, data, replica) and where it runs, for --dry-run with a world size.
// Every process is taken to run on this host (the one --dry-run runs on) unless a
// launcher says how many share it.
struct RankRow {
  int rank, process, replica;
  std::vector<int> coords;  // per axis of the process mesh
  int threads;
  std::string cpus;  // "" = not pinned
  std::string why;
};

std::vector<RankRow> rank_rows(const Plan& plan, int local_processes) {
  const MeshLayout layout(plan.processes());
  const int R = plan.replicas();
  std::vector<replicate::Placement> where =
      R > 1 ? replicate::place_replicas(R, plan.spec().train.threads, local_processes)
            : std::vector<replicate::Placement>(1);
  if (R == 1) {
    where[0].threads = plan.spec().train.threads > 0 ? plan.spec().train.threads
                                                     : std::max(1, hardware::usable_cores() / local_processes);
    where[0].why = "one rank per process, placed by the launcher (mpirun --bind-to)";
  }
  std::vector<RankRow> rows;
  for (int p = 0; p < plan.process_count(); ++p)
    for (int r = 0; r < R; ++r) {
      const replicate::Placement& w = where[static_cast<size_t>(r)];
      rows.push_back({p * R + r, p, r, layout.coords(p), w.threads,
                      w.cpus.empty() ? "" : hardware::format_cpu_list(w.cpus), w.why});
    }
  return rows;
}

std::string rank_table(const Plan& plan, const std::vector<RankRow>& rows) {
  std::string out = "ranks      " + std::to_string(rows.size()) + " (" + std::to_string(plan.process_count()) +
                    " process" + (plan.process_count() == 1 ? "" : "es") +
                    (plan.replicas() > 1 ? " x " + std::to_string(plan.replicas()) + " replicas" : std::string()) +
                    ") on " + hardware::hostname() + "\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-5s %-8s %-9s %-5s %-8s %-8s %s\n", "rank", "process", "pipeline", "data",
                "replica", "threads", "cpus");
  out += line;
  const auto& axes = plan.processes().axes;
  for (const RankRow& r : rows) {
    auto coord = [&](const std::string& axis) {
      for (size_t i = 0; i < axes.size(); ++i)
        if (axes[i].name == axis) return r.coords[i];
      return 0;
    };
    std::snprintf(line, sizeof line, "  %-5d %-8d %-9d %-5d %-8d %-8d %s\n", r.rank, r.process, coord("pipeline"),
                  coord("data"), r.replica, r.threads, r.cpus.empty() ? ("not pinned: " + r.why).c_str() : r.cpus.c_str());
    out += line;
  }
  return out;
}

nlohmann::json plan_json(const Trainer& trainer, const std::vector<RankRow>& rows) {
  const Plan& plan = trainer.job_plan();
  nlohmann::json j;
  j["job"] = plan.spec().name;
  j["processes"] = plan.process_count();
  j["replicas_per_process"] = plan.replicas();
  j["mesh"] = nlohmann::json::object();
  for (const std::string& axis : kAxisOrder) j["mesh"][axis] = plan.processes().size(axis);
  j["mesh"]["replica"] = plan.replicas();
  j["batch"] = {{"global", plan.spec().data.batch_size}, {"data_ranks", plan.data_ranks()},
                {"micro_batches", plan.micro_batches()}, {"micro_batch_size", plan.micro_batch_size()}};
  j["steps"] = trainer.total_steps();
  j["parameters"] = trainer.model_parameters();
  j["composition"] = nlohmann::json::array();
  for (const PlanStep& s : plan.composition())
    j["composition"].push_back({{"section", s.section}, {"axis", s.role.axis}, {"active", s.active},
                                {"what", s.active ? s.role.why : s.note}});
  j["ranks"] = nlohmann::json::array();
  const auto& axes = plan.processes().axes;
  for (const RankRow& r : rows) {
    nlohmann::json row = {{"rank", r.rank}, {"process", r.process}, {"replica", r.replica}, {"threads", r.threads}};
    for (size_t i = 0; i < axes.size(); ++i) row[axes[i].name] = r.coords[i];
    if (!r.cpus.empty()) row["cpus"] = r.cpus;
    if (r.cpus.empty()) row["not_pinned"] = r.why;
    j["ranks"].push_back(row);
  }
  return j;
}

void print_plan(const Trainer& trainer, int threads) {
  Trainer& t = const_cast<Trainer&>(trainer);
  const Plan& plan = trainer.job_plan();
  const JobSpec& spec = plan.spec();
  const auto& info = trainer.dataset().info();
  const int64_t params = parameter_count(*t.model());
  const int64_t state_per_param = spec.optimizer.type == "sgd" ? (spec.optimizer.momentum > 0 ? 1 : 0) : 2;
  std::printf("job        %s (%s)\n", spec.name.c_str(), spec.source.c_str());
  const int world = plan.process_count(), R = plan.replicas();
  const std::string per_rank = std::to_string(threads) + " intra-op thread" + (threads == 1 ? "" : "s");
  if (world == 1 && R == 1)
    std::printf("world      1 process, %s\n", per_rank.c_str());
  else if (world == 1)
    std::printf("world      1 process x %d replica threads, %s each\n", R, per_rank.c_str());
  else
    std::printf("world      mesh %s = %d processes (launch with mpirun -np %d)%s, %s each\n", spec.mesh.str().c_str(), world,
                world, R > 1 ? (" x " + std::to_string(R) + " replica threads").c_str() : "", per_rank.c_str());
  std::printf("data       %s\n", info.description.c_str());
  std::printf("batch      %s\n", plan.batch_equation().c_str());
  std::printf("steps      %lld (%s)\n", static_cast<long long>(trainer.total_steps()),
              spec.train.max_steps ? "train.max_steps" : "train.epochs x steps per epoch");
  std::printf("model      %s, %lld parameters\n%s", spec.model.type.c_str(),
              static_cast<long long>(params), describe(t.model()).c_str());
  const int64_t bytes = params * 4;
  std::printf("memory     parameters %s + gradients %s + optimizer state %s = %s (fp32, whole model, no sharding)\n",
              human_bytes(bytes).c_str(), human_bytes(bytes).c_str(),
              human_bytes(bytes * state_per_param).c_str(),
              human_bytes(bytes * (2 + state_per_param)).c_str());
  std::printf("%s", plan.describe_composition().c_str());
  std::printf("%s", t.plan().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  tetra::core::prepare_process(argc, argv);

  CLI::App app{"train: runs a tetra job spec (YAML)", "train"};
  std::string job;
  std::vector<std::string> sets;
  bool check = false, print_config = false, dry_run = false, json = false;
  int np = 0;
  app.add_option("job", job, "the job file (YAML)")->required();
  app.add_option("--set", sets, "override a key, e.g. --set optimizer.lr=3e-4 (repeatable)")
      ->type_size(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_flag("--check", check, "validate the job and exit (0 valid, 2 not)");
  app.add_flag("--print-config", print_config, "print the resolved job with every default, and exit");
  app.add_flag("--dry-run", dry_run, "build the plan (data, model, batch, memory) and exit");
  app.add_option("--np", np, "with --dry-run: the processes the job will be launched on (default: this launch's, "
                             "else the mesh's); checks the mesh fits and lays out every rank")
      ->check(CLI::PositiveNumber);
  app.add_flag("--json", json, "with --dry-run: the plan as one JSON object (for tools)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  // Every rank reads the same job: its mistakes are printed once, by rank 0.
  bool speak = true;
  try {
    const collectives::LaunchInfo launch = collectives::detect_launch();
    speak = launch.rank == 0;
    SectionRegistry plugins;  // the built-in strategy plugins, registered explicitly
    data_parallel::register_data_parallel(plugins);
    pipeline::register_pipeline(plugins);
    zero::register_zero(plugins);
    replicate::register_replicate(plugins);
    ParsedJob parsed = parse_job_file(job, sets, plugins);
    JobSpec& spec = parsed.spec;
    if (check) {
      std::printf("%s: ok\n", job.c_str());
      return 0;
    }
    if (print_config) {
      std::printf("%s", resolved_yaml(parsed.resolved).c_str());
      return 0;
    }
    if (dry_run) {  // the plan, on one process, whatever the mesh: nothing communicates
      TrainerOptions topts;
      topts.dry_run = true;
      Trainer trainer(spec, topts);
      const int threads = set_threads(spec.train.threads, trainer.job_plan().replicas());
      const Plan& plan = trainer.job_plan();
      // The world the plan is for: --np, else the launch this runs in, else the mesh's.
      const int world_size = np > 0 ? np : launch.multi_process() ? launch.world_size : 0;
      if (world_size > 0)
        plan.check_world(world_size, np > 0 ? "--np " + std::to_string(np) : launch.launcher + ": " + launch.evidence);
      const int local = np > 0 ? np : launch.multi_process() ? std::max(1, launch.local_world_size) : plan.process_count();
      const std::vector<RankRow> rows = rank_rows(plan, local);
      if (speak && json) {
        std::printf("%s\n", plan_json(trainer, rows).dump(2).c_str());
      } else if (speak) {
        print_plan(trainer, threads);
        std::printf("%s", rank_table(plan, rows).c_str());
      }
      return 0;
    }
    // The mesh must fit the launch before any rank communicates.
    if (launch.world_size != 0)
      check_mesh_fits(spec.mesh, launch.world_size,
                      launch.launcher == "single" ? "a single process, no launcher" : launch.launcher + ": " + launch.evidence);
    collectives::CommunicatorPtr world;
    if (launch.multi_process()) {
      collectives::BackendRegistry backends;
      collectives::register_builtin_backends(backends);
      collectives::WorldOptions wo;
      wo.timeout = collectives::Duration(static_cast<int64_t>(spec.collectives.timeout_s * 1000));
      world = backends.create_world(spec.collectives.backend, launch, wo);
    }
    const int hosts = world ? count_hosts(*world) : 1;
    const int threads = set_threads(spec.train.threads);
    TrainerOptions topts;
    topts.world = world;
    Trainer trainer(spec, topts);
    if (speak)
      std::printf("tetra %s | job %s | %s, %d host%s (rank 0 on %s) | backend %s | device cpu | %d thread%s | %s | %s\n",
                "0.1.0", spec.name.c_str(), collectives::describe(launch).c_str(), hosts, hosts == 1 ? "" : "s",
                hardware::hostname().c_str(),
                world ? world->backend().c_str() : "none", threads, threads == 1 ? "" : "s",
                spec.train.precision.c_str(), blas_description().c_str());
    if (speak)
      std::printf("%s; model %s, %lld parameters; %lld steps\n",
                trainer.dataset().info().description.c_str(), spec.model.type.c_str(),
                static_cast<long long>(trainer.model_parameters()),
                static_cast<long long>(trainer.total_steps()));
    std::fflush(stdout);
    TrainResult r = trainer.run();
    if (speak) print_summary(spec, r);
    return 0;
  } catch (const tetra::ConfigError& e) {
    std::fflush(stdout);
    std::string msg = e.what();
    if (!msg.empty() && msg.back() == '\n') msg.pop_back();
    if (speak) std::fprintf(stderr, "%s\n", msg.c_str());
    return quiet_exit(speak, 2);
  } catch (const tetra::DataError& e) {
    std::fflush(stdout);
    if (speak) std::fprintf(stderr, "train: error: %s\n", e.what());
    return quiet_exit(speak, 2);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\ntrain: error: %s\n", e.what());
    return 1;
  }
}
