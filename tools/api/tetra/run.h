// Running a job, and printing its plan, the way `train` does — for programs that bring
// their own model and data.
//
//   core::JobSpec job = tetra::PlanBuilder("mine").mesh({2, 2}).zero({1}).build();
//   tetra::RunOptions run;
//   run.model = [](const core::DataInfo& data) { return my_model(data); };
//   run.data = std::make_shared<MyDataset>(...);
//   std::cout << tetra::dry_run(job, run);          // what train --dry-run prints
//   core::TrainResult r = tetra::run(job, run);     // alone, or under mpirun / srun
//
// run() is what `train JOB.yaml` does after parsing: it finds the launcher (mpirun, srun,
// or none), checks that the mesh fits the world before anything communicates, builds the
// world over collectives.backend, starts the replica threads of `replicate` and trains.
// It installs SIGTERM and SIGINT handlers for the process (core/runtime.h, Note [Stop
// requests]): the first such signal to any rank makes every rank finish its step, write
// that step's checkpoint and throw tetra::PreemptedError, which run() lets through (exit
// with tetra::kExitPreempted, 4; running the job again resumes it); a second exits at once.
#pragma once

#include <torch/torch.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/data.h"
#include "core/job_spec.h"
#include "core/plan.h"
#include "core/strategy_config.h"
#include "core/trainer.h"
#include "tools/planner/pricing.h"

namespace tetra {

// model: the program's own model, built on every rank from the job's seed
// (TrainerOptions::model); nullptr: the job's model.* section. data: the program's own
// data, shared by a process's replicas (its methods are const); nullptr: the job's data.*
// section (planner::ModelSource, which the plan on paper takes too).
struct RunOptions : planner::ModelSource {
  std::FILE* out = stdout;  // the banner and progress, from rank 0
  // After each step, on every rank (and replica) with (step, loss); a step skipped under
  // train.on_nonfinite: skip reports its non-finite loss.
  std::function<void(int64_t, double)> on_step;
};

// The plan on paper (tools/planner/pricing.h): what `train --dry-run` prints and works
// out, for a program's own model and data as for the job's.
using planner::DryRunOptions;
using planner::JobPricer;
using planner::PlanReport;
using planner::RankPlace;
using planner::dry_run;
using planner::plan_report;

// Trains the job in the launch this process runs in and returns this process's result
// (its first replica's). Collective over the launch: every process calls it with the same
// job. A job that does not fit the launch is a ConfigError before anything communicates.
core::TrainResult run(const core::JobSpec& spec, const RunOptions& options = {});

}  // namespace tetra
