// The pricing of a plan: what `train --dry-run` works out and prints (the composition, the
// batch equation, each strategy's plan, every rank's place, the per-rank estimate and the
// cost model's step), as data (PlanReport) and for many variants of one job at once
// (JobPricer, the tuner's). Part of the planner (tools/planner/): above the plugins,
// whose plans it prices, and below the tools; tetra/run.h gives it to programs as
// tetra::dry_run, tetra::plan_report and tetra::JobPricer.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "collectives/topology_gather.h"
#include "core/data.h"
#include "core/job_spec.h"
#include "core/plan.h"
#include "core/strategy_config.h"
#include "tools/planner/cost_model.h"

namespace tetra::planner {

// Where the model and the data of a plan come from: the program's own (the C++ API's
// tetra::RunOptions carries them), or, left empty, the job's model.* and data.* sections.
struct ModelSource {
  // The program's own model, built from the job's seed (TrainerOptions::model).
  std::function<torch::nn::Sequential(const core::DataInfo&)> model;
  // The program's own data (its methods are const).
  std::shared_ptr<const core::Dataset> data;
};

// What `train --dry-run` prints: the composition, the batch equation, each strategy's plan
// (stages, schedule, memory) and every rank's place. `np`: the processes the job will be
// launched on (0: the launch this runs in, else the mesh's); a mesh that does not fit them
// is a ConfigError. `json`: one JSON object instead of text. Builds the data and the model
// on this process and never communicates.
std::string dry_run(const core::JobSpec& spec, const ModelSource& options = {}, int np = 0, bool json = false);

// The same, with where the processes will run: `ranks_per_host` consecutive processes
// share a host (0: the launch's local ranks when this runs under a launcher, else every
// process on this host). The plan then says which axes stay inside a host.
// The plan ends with the cost model's prediction of a step (Note [Cost model] in
// tools/planner/cost_model.h) on the links and compute rate of `calibration` (a file that
// `bench-collectives --calibrate` writes; "": the environment's TETRA_CALIBRATION, else
// the built-in defaults of a GPU cluster).
struct DryRunOptions {
  int np = 0;
  int ranks_per_host = 0;
  bool json = false;
  std::string calibration;
  // With a calibration file: price compute by timing the job's layers and optimizer here
  // (as without a file) instead of the file's FLOP rate; for a file measured on machines
  // like this one (Note [This machine's figures]).
  bool time_layers = false;
  // How many times this machine's compute is timed when it is (Note [Figures with their
  // spread]): the median round is the prediction, the others its spread. A caller that
  // wants only the estimate's bytes (report) asks for 1.
  int timing_rounds = 3;
};
std::string dry_run(const core::JobSpec& spec, const ModelSource& options, const DryRunOptions& how);

// How the data groups of `plan` (process groups, one host per process in `hosts`) lie for
// a hierarchical allreduce, by core::hierarchical_fits on each group's own map, as each
// group decides at attach: data_parallel.hierarchical auto reduces hierarchically in the
// groups that fit and flat in the others; on stops the run with a ConfigError unless
// every group fits. The cost model prices by it, and the tuner offers no "on" that would
// stop.
struct DataGroupFit {
  int fit = 0;           // the same number (> 1) of its ranks on each of several hosts
  int unfit_across = 0;  // across hosts, unevenly or one rank a host
  int one_host = 0;      // inside one host
  std::string first_unfit;  // the first group that does not fit, as HostMap::describe says where it runs
};
DataGroupFit data_group_fit(const core::Plan& plan, const collectives::HostMap& hosts);

// Where one rank of the plan runs: its process, replica thread and host (processes
// numbered host by host), its coordinate on each axis of the process mesh, its threads
// and the CPUs it is pinned to ("" = not pinned, and why).
struct RankPlace {
  int rank = 0, process = 0, replica = 0, host = 0;
  std::vector<int> coords;
  int threads = 1;
  std::string cpus;
  std::string why;
};

// What the dry run works out, as data: dry_run renders it as text (train --dry-run) or
// JSON (--json), and a tool that needs a part of it (report's memory chart: `estimates`)
// reads the part instead of parsing either.
struct PlanReport {
  explicit PlanReport(core::Plan p) : plan(std::move(p)) {}
  core::Plan plan;              // the composition, the mesh, the batch equation
  std::string data;             // the data's description
  std::string model;            // the model's type, or "the program's own"
  int64_t parameters = 0;
  std::string model_text;       // its layers, one line each
  std::string strategies_text;  // each active strategy's lines (StrategyConfig::plan)
  int64_t steps = 0;
  int threads = 1;              // intra-op threads per rank
  int per_host = 1;             // processes per host
  collectives::HostMap host_map;  // each process's host: per_host consecutive ones a host (Note [One host map])
  std::vector<RankPlace> ranks;
  std::vector<core::RankEstimate> estimates;  // per process rank: memory, traffic
  Calibration calibration;
  StepPrediction prediction;            // the cost model's step (Note [Cost model])
  // Note [Figures with their spread] (measure.cpp): the predicted samples/s of each round of
  // this machine's compute timed (prediction is the median round's; empty when compute
  // was not timed here), and how busy the machine was while it timed them.
  std::vector<double> rounds_samples_per_s;
  struct Machine {
    double load = 0;         // /proc/loadavg's 1-minute load
    int cores = 1;           // usable by this process
    int others_running = 0;  // other processes runnable at the moment it looked
    bool busy = false;
  } machine;
  int hosts() const;
  // With data_parallel.hierarchical on, where a data group does not fit these hosts: the
  // run's ConfigError at attach, as a warning ("" otherwise, and on one host, where a dry
  // run does not know the launch's hosts).
  std::string hierarchy_warning() const;
  std::string text() const;
  nlohmann::json json() const;
};
PlanReport plan_report(const core::JobSpec& spec, const ModelSource& options = {}, const DryRunOptions& how = {});

// Prices many variants of one job (the tuner's candidates: tetra/tune.h) as plan_report
// does, without building again what they share: the model's shapes and its probe (once
// per tensor degree), the layers' timings (once per micro-batch size, threads and tensor
// degree) and the calibration (once). Every spec it is given must be the same job (model,
// data, precision) under other layouts and knobs. The report's text fields are left
// empty; its plan, ranks, estimates, calibration and prediction are what plan_report
// finds.
class JobPricer {
 public:
  JobPricer(const ModelSource& options, const DryRunOptions& how);
  ~JobPricer();
  JobPricer(const JobPricer&) = delete;
  JobPricer& operator=(const JobPricer&) = delete;
  // Throws tetra::ConfigError when the plan does not fit how.np, or a strategy's rule on
  // the model's shapes (a pipeline stage's memory_gb, a tensor split) fails: what `train
  // --check` would say of the spec.
  PlanReport price(const core::JobSpec& spec);
  const Calibration* calibration() const;  // once the first spec is priced

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tetra::planner
