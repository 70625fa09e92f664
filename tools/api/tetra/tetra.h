// tetra in one include, for programs built on it: #include "tetra/tetra.h" and link
// tetra::tetra (find_package(tetra CONFIG REQUIRED); README.md, "Using tetra from your own
// CMake project").
//
// Every layer's public headers, as a program spells them ("core/trainer.h"), the
// registration of the built-in strategy plugins that a job file may name, the Plan builder
// and tetra::run.
#pragma once

#include "collectives/backends.h"
#include "collectives/communicator.h"
#include "collectives/launch.h"
#include "collectives/local.h"
#include "core/data.h"
#include "core/job_spec.h"
#include "core/models.h"
#include "core/plan.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "data_parallel/data_parallel.h"
#include "hardware/topology.h"
#include "pipeline/pipeline.h"
#include "replicate/replicate.h"
#include "tensor_parallel/tensor_parallel.h"
#include "tools/planner/plugins.h"
#include "zero/zero.h"

namespace tetra {

// Registers the sections of the built-in strategy plugins (data_parallel, pipeline, zero,
// replicate, tensor) in a registry, as the train binary does (tools/planner/plugins.h).
using planner::register_builtin_plugins;

}  // namespace tetra

// The composition API (PlanBuilder) and running a job from a program (tetra::run,
// tetra::dry_run).
#include "tetra/builder.h"
#include "tetra/run.h"
