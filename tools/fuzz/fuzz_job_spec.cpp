// fuzz-job-spec — libFuzzer harness for the job-spec parser and `--set` overrides.
//
// An input is a job file and its overrides: the text up to a line that is exactly
// "#@set" is the YAML (a comment to YAML, so every configs/*.yaml is a seed as it is),
// each line after it one `--set` assignment. Both go to parse_job_string, the entry
// point `train` reaches through parse_job_file, with the built-in plugins registered as
// `train` registers them. Parsing reads no data file: it parses, validates and checks
// the plan's rules (Plan::issues) on the spec alone.
//
// A tetra::ConfigError is the expected answer to a bad input. A finding is anything else:
// a crash, ASan/UBSan report, leak, hang (-timeout), an exception other than ConfigError
// escaping, or a ConfigError that an exception became only in parse_job_string's last
// resort (guarded(): "fuzz.yaml: error: ..." with no line), which means some getter let a
// yaml-cpp or standard-library exception through instead of a diagnostic at its key.
// Every finding becomes a test in tests/core/test_config.cpp.
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "collectives/error.h"
#include "core/job_file.h"
#include "core/job_spec.h"
#include "tetra/tetra.h"

namespace {

const tetra::core::SectionRegistry& registry() {
  static const tetra::core::SectionRegistry* plugins = [] {
    auto* r = new tetra::core::SectionRegistry;
    tetra::register_builtin_plugins(*r);
    return r;
  }();
  return *plugins;
}

// parse_job_string's last resort (guarded() in core/job_spec.cpp) turns any exception that
// got past the getters into "fuzz.yaml: error: <what()>". A diagnostic without a line
// reads the same way but its message is one of the file-level ones below or starts with
// the dotted key it is about ("data.batch_size: ..."); what() of a yaml-cpp or standard
// exception ("bad conversion", "map::at", "stoll", "yaml-cpp: error at ...") is neither.
bool escaped(const std::string& what) {
  static const std::string kPrefix = "fuzz.yaml: error: ";
  if (what.rfind(kPrefix, 0) != 0) return false;
  const std::string msg = what.substr(kPrefix.size());
  for (const char* known : {"job file is empty", "invalid YAML", "a job file holds", "cannot read job file",
                            "the job file is not UTF-8 text"})
    if (msg.rfind(known, 0) == 0) return false;
  size_t i = 0;
  while (i < msg.size() && (std::isalnum(static_cast<unsigned char>(msg[i])) || msg[i] == '_' ||
                            msg[i] == '.' || msg[i] == '[' || msg[i] == ']'))
    ++i;
  const bool key_path = i > 0 && msg.compare(i, 2, ": ") == 0;
  return !key_path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  static const std::string kSeparator = "\n#@set\n";
  std::string yaml = input;
  std::vector<std::string> overrides;
  const size_t cut = input.find(kSeparator);
  if (cut != std::string::npos) {
    yaml = input.substr(0, cut + 1);
    size_t at = cut + kSeparator.size();
    while (at <= input.size()) {
      size_t end = input.find('\n', at);
      if (end == std::string::npos) end = input.size();
      if (end > at) overrides.push_back(input.substr(at, end - at));
      at = end + 1;
    }
  }
  try {
    (void)tetra::core::parse_job_string(yaml, "fuzz.yaml", overrides, registry());
  } catch (const tetra::ConfigError& e) {
    if (escaped(e.what())) {
      std::fprintf(stderr, "fuzz-job-spec: an exception escaped the diagnostics: %s\n", e.what());
      std::abort();
    }
  }
  return 0;
}
