// A job for an in-process test: no run folder unless the job or its sets name one.
#pragma once

#include <string>
#include <vector>

#include "core/job_file.h"
#include "core/job_spec.h"

namespace tetra::numerics {

// log.dir "" unless the job or its sets set it: the tests' runs share a name (and, in one
// process, a working folder), and a finished run is never trained over (Note [A finished
// run stays], core/trainer.cpp), so each keeps its records where its sets say.
inline core::JobSpec job_without_run_folder(const std::string& yaml, const std::string& name,
                                            std::vector<std::string> sets, const core::SectionRegistry& plugins) {
  core::ParsedJob parsed = core::parse_job_string(yaml, name, sets, plugins);
  if (!parsed.resolved["log"]["dir"].IsNull()) return parsed.spec;
  sets.insert(sets.begin(), "log.dir=");
  return core::parse_job_string(yaml, name, sets, plugins).spec;
}

}  // namespace tetra::numerics
