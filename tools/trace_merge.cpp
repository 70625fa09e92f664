// trace-merge — the per-rank Chrome traces of a job as one trace, one process per rank.
//
//   trace-merge -o merged.json INPUT...
//
// INPUT is any of:
//   a trace file             runs/job/trace.rank0.json
//   a folder                 runs/job          -> its files named *rank<N>.json (e.g.
//                                                 trace.rank0.json, trace.rank1.json)
//   a glob (quoted or not)   'runs/job/trace.rank*.json'
//   a missing X.json         runs/job/trace.json -> X.rank<N>.json beside it, when there
//                                                 is no file X.json itself
// A file reached twice is read once; a folder, glob or prefix never picks up the output.
//
// How ranks become processes and how their clocks are lined up: Note [Merging traces] in
// core/trace_merge.h (the code `report` cuts pipeline steps out of traces with). The
// output is written atomically; then one line on stdout: ranks, events, time span.
//
// Exit status: 0 done; 2 the command line or an input is wrong (missing, not JSON, no
// traceEvents), with the file named on stderr; 1 anything else (cannot write the output).
#include "core/trace_merge.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "collectives/error.h"
#include "core/safetensors.h"

namespace {

std::string human_span(double us) {
  char buf[48];
  if (us >= 1e6)
    std::snprintf(buf, sizeof(buf), "%.3f s", us / 1e6);
  else if (us >= 1e3)
    std::snprintf(buf, sizeof(buf), "%.3f ms", us / 1e3);
  else
    std::snprintf(buf, sizeof(buf), "%.0f us", us);
  return buf;
}

int run(const std::vector<std::string>& args, const std::string& output) {
  const tetra::core::MergedTrace m =
      tetra::core::merge_traces(tetra::core::find_trace_files(args, output));
  for (const std::string& w : m.warnings)
    std::fprintf(stderr, "trace-merge: warning: %s\n", w.c_str());
  tetra::core::write_file_atomic(output, m.doc.dump() + "\n");

  std::vector<int> sorted_pids = m.pids;
  std::sort(sorted_pids.begin(), sorted_pids.end());
  std::string pids;
  for (size_t i = 0; i < sorted_pids.size() && i < 8; ++i)
    pids += (i ? "," : "") + std::to_string(sorted_pids[i]);
  if (sorted_pids.size() > 8) pids += ",...";
  std::printf("trace-merge: %zu rank%s (%s), %zu events, span %s, %s -> %s\n", m.pids.size(),
              m.pids.size() == 1 ? "" : "s", pids.c_str(), m.timed_events,
              human_span(m.last_us - m.first_us).c_str(), m.alignment.c_str(), output.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "trace-merge: the per-rank Chrome traces of a job as one trace, one process per rank",
      "trace-merge"};
  std::string output;
  std::vector<std::string> inputs;
  app.add_option("-o,--output", output, "the merged trace (JSON) to write")->required();
  app.add_option("inputs", inputs,
                 "trace files, folders (their *rank<N>.json), globs, or a missing X.json (its "
                 "X.rank<N>.json)")
      ->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    return run(inputs, output);
  } catch (const std::exception& e) {  // a ConfigError names an input that is wrong: 2
    std::fprintf(stderr, "trace-merge: %s\n", e.what());
    return dynamic_cast<const tetra::ConfigError*>(&e) ? 2 : 1;
  } catch (...) {
    std::fprintf(stderr, "trace-merge: unknown error\n");
    return 1;
  }
}
