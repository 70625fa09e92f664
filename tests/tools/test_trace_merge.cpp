// `trace-merge` as a user runs it: per-rank traces written by core::Trace become one
// trace with a process per rank, its tracks named, its events on one clock, sorted; bad
// inputs exit 2 naming the file.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>


#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/telemetry.h"
#include "tests/tools/spawn.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::string kMerge = std::string(TETRA_BIN_DIR) + "/trace-merge";

using tetra::testing_tools::Outcome;
using tetra::testing_tools::slurp;

fs::path fresh_dir(const std::string& name) { return tetra::testing_tools::fresh_dir("tetra_trace_merge", name); }

Outcome run(const fs::path& dir, const std::vector<std::string>& args) {
  return tetra::testing_tools::run_tool(kMerge, dir, args);
}

// A rank's trace as the trainer writes it: tracks compute, data (and checkpoint on rank 0),
// times in µs from that rank's start, `shift` added to every one.
fs::path write_rank(const fs::path& dir, int rank, double shift) {
  tetra::core::Trace t;
  t.enable(rank, "job rank " + std::to_string(rank));
  t.span("data", "batch", shift + 10, shift + 20);
  t.span("compute", "forward", shift + 20, shift + 50);
  t.span("compute", "backward", shift + 50, shift + 90, json{{"step", 1}});
  t.span("data", "batch", shift + 90, shift + 95);
  if (rank == 0) t.span("checkpoint", "save", shift + 100, shift + 140);
  fs::path p = dir / ("trace.rank" + std::to_string(rank) + ".json");
  t.write(p.string());
  // The trainer's file carries its clock (clock_sync); the tests set it themselves, or
  // leave it out to exercise the align-by-earliest-event path.
  json doc = json::parse(slurp(p));
  json kept = json::array();
  bool had_sync = false;
  for (const auto& e : doc["traceEvents"]) {
    if (e.value("name", "") == "clock_sync") had_sync = true;
    else kept.push_back(e);
  }
  EXPECT_TRUE(had_sync) << "Trace::write should record its clock";
  doc["traceEvents"] = kept;
  std::ofstream(p) << doc.dump();
  return p;
}

// Adds the metadata event the trainer will write: unix µs of the file's ts=0.
void add_clock_sync(const fs::path& file, double epoch_us) {
  json doc = json::parse(slurp(file));
  doc["traceEvents"].push_back(
      {{"ph", "M"}, {"name", "clock_sync"}, {"pid", 0}, {"args", {{"epoch_us", epoch_us}}}});
  std::ofstream(file) << doc.dump();
}

struct Merged {
  json doc;
  std::map<int, std::string> process;               // pid -> process_name
  std::map<int, std::map<int, std::string>> thread;  // pid -> tid -> thread_name
  std::vector<json> timed;                           // non-metadata events, in file order
};

Merged load(const fs::path& p) {
  Merged m;
  m.doc = json::parse(slurp(p));  // throws (fails the test) when not JSON
  EXPECT_EQ(m.doc.value("displayTimeUnit", ""), "ms");
  for (const auto& e : m.doc.at("traceEvents")) {
    if (e.at("ph") == "M") {
      if (e.at("name") == "process_name") m.process[e.at("pid").get<int>()] = e.at("args").at("name");
      if (e.at("name") == "thread_name")
        m.thread[e.at("pid").get<int>()][e.at("tid").get<int>()] = e.at("args").at("name");
      EXPECT_NE(e.at("name"), "clock_sync");
    } else {
      m.timed.push_back(e);
    }
  }
  return m;
}

std::set<std::string> track_names(const Merged& m, int pid) {
  std::set<std::string> out;
  if (m.thread.count(pid))
    for (const auto& [tid, name] : m.thread.at(pid)) out.insert(name);
  return out;
}

// ts of the first event named `name` of process `pid`.
double ts_of(const Merged& m, int pid, const std::string& name) {
  for (const auto& e : m.timed)
    if (e.at("pid") == pid && e.at("name") == name) return e.at("ts").get<double>();
  ADD_FAILURE() << "no event " << name << " of pid " << pid;
  return -1;
}

void expect_sorted(const Merged& m) {
  for (size_t i = 1; i < m.timed.size(); ++i)
    EXPECT_LE(m.timed[i - 1].at("ts").get<double>(), m.timed[i].at("ts").get<double>()) << "at event " << i;
}

TEST(TraceMerge, TwoRanksOneProcessEachWithTracksSortedAlignedByEarliestEvent) {
  fs::path dir = fresh_dir("two");
  // Rank 1 started its clock "later": its events carry a different offset.
  fs::path r0 = write_rank(dir, 0, 0), r1 = write_rank(dir, 1, 1000);
  fs::path out = dir / "merged.json";
  // Rank 1 first on the command line: the pid comes from the process name, not the order.
  Outcome o = run(dir, {"-o", out.string(), r1.string(), r0.string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  EXPECT_NE(o.out.find("2 ranks"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("9 events"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("earliest event"), std::string::npos) << o.out;

  Merged m = load(out);
  EXPECT_EQ(m.timed.size(), 9u);
  std::set<int> pids;
  for (const auto& e : m.timed) pids.insert(e.at("pid").get<int>());
  EXPECT_EQ(pids, (std::set<int>{0, 1}));
  EXPECT_EQ(m.process[0], "job rank 0");
  EXPECT_EQ(m.process[1], "job rank 1");
  EXPECT_EQ(track_names(m, 0), (std::set<std::string>{"data", "compute", "checkpoint"}));
  EXPECT_EQ(track_names(m, 1), (std::set<std::string>{"data", "compute"}));
  // Each event's tid still names its track.
  for (const auto& e : m.timed) {
    const std::string track = m.thread[e.at("pid").get<int>()][e.at("tid").get<int>()];
    if (e.at("name") == "forward" || e.at("name") == "backward") {
      EXPECT_EQ(track, "compute");
    } else if (e.at("name") == "batch") {
      EXPECT_EQ(track, "data");
    }
  }
  expect_sorted(m);
  // Ranks assumed to start together: their first events coincide, gaps are kept.
  EXPECT_DOUBLE_EQ(ts_of(m, 0, "batch"), ts_of(m, 1, "batch"));
  EXPECT_DOUBLE_EQ(ts_of(m, 1, "forward") - ts_of(m, 1, "batch"), 10.0);
  // Args and durations survive.
  for (const auto& e : m.timed) {
    if (e.at("name") == "backward") {
      EXPECT_EQ(e.at("args").at("step"), 1);
      EXPECT_DOUBLE_EQ(e.at("dur").get<double>(), 40.0);
    }
  }
}

TEST(TraceMerge, ClockSyncAlignsExactly) {
  fs::path dir = fresh_dir("sync");
  fs::path r0 = write_rank(dir, 0, 0), r1 = write_rank(dir, 1, 0);
  // Rank 1's ts=0 is 5 ms after rank 0's: its events land 5000 µs later.
  add_clock_sync(r0, 1.7e15);
  add_clock_sync(r1, 1.7e15 + 5000);
  fs::path out = dir / "merged.json";
  Outcome o = run(dir, {"-o", out.string(), r0.string(), r1.string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  EXPECT_NE(o.out.find("clock_sync"), std::string::npos) << o.out;
  Merged m = load(out);
  EXPECT_DOUBLE_EQ(ts_of(m, 0, "batch"), 10.0);
  EXPECT_DOUBLE_EQ(ts_of(m, 1, "batch"), 5010.0);
  EXPECT_DOUBLE_EQ(ts_of(m, 1, "forward"), 5020.0);
  expect_sorted(m);
}

TEST(TraceMerge, FolderAndPathPrefixFindTheRankFiles) {
  fs::path dir = fresh_dir("folder");
  write_rank(dir, 0, 0);
  write_rank(dir, 1, 0);
  for (const std::string& input : {dir.string(), (dir / "trace.json").string()}) {
    fs::path out = dir / "merged.json";  // in the same folder: never read back as an input
    Outcome o = run(dir, {"-o", out.string(), input});
    ASSERT_EQ(o.status, 0) << input << "\n" << o.out << o.err;
    Merged m = load(out);
    EXPECT_EQ(m.process.size(), 2u) << input;
    EXPECT_EQ(m.timed.size(), 9u) << input;
  }
}

TEST(TraceMerge, MissingInputExits2NamingTheFile) {
  fs::path dir = fresh_dir("missing");
  fs::path r0 = write_rank(dir, 0, 0);
  const std::string missing = (dir / "no_such_rank.json").string();
  fs::path out = dir / "merged.json";
  Outcome o = run(dir, {"-o", out.string(), r0.string(), missing});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find(missing), std::string::npos) << o.err;
  EXPECT_FALSE(fs::exists(out));
}

TEST(TraceMerge, NotJsonOrNoTraceEventsExits2NamingTheFile) {
  fs::path dir = fresh_dir("bad");
  fs::path r0 = write_rank(dir, 0, 0);
  fs::path not_json = dir / "garbage.json", no_events = dir / "other.json";
  std::ofstream(not_json) << "{\"traceEvents\": [";
  std::ofstream(no_events) << "{\"loss\": 1.5}";
  for (const fs::path& bad : {not_json, no_events}) {
    Outcome o = run(dir, {"-o", (dir / "merged.json").string(), r0.string(), bad.string()});
    EXPECT_EQ(o.status, 2) << o.out << o.err;
    EXPECT_NE(o.err.find(bad.string()), std::string::npos) << o.err;
    EXPECT_EQ(o.err.find("terminate"), std::string::npos) << o.err;
  }
  Outcome o = run(dir, {r0.string()});  // no -o
  EXPECT_EQ(o.status, 2) << o.out << o.err;
}

}  // namespace
