// The tuner behind `train JOB --tune` (tools/planner/tune.h, Note [Tuner]): every layout
// and knob the job's ranks allow, priced by the cost model, the best few measured in
// short trials, and the fastest written out as a complete job.
//
//   tetra::TuneOptions o;
//   o.job = "job.yaml";
//   o.np = 4;
//   o.dry_run = true;                       // on paper; trials need a TuneHooks::launcher
//   tetra::TuneResult r = tetra::tune(o);   // progress on o.progress; the job in r.written
#pragma once

#include "tools/planner/tune.h"

namespace tetra {

using planner::Candidate;
using planner::Launched;
using planner::TrialLauncher;
using planner::TuneHooks;
using planner::TuneOptions;
using planner::TuneResult;
using planner::corrected_step;
using planner::enumerate_candidates;
using planner::prune_by_memory;
using planner::rank_correlation;
using planner::to_string;
using planner::trial_order;
using planner::tune;

}  // namespace tetra
