// The built-in strategy plugins, for the parts of tetra that read job files of any
// layout: the planner (the tuner parses its candidates), the public API and the tools.
#pragma once

#include "core/job_spec.h"

namespace tetra::planner {

// Registers the sections of the built-in strategy plugins (data_parallel, pipeline, zero,
// replicate, tensor) in `registry`, as the train binary does. Registration is explicit: core
// names no plugin, and static registrar objects would be dropped from the static libraries.
void register_builtin_plugins(core::SectionRegistry& registry);

// A registry of the built-in plugins, built on first use and kept.
const core::SectionRegistry& builtin_plugins();

}  // namespace tetra::planner
