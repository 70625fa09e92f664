// This machine's figures for the cost model (Note [This machine's figures] in measure.cpp):
// the job's layers timed forward and backward, the optimizer's update timed, the batch
// read timed, a local pair's link measured, and a look at how busy the machine is while
// it times them (Note [Figures with their spread]). What the pricing takes when no
// calibration file describes the cluster, or when --time-layers asks for compute timed here.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/job_spec.h"
#include "core/model_plan.h"
#include "pipeline/partition.h"
#include "tools/planner/cost_model.h"
#include "tools/planner/pricing.h"

namespace tetra::planner {

// The job's layers timed on this machine (Note [This machine's figures]): each layer's
// forward and backward on one rank's micro-batch, at the job's threads, this process
// alone.
struct LayerTimes {
  std::vector<pipeline::LayerCost> costs;
  int64_t micro = 1;  // the rows they were timed on
  int threads = 1;
  double load_s = 0;  // those rows read from the training set (Dataset::get), the best of 5
};

// How busy this machine is now (Note [Figures with their spread]).
PlanReport::Machine look_at_machine();

LayerTimes time_layers(core::ModelPlan& job, int64_t micro);

// One step of the optimizer over `owned` elements, the best of a few (a large model's
// timed on 16 Mi elements and scaled).
double time_optimizer(const core::OptimizerSpec& spec, int64_t owned);

// The calibration the dry run prices with (a file, the GPU-cluster defaults, or this
// machine measured), and whether its compute is the layers timed here (`layers` is filled
// then).
Calibration calibration_of(const DryRunOptions& how, core::ModelPlan& job, int64_t micro, bool spans_hosts,
                           std::optional<LayerTimes>& layers);

}  // namespace tetra::planner
