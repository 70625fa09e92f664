// Reading a job: the spec (core/job_spec.h) parsed and every rule checked, the plan's
// composition rules (core/plan.h) among them, each error at its line.
//
// Above both: a plan is built from a spec, and a job is only read once the plan's rules
// hold, so the spec's reader takes those rules from here (core::read_job) rather than the
// spec naming the plan.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "core/job_spec.h"

namespace tetra::core {

// Parses a job file, applies the `--set` overrides, validates every section and the
// cross-field rules. Throws tetra::ConfigError carrying every diagnostic at once.
ParsedJob parse_job_file(const std::string& path, const std::vector<std::string>& overrides,
                         const SectionRegistry& plugins, const JobWorld& world = launch_world());
// `origin_of_line`, for a document a program wrote: names the call that wrote each line,
// which the diagnostics then carry instead of name:line:col (the C++ Plan builder).
ParsedJob parse_job_string(const std::string& yaml, const std::string& name,
                           const std::vector<std::string>& overrides,
                           const SectionRegistry& plugins,
                           const std::function<std::string(int line)>& origin_of_line = {},
                           const JobWorld& world = launch_world());

// The JSON Schema (draft-07) of a job file, made from what the parsers read (Note
// [Schema] in core/config.h): the job is parsed with every word of every choice in turn
// (model.type: mlp, cnn, gpt; ...), until no choice has a word left, and each key read
// becomes a property with its type, bounds, words and default; a mapping takes no other
// keys. `train --schema` prints it, for editors (the YAML language server).
nlohmann::json job_schema(const SectionRegistry& plugins);

}  // namespace tetra::core
