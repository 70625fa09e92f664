// The per-rank Chrome traces of one job (core::Trace's files) as one trace on one clock:
// what `trace-merge` writes for Perfetto and what `report` cuts a pipeline step out of.
//
// Note [Merging traces]: each input becomes one process of the output. Its pid is the
// rank: the N of its process_name "... rank N" (what core::Trace writes: enable(rank,
// "job rank N")), else the N of a file name "...rank<N>.json", else its position among
// the inputs. A rank claimed twice keeps its first file; the other gets the lowest free
// pid (with a warning, and its file name added to its process name). Thread (track)
// names and every other metadata event are kept, under the new pid; a
// process_sort_index orders Perfetto's groups by rank. An input with events of more than
// one pid is still one process (warned): merge per-rank files, not merges.
//
// Time. Each rank's ts counts from its own start, so each rank is shifted onto one clock:
//   - exactly, when it has a metadata event {"ph":"M","name":"clock_sync",
//     "args":{"epoch_us":E}} (E: unix time in µs of its ts=0), or a metadata event
//     whose args carry "wall_start_us" (the same meaning; clock_sync wins). The output's
//     ts=0 is the start of the earliest synced rank.
//   - otherwise by its earliest event: that event is put at the earliest event of the
//     synced ranks (at 0 when none is synced). This assumes the ranks started together;
//     MergedTrace::alignment says which was used.
// clock_sync events are dropped from the output (its ts no longer starts at E).
//
// Output: {"traceEvents": [...], "displayTimeUnit": "ms"}: metadata first, then events
// sorted by ts (ties: by pid, longer first so enclosing spans precede, then input order).
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tetra::core {

// The trace files `inputs` name, in order, each once. An input is any of:
//   a trace file             runs/job/trace.rank0.json
//   a folder                 runs/job          -> its files named *rank<N>.json
//   a glob                   'runs/job/trace.rank*.json'
//   a missing X.json         runs/job/trace.json -> X.rank<N>.json beside it
// Files a folder, glob or prefix finds are sorted by rank (rank2 before rank10) and never
// include `exclude` (the output of a merge). Throws tetra::ConfigError naming an input
// that finds nothing.
std::vector<std::string> find_trace_files(const std::vector<std::string>& inputs,
                                          const std::string& exclude = "");

// The N of a file name "...rank<N>.json" ("trace.rank3.json", "rank3.json"); -1 if none.
long rank_in_trace_filename(const std::string& name);

// The file `rank` writes when every rank of a job writes its own trace: trace.json ->
// trace.rank<N>.json beside it (what the trainer writes and a missing X.json finds).
std::string rank_trace_file(const std::string& trace, int rank);

struct MergedTrace {
  nlohmann::json doc;                 // {"traceEvents": [...], "displayTimeUnit": "ms"}
  std::vector<int> pids;              // the pid each input became, in input order
  std::vector<std::string> warnings;  // one line each, naming the file: what was guessed or dropped
  std::string alignment;              // how the clocks were lined up, for a summary line
  size_t timed_events = 0;            // events other than metadata
  double first_us = 0, last_us = 0;   // the span they cover on the merged clock
};

// Note [Merging traces]. Throws tetra::ConfigError naming a file that cannot be read or
// is not a Chrome trace.
MergedTrace merge_traces(const std::vector<std::string>& files);

}  // namespace tetra::core
