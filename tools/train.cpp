// train — runs a tetra job spec.
//
//   train JOB.yaml [--set key=value]... [--check | --print-config | --dry-run]
//   train --schema        the JSON Schema of job files
//   train --list-keys     every key and choice, for shell completion (tools/completion/train.bash)
//   train --help-env      the environment variables tetra reads (hardware/env.cpp)
//
// Exit status (collectives/error.h, README "Exit status"): 0 done; 1 the run failed (the
// message says why); 2 the job, a file it names or the command line is wrong (every
// problem is printed, compiler-style); 3 another rank died or failed; 4 preempted: a
// SIGTERM or SIGINT stopped every rank after a step whose checkpoint all of them wrote —
// run the same command again to resume. A second signal exits at once (128 + signal, or 4
// once that checkpoint is on disk).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "collectives/backends.h"
#include "collectives/build_config.h"
#include "collectives/error.h"
#include "collectives/launch.h"
#include "collectives/mpi.h"
#include "core/job_file.h"
#include "core/resume.h"
#include "core/job_spec.h"
#include "core/model_plan.h"
#include "core/preflight.h"
#include "core/runtime.h"
#include "core/telemetry.h"
#include "core/trace_merge.h"
#include "core/trainer.h"
#include "hardware/env.h"
#include "hardware/host.h"
#include "hardware/topology.h"
#include "tetra/run.h"
#include "tetra/tetra.h"
#include "tetra/tune.h"
#include "tools/trials/launcher.h"

namespace {

using namespace tetra;
using namespace tetra::core;
using hardware::ByteDigits;
using hardware::format_bytes;

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
  std::printf("  peak memory  %s\n", format_bytes(hardware::peak_rss_bytes(), ByteDigits::kWhole).c_str());
  std::printf("  model state  %s on rank 0: parameters %s, gradients %s, optimizer %s, buffers %s\n",
              format_bytes(r.memory.total(), ByteDigits::kWhole).c_str(),
              format_bytes(r.memory.parameters, ByteDigits::kWhole).c_str(),
              format_bytes(r.memory.gradients, ByteDigits::kWhole).c_str(),
              format_bytes(r.memory.optimizer, ByteDigits::kWhole).c_str(),
              format_bytes(r.memory.buffers, ByteDigits::kWhole).c_str());
  if (!r.checkpoint.empty()) std::printf("  checkpoint   %s\n", r.checkpoint.c_str());
  if (!spec.checkpoint.safetensors.empty())
    std::printf("  weights      %s (safetensors)\n", spec.checkpoint.safetensors.c_str());
  if (!spec.log.metrics.empty()) std::printf("  metrics      %s\n", spec.log.metrics.c_str());
  if (!spec.log.trace.empty()) {
    // Several ranks write one trace each, t.rank<N>.json beside t.json (which then does
    // not exist): name what is there (issue 33, item 7).
    const std::string rank0 = rank_trace_file(spec.log.trace, 0);
    std::error_code ec;
    if (!std::filesystem::exists(spec.log.trace, ec) && std::filesystem::exists(rank0, ec))
      std::printf("  trace        %s, one per rank (`trace-merge -o %s %s` joins them)\n", rank0.c_str(),
                  spec.log.trace.c_str(), spec.log.trace.c_str());
    else
      std::printf("  trace        %s\n", spec.log.trace.c_str());
  }
  if (!spec.log.dir.empty())
    std::printf("  run folder   %s (`report %s` draws it as one page)\n", spec.log.dir.c_str(), spec.log.dir.c_str());
}

int train_main(int argc, char** argv);

}  // namespace

int main(int argc, char** argv) {
  const int code = train_main(argc, argv);
  // A rank that fails must exit, not wait in MPI_Finalize for ranks that wait for it:
  // mpirun then ends the job (collectives/mpi.h). A preempted run ends on every rank at
  // the same step, and finalises as a finished one does.
  if (code != 0 && code != kExitPreempted) tetra::collectives::mpi_exit_without_finalize();
  return code;
}

namespace {

int train_main(int argc, char** argv) {
  tetra::core::prepare_process(argc, argv);

  CLI::App app{"train: runs a tetra job spec (YAML)", "train"};
  std::string job;
  std::vector<std::string> sets;
  bool check = false, print_config = false, dry_run = false, json = false, schema = false, list_keys = false;
  bool help_env = false;
  int np = 0, ranks_per_host = 0;
  std::string calibration;
  bool time_layers = false;
  bool tune = false;
  tetra::TuneOptions tuning;
  std::string trial_launcher;  // --launcher: the trials' launch (tools/trials)
  app.add_option("job", job, "the job file (YAML)")->group("Run");
  app.add_option("--set", sets, "override a key, e.g. --set optimizer.lr=3e-4 (repeatable)")
      ->group("Run")
      ->type_size(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_flag("--check", check, "validate the job and exit (0 valid, 2 not)")->group("Check and plan");
  app.add_flag("--print-config", print_config, "print the resolved job with every default, and exit")
      ->group("Check and plan");
  app.add_flag("--dry-run", dry_run, "build the plan (data, model, batch, memory, a predicted step) and exit")
      ->group("Check and plan");
  app.add_option("--np", np, "with --dry-run: the processes the job will be launched on (default: this launch's, "
                             "else the mesh's); checks the mesh fits and lays out every rank")
      ->group("Check and plan")
      ->check(CLI::PositiveNumber);
  app.add_option("--ranks-per-host", ranks_per_host,
                 "with --dry-run: processes per host (default: this launch's local ranks, else all on this host); "
                 "shows which axes stay inside a host")
      ->group("Check and plan")
      ->check(CLI::PositiveNumber);
  app.add_option("--calibration", calibration,
                 "with --dry-run: the links and compute rate the cost model predicts a step with: a file from "
                 "bench-collectives --calibrate, or gpu-cluster (an A100-class cluster's); default: "
                 "$TETRA_CALIBRATION, else this machine's, measured")
      ->group("Check and plan");
  app.add_flag("--time-layers", time_layers,
               "with --dry-run --calibration FILE: price compute by timing the job's layers and optimizer on this "
               "machine (as without a file), not by the file's FLOP rate")
      ->group("Check and plan");
  app.add_flag("--tune", tune,
               "search the layouts (data, pipeline, tensor, replicas) and knobs (ZeRO stage, micro-batches and "
               "schedule, buckets, hierarchy, threads) of --np processes with the cost model, measure the best few in "
               "short trials under mpirun, and write the fastest as a complete job (-o); with --dry-run on paper only")
      ->group("Tune");
  app.add_option("--memory-gb", tuning.memory_gb,
                 "with --tune: the memory a process may use; candidates whose estimate exceeds it are dropped "
                 "(default: this host's memory shared by its processes; on cuda the device's)")
      ->group("Tune")
      ->check(CLI::PositiveNumber);
  app.add_option("--budget", tuning.budget_s, "with --tune: seconds for the whole search, the best so far at the end")
      ->group("Tune")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("-o,--output", tuning.output, "with --tune: the chosen job's file (default: JOB-tuned.yaml beside JOB)")
      ->group("Tune");
  app.add_option("--trials", tuning.trials, "with --tune: how many of the best predicted to measure (besides the job "
                                            "as given)")
      ->group("Tune")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--trial-steps", tuning.trial_steps, "with --tune: measured steps per trial, after 5 of warm-up")
      ->group("Tune")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--launcher", trial_launcher,
                 "with --tune: what starts a trial's processes, before `train JOB` ({np} is replaced by --np); default "
                 "mpirun -np N --oversubscribe --bind-to none (srun --mpi=pmix -n N inside a Slurm allocation)")
      ->group("Tune");
  app.add_flag("--json", json, "with --dry-run: the plan as one JSON object (for tools)")->group("Check and plan");
  app.add_flag("--list-keys", list_keys,
               "print every key a job file takes (a.b.c), and each choice's words (a.b.c=word), one a line, "
               "and exit: what the bash completion offers after --set")
      ->group("For editors and shells");
  app.add_flag("--schema", schema,
               "print the JSON Schema of job files (for editors: the YAML language server's "
               "`# yaml-language-server: $schema=FILE`) and exit; needs no job")
      ->group("For editors and shells");
  app.add_flag("--help-env", help_env,
               "print the environment variables tetra reads, its own and other tools', with their types, defaults "
               "and what they do, and exit");
  app.set_version_flag("--version", [] {
    std::string v = std::string("train (tetra ") + TETRA_VERSION;
    if (*TETRA_GIT_COMMIT) v += std::string(", commit ") + TETRA_GIT_COMMIT;
    v += std::string(", ") + (*TETRA_BUILD_TYPE ? TETRA_BUILD_TYPE : "no build type") + " build)\n";
    v += "LibTorch " + std::string(TORCH_VERSION) + "\nbackends:";
    tetra::collectives::BackendRegistry backends;
    tetra::collectives::register_builtin_backends(backends);
    for (const std::string& name : backends.names()) {
      const auto& e = backends.at(name);
      const std::string why = e.unavailable();
      v += "\n  " + name + ": " + e.description + (why.empty() ? "" : " (not usable here: " + why + ")");
    }
    return v;
  });
  app.footer(
      "Examples:\n"
      "  train configs/quickstart.yaml                          one process\n"
      "  train job.yaml --set optimizer.lr=3e-4 --set train.max_steps=100\n"
      "  train job.yaml --dry-run --np 512 --ranks-per-host 8   the plan and a predicted step at 512 ranks\n"
      "  train job.yaml --tune --np 2 -o tuned.yaml             the fastest layout of 2 processes, measured\n"
      "  mpirun -np 4 train configs/dp.yaml                     4 processes (Open MPI)\n"
      "  srun --mpi=pmix train job.yaml                         a Slurm step\n"
      "  torchrun --nproc_per_node 2 -r 1 -t 1 --no_python train job.yaml --set collectives.backend=gloo\n"
      "                                                         (-r 1 -t 1: Debian's torchrun 1.13 needs them)\n"
      "  train --schema > tetra.schema.json                     for editors\n\n"
      "Exit status: 0 done; 1 the run failed; 2 the job, a file or the command line is wrong; 3 another rank "
             "died or failed; 4 preempted (SIGTERM/SIGINT: every rank finished its step and wrote its checkpoint; run "
             "the same command again to resume; a second signal exits at once). Under mpirun, signal the ranks rather than "
             "mpirun (README \"Faults\").");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  if (help_env) {  // Note [Knobs declared once]
    std::printf("%s", tetra::env::help_text().c_str());
    return 0;
  }
  // The plan's options without --dry-run: a user who typed --np wanted that many
  // processes, which only a launcher starts.
  const bool tune_only = tuning.memory_gb > 0 || !tuning.output.empty() || !trial_launcher.empty();
  if (tune_only && !tune) {
    std::fprintf(stderr, "train: error: --memory-gb, -o and --launcher are options of --tune\n");
    return 2;
  }
  if (tune && (json || time_layers || check || print_config)) {
    std::fprintf(stderr, "train: error: --tune does not take %s\n",
                 json ? "--json" : time_layers ? "--time-layers (it times the layers itself)" : check ? "--check" : "--print-config");
    return 2;
  }
  if (!dry_run && !tune && (np > 0 || ranks_per_host > 0 || !calibration.empty() || json || time_layers)) {
    const std::string option = np > 0                  ? "--np"
                               : ranks_per_host > 0    ? "--ranks-per-host"
                               : !calibration.empty()  ? "--calibration"
                               : time_layers           ? "--time-layers"
                                                       : "--json";
    std::fprintf(stderr, "train: error: %s is an option of --dry-run (it plans the job for that launch, and runs nothing)",
                 option.c_str());
    if (np > 0)
      std::fprintf(stderr,
                   "; to run on %d processes, launch them: mpirun -np %d train %s (srun -n %d train ..., or "
                   "torchrun --nproc_per_node %d -r 1 -t 1 --no_python train ... --set collectives.backend=gloo)",
                   np, np, job.empty() ? "JOB" : job.c_str(), np, np);
    std::fprintf(stderr, "\n");
    return 2;
  }

  if (schema || list_keys) {
    SectionRegistry plugins;
    tetra::register_builtin_plugins(plugins);
    const nlohmann::json s = tetra::core::job_schema(plugins);
    if (schema) {
      std::printf("%s\n", s.dump(2).c_str());
      return 0;
    }
    // Depth first, in the schema's (alphabetical) order.
    std::function<void(const nlohmann::json&, const std::string&)> walk = [&](const nlohmann::json& n,
                                                                               const std::string& path) {
      if (n.contains("properties")) {
        for (const auto& [k, child] : n["properties"].items()) walk(child, path.empty() ? k : path + "." + k);
        return;
      }
      std::printf("%s\n", path.c_str());
      // The words of a choice; its null (`key: ~`, the default) is no word to complete.
      auto words = [&](const nlohmann::json& alt) {
        if (alt.contains("enum"))
          for (const auto& w : alt["enum"])
            if (w.is_string()) std::printf("%s=%s\n", path.c_str(), w.get<std::string>().c_str());
      };
      words(n);
      if (n.contains("anyOf"))
        for (const auto& alt : n["anyOf"]) words(alt);
    };
    walk(s, "");
    return 0;
  }
  if (job.empty()) {
    std::fprintf(stderr, "train: a job file is required: train JOB.yaml [--set key=value]... (--help for more)\n");
    return 2;
  }

  // Every rank reads the same job: its mistakes are printed once, by rank 0.
  bool speak = true;
  try {
    const collectives::LaunchInfo launch = collectives::detect_launch();
    speak = launch.rank == 0;
    SectionRegistry plugins;  // the built-in strategy plugins, registered explicitly
    tetra::register_builtin_plugins(plugins);
    // Note [Auto axis]: the world an auto mesh axis fills is --np's for a plan or a tuning,
    // else the launch's.
    const JobWorld world = (dry_run || tune) && np > 0 ? JobWorld{np, "--np " + std::to_string(np)} : launch_world();
    ParsedJob parsed = parse_job_file(job, sets, plugins, world);
    JobSpec& spec = parsed.spec;
    if (tune) {
      tuning.job = job;
      tuning.sets = sets;
      tuning.np = np > 0 ? np : 1;
      tuning.ranks_per_host = ranks_per_host;
      tuning.calibration = calibration;
      tuning.dry_run = dry_run;
      if (np == 0)
        std::fprintf(stderr, "train: --tune without --np: tuning for 1 process (--np N for the processes the job will run on)\n");
      tetra::trials::ProcessLauncher launcher(tuning.np, trial_launcher);
      tetra::TuneHooks hooks;
      hooks.launcher = &launcher;
      const tetra::TuneResult r = tetra::tune(tuning, hooks);
      std::printf("\n== %s: tuned for %d process%s in %s ==\n", spec.name.c_str(), tuning.np, tuning.np == 1 ? "" : "es",
                  human_duration(r.seconds).c_str());
      std::printf("%s", r.table().c_str());
      const tetra::Candidate& c = r.candidates[static_cast<size_t>(r.chosen)];
      std::printf("chosen: %s\nwritten: %s (run it: %s)\n", c.label.c_str(), r.written.c_str(),
                  tuning.np > 1 ? ("mpirun -np " + std::to_string(tuning.np) + " train " + r.written).c_str()
                                : ("train " + r.written).c_str());
      return 0;
    }
    if (check) {
      // What would fail later fails here (Note [Preflight]): the paths, the data read and
      // the model built (as shapes: nothing is allocated), room for a checkpoint.
      check_paths(spec);
      // A checkpoint the job names is read whole (each file's size and CRC-32C) by the
      // run's own resume decision, so that a damaged one is found here (exit 2).
      if (spec.checkpoint.resume != "auto" && spec.checkpoint.resume != "never")
        choose_checkpoint(spec.checkpoint, nullptr);
      ModelPlan model(spec);
      model.check();
      if (const std::string problem = space_problem(spec, model.parameters()); !problem.empty())
        throw ConfigError(problem);
      std::printf("%s: ok (%s; model %lld parameters%s)\n", job.c_str(), model.dataset().info().description.c_str(),
                  static_cast<long long>(model.parameters()),
                  spec.checkpoint.dir.empty()
                      ? ""
                      : ("; a checkpoint about " +
                         format_bytes(checkpoint_bytes(spec, model.parameters()), ByteDigits::kWhole) + " in " +
                         spec.checkpoint.dir)
                            .c_str());
      return 0;
    }
    if (print_config) {
      std::printf("%s", resolved_yaml(parsed.resolved).c_str());
      if (parsed.resolved["log"] && parsed.resolved["log"]["dir"] && parsed.resolved["log"]["dir"].IsNull())
        std::printf("# log.dir ~ (unset) follows the name: this run's folder is %s\n", spec.log.dir.c_str());
      // The strategies the job leaves out, with their defaults, as comments: written as
      // keys, a section turns its strategy on.
      if (parsed.left_out.IsMap() && parsed.left_out.size() > 0) {
        std::printf("# Left out of this job, with the defaults its section would take (a section turns its strategy on):\n");
        std::istringstream lines(resolved_yaml(parsed.left_out));
        for (std::string line; std::getline(lines, line);) std::printf("# %s\n", line.c_str());
      }
      return 0;
    }
    if (dry_run) {  // the plan, on one process, whatever the mesh: nothing communicates
      tetra::DryRunOptions how;
      how.np = np;
      how.ranks_per_host = ranks_per_host;
      how.json = json;
      how.calibration = calibration;
      how.time_layers = time_layers;
      const std::string plan = tetra::dry_run(spec, {}, how);
      if (speak) std::printf("%s", plan.c_str());
      return 0;
    }
    const TrainResult r = tetra::run(spec);
    if (speak) {
      if (!r.nothing_to_train.empty())
        std::printf("%s\n", r.nothing_to_train.c_str());  // Note [A finished run stays]: nothing written
      else
        print_summary(spec, r);
    }
    return 0;
  } catch (const tetra::PreemptedError& e) {
    // Every rank stopped at the same step; rank 0 says where it can resume.
    std::fflush(stdout);
    if (speak)
      std::fprintf(stderr, "train: %s%s\n", e.what(),
                   e.checkpoint().empty() ? "" : "; run the same command again to resume");
    return quiet_exit(speak, kExitPreempted);
  } catch (const tetra::PeerLostError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\ntrain: error: %s\n", e.what());
    return kExitPeerLost;
  } catch (const tetra::ConfigError& e) {
    std::fflush(stdout);
    std::string msg = e.what();
    if (!msg.empty() && msg.back() == '\n') msg.pop_back();
    // A job file's errors say where ("job.yaml:3:5: error: ..."); the others (the mesh
    // against the world, a checkpoint's shapes) get the prefix every other error has.
    // Several problems (the paths, Note [Preflight]) come a line each: each line gets it.
    if (msg.find(": error: ") == std::string::npos && msg.rfind("error: ", 0) != 0) {
      std::string prefixed;
      for (size_t at = 0, nl; at <= msg.size(); at = nl + 1) {
        nl = msg.find('\n', at);
        if (nl == std::string::npos) nl = msg.size();
        prefixed += (at ? "\n" : "") + std::string("train: error: ") + msg.substr(at, nl - at);
      }
      msg = prefixed;
    }
    if (speak) std::fprintf(stderr, "%s\n", msg.c_str());
    return quiet_exit(speak, kExitUserError);
  } catch (const tetra::DataError& e) {
    std::fflush(stdout);
    if (speak) std::fprintf(stderr, "train: error: %s\n", e.what());
    return quiet_exit(speak, kExitUserError);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\ntrain: error: %s\n", e.what());
    return kExitFailed;
  }
}

}  // namespace
