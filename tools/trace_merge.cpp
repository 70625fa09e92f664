// trace-merge — the per-rank Chrome traces of one job as one trace, one process per rank.
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
// Each input becomes one process of the output. Its pid is the rank: the N of its
// process_name "... rank N" (what core::Trace writes: enable(rank, "job rank N")), else
// the N of a file name "...rank<N>.json", else its position among the inputs. A rank
// claimed twice keeps its first file; the other gets the lowest free pid (with a
// warning, and its file name added to its process name). Thread (track) names and every other metadata event are kept, under the new
// pid; a process_sort_index orders Perfetto's groups by rank. An input with events of
// more than one pid is still one process (warned): merge per-rank files, not merges.
//
// Time. Each rank's ts counts from its own start, so each rank is shifted onto one clock:
//   - exactly, when it has a metadata event {"ph":"M","name":"clock_sync",
//     "args":{"epoch_us":E}} (E: unix time in µs of its ts=0), or a metadata event
//     whose args carry "wall_start_us" (the same meaning; clock_sync wins). The output's
//     ts=0 is the start of the earliest synced rank.
//   - otherwise by its earliest event: that event is put at the earliest event of the
//     synced ranks (at 0 when none is synced). This assumes the ranks started together;
//     the summary says which was used.
// clock_sync events are dropped from the output (its ts no longer starts at E).
//
// Output: {"traceEvents": [...], "displayTimeUnit": "ms"}: metadata first, then events
// sorted by ts (ties: by pid, longer first so enclosing spans precede, then input
// order); written atomically. Then one line on stdout: ranks, events, time span.
//
// Exit status: 0 done; 2 the command line or an input is wrong (missing, not JSON, no
// traceEvents), with the file named on stderr; 1 anything else (cannot write the output).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <glob.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/safetensors.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// An input that is wrong: exit 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- finding the inputs ---------------------------------------------------------------

// The N of "...rank<N>.json" ("trace.rank3.json", "rank3.json"); nullopt otherwise.
std::optional<long> rank_in_filename(const std::string& name) {
  static const std::regex re(R"(^(?:.*[._-])?rank(\d+)\.json$)", std::regex::icase);
  std::smatch m;
  if (!std::regex_match(name, m, re)) return std::nullopt;
  try {
    return std::stol(m[1].str());
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// Sorted by the rank in the name (rank2 before rank10), then by name.
void sort_by_rank(std::vector<fs::path>& files) {
  std::stable_sort(files.begin(), files.end(), [](const fs::path& a, const fs::path& b) {
    auto ra = rank_in_filename(a.filename().string()), rb = rank_in_filename(b.filename().string());
    long ka = ra ? *ra : std::numeric_limits<long>::max(), kb = rb ? *rb : std::numeric_limits<long>::max();
    if (ka != kb) return ka < kb;
    return a.filename().string() < b.filename().string();
  });
}

// Files in `dir` whose name passes `keep`.
std::vector<fs::path> list_dir(const fs::path& dir, bool (*keep)(const std::string&, const std::string&),
                               const std::string& stem) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code fec;
    if (!it->is_regular_file(fec)) continue;
    if (keep(it->path().filename().string(), stem)) out.push_back(it->path());
  }
  if (ec) throw InputError("cannot list " + dir.string() + ": " + ec.message());
  sort_by_rank(out);
  return out;
}

bool is_rank_file(const std::string& name, const std::string&) { return rank_in_filename(name).has_value(); }

// "<stem>.rank<N>.json"
bool is_stem_rank_file(const std::string& name, const std::string& stem) {
  const std::string head = stem + ".rank";
  if (name.size() <= head.size() + 5 || name.compare(0, head.size(), head) != 0) return false;
  if (name.compare(name.size() - 5, 5, ".json") != 0) return false;
  std::string digits = name.substr(head.size(), name.size() - head.size() - 5);
  return !digits.empty() && std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

std::vector<fs::path> expand_glob(const std::string& pattern) {
  glob_t g{};
  int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<fs::path> out;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  sort_by_rank(out);
  return out;
}

std::string key_of(const fs::path& p) {
  std::error_code ec;
  fs::path c = fs::weakly_canonical(p, ec);
  return ec ? p.lexically_normal().string() : c.string();
}

// The files the arguments name, in order, each once.
std::vector<fs::path> resolve_inputs(const std::vector<std::string>& args, const std::string& output) {
  const std::string out_key = key_of(output);
  std::vector<fs::path> files;
  std::set<std::string> seen;
  auto add = [&](const fs::path& p, bool expanded) {
    std::string k = key_of(p);
    if (expanded && k == out_key) return;
    if (seen.insert(k).second) files.push_back(p);
  };
  for (const std::string& a : args) {
    fs::path p(a);
    std::error_code ec;
    fs::file_status st = fs::status(p, ec);
    if (fs::is_directory(st)) {
      auto found = list_dir(p, is_rank_file, "");
      if (found.empty()) throw InputError(a + ": a folder with no trace files named *rank<N>.json");
      for (const auto& f : found) add(f, true);
    } else if (fs::exists(st)) {
      add(p, false);
    } else if (has_glob_chars(a)) {
      auto found = expand_glob(a);
      if (found.empty()) throw InputError(a + ": no file matches");
      for (const auto& f : found) add(f, true);
    } else {
      std::vector<fs::path> found;
      if (p.extension() == ".json") {
        fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
        std::error_code dec;
        if (fs::is_directory(dir, dec)) found = list_dir(dir, is_stem_rank_file, p.stem().string());
      }
      if (found.empty()) throw InputError("cannot read " + a + ": No such file or directory");
      for (const auto& f : found) add(p.parent_path().empty() ? f.filename() : f, true);
    }
  }
  return files;
}

// ---- reading one rank -----------------------------------------------------------------

struct Rank {
  fs::path file;
  std::vector<json> events;          // as read (objects only)
  std::optional<long> named_rank;    // from process_name "... rank N"
  std::optional<double> epoch_us;    // unix µs of ts=0
  std::string clock;                 // "clock_sync", "wall_start_us" or ""
  double earliest = std::numeric_limits<double>::infinity();
  bool has_process_name = false;
  size_t pids = 0;                   // distinct pids among its events
  size_t skipped = 0;                // entries that are not objects or lack a numeric ts
  int pid = 0;                       // in the output
  bool moved = false;                // pid is not the rank it claimed (taken by another file)
  double offset = 0;                 // added to every ts
};

bool is_meta(const json& e) { return e.value("ph", std::string()) == "M"; }

std::optional<long> rank_in_process_name(const std::string& name) {
  static const std::regex re(R"(\brank\s*#?\s*(\d+))", std::regex::icase);
  std::optional<long> last;
  for (std::sregex_iterator it(name.begin(), name.end(), re), end; it != end; ++it) {
    try {
      last = std::stol((*it)[1].str());
    } catch (const std::exception&) {
    }
  }
  return last;
}

Rank read_rank(const fs::path& file) {
  Rank r;
  r.file = file;
  std::ifstream in(file, std::ios::binary);
  if (!in) throw InputError("cannot read " + file.string() + ": No such file or not readable");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw InputError("cannot read " + file.string());
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    throw InputError(file.string() + ": not JSON (" + e.what() + ")");
  }
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array())
    throw InputError(file.string() + ": not a Chrome trace (no \"traceEvents\" array)");

  std::set<json> pids;
  std::optional<double> sync, wall;
  for (auto& e : doc["traceEvents"]) {
    if (!e.is_object()) {
      ++r.skipped;
      continue;
    }
    if (e.contains("pid")) pids.insert(e["pid"]);
    if (is_meta(e)) {
      const std::string name = e.value("name", std::string());
      const json* args = e.contains("args") && e["args"].is_object() ? &e["args"] : nullptr;
      if (name == "process_name") {
        r.has_process_name = true;
        if (args && args->contains("name") && (*args)["name"].is_string() && !r.named_rank)
          r.named_rank = rank_in_process_name((*args)["name"].get<std::string>());
      }
      if (name == "clock_sync" && args && args->contains("epoch_us") && (*args)["epoch_us"].is_number() && !sync)
        sync = (*args)["epoch_us"].get<double>();
      if (args && args->contains("wall_start_us") && (*args)["wall_start_us"].is_number() && !wall)
        wall = (*args)["wall_start_us"].get<double>();
      if (name == "clock_sync") continue;  // dropped: the output's ts=0 is not its epoch
      r.events.push_back(std::move(e));
      continue;
    }
    if (!e.contains("ts") || !e["ts"].is_number()) {
      ++r.skipped;
      continue;
    }
    r.earliest = std::min(r.earliest, e["ts"].get<double>());
    r.events.push_back(std::move(e));
  }
  r.pids = pids.size();
  if (sync) {
    r.epoch_us = sync;
    r.clock = "clock_sync";
  } else if (wall) {
    r.epoch_us = wall;
    r.clock = "wall_start_us";
  }
  return r;
}

// ---- merging --------------------------------------------------------------------------

void assign_pids(std::vector<Rank>& ranks) {
  std::vector<long> wanted(ranks.size());
  std::set<long> claimed, used;
  for (size_t i = 0; i < ranks.size(); ++i) {
    std::optional<long> n = ranks[i].named_rank;
    if (!n) n = rank_in_filename(ranks[i].file.filename().string());
    wanted[i] = n ? *n : static_cast<long>(i);
    claimed.insert(wanted[i]);
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    long pid = wanted[i];
    if (used.count(pid) || pid > std::numeric_limits<int>::max()) {
      long free = 0;
      while (used.count(free) || claimed.count(free)) ++free;
      std::fprintf(stderr, "trace-merge: warning: %s: rank %ld is already taken; shown as pid %ld\n",
                   ranks[i].file.string().c_str(), pid, free);
      pid = free;
      ranks[i].moved = true;
    }
    used.insert(pid);
    ranks[i].pid = static_cast<int>(pid);
  }
}

// Sets each rank's offset; returns how the ranks were aligned, for the summary.
std::string align(std::vector<Rank>& ranks) {
  std::optional<double> base;  // the earliest epoch among synced ranks
  for (const auto& r : ranks)
    if (r.epoch_us) base = base ? std::min(*base, *r.epoch_us) : *r.epoch_us;
  double synced_earliest = std::numeric_limits<double>::infinity();
  size_t synced = 0;
  for (auto& r : ranks) {
    if (!r.epoch_us) continue;
    ++synced;
    r.offset = *r.epoch_us - *base;
    if (std::isfinite(r.earliest)) synced_earliest = std::min(synced_earliest, r.earliest + r.offset);
  }
  const double anchor = std::isfinite(synced_earliest) ? synced_earliest : 0.0;
  for (auto& r : ranks)
    if (!r.epoch_us) r.offset = std::isfinite(r.earliest) ? anchor - r.earliest : anchor;
  if (synced == ranks.size()) {
    std::set<std::string> kinds;
    for (const auto& r : ranks) kinds.insert(r.clock);
    return kinds.size() == 1 ? "aligned by " + *kinds.begin() : "aligned by clock_sync / wall_start_us";
  }
  if (synced == 0) return "aligned by earliest event (assumes the ranks started together)";
  return "aligned by clock for " + std::to_string(synced) + " of " + std::to_string(ranks.size()) +
         " ranks, the others by earliest event";
}

struct Sorted {
  bool meta;
  double ts, dur;
  int pid;
  size_t seq;
  json event;
};

std::string human_span(double us) {
  char buf[48];
  if (us >= 1e6) std::snprintf(buf, sizeof(buf), "%.3f s", us / 1e6);
  else if (us >= 1e3) std::snprintf(buf, sizeof(buf), "%.3f ms", us / 1e3);
  else std::snprintf(buf, sizeof(buf), "%.0f us", us);
  return buf;
}

int run(const std::vector<std::string>& args, const std::string& output) {
  std::vector<fs::path> files = resolve_inputs(args, output);
  std::vector<Rank> ranks;
  ranks.reserve(files.size());
  for (const auto& f : files) ranks.push_back(read_rank(f));
  assign_pids(ranks);
  const std::string how = align(ranks);

  std::vector<Sorted> all;
  size_t seq = 0, timed = 0;
  double first = std::numeric_limits<double>::infinity(), last = -std::numeric_limits<double>::infinity();
  for (auto& r : ranks) {
    if (r.pids > 1)
      std::fprintf(stderr, "trace-merge: warning: %s has events of %zu processes; all are shown as pid %d\n",
                   r.file.string().c_str(), r.pids, r.pid);
    if (r.skipped)
      std::fprintf(stderr, "trace-merge: warning: %s: skipped %zu entries that are not events with a numeric ts\n",
                   r.file.string().c_str(), r.skipped);
    const std::string label = "rank " + std::to_string(r.pid) + " (" + r.file.filename().string() + ")";
    if (!r.has_process_name)
      all.push_back({true, 0, 0, r.pid, seq++,
                     json{{"ph", "M"}, {"name", "process_name"}, {"pid", r.pid}, {"args", {{"name", label}}}}});
    all.push_back({true, 0, 0, r.pid, seq++,
                   json{{"ph", "M"}, {"name", "process_sort_index"}, {"pid", r.pid}, {"args", {{"sort_index", r.pid}}}}});
    for (auto& e : r.events) {
      e["pid"] = r.pid;
      if (is_meta(e)) {
        const std::string name = e.value("name", std::string());
        if (name == "process_sort_index") continue;  // ours orders by rank
        if (name == "process_name" && r.moved && e.contains("args") && e["args"].is_object() &&
            e["args"].contains("name") && e["args"]["name"].is_string())
          e["args"]["name"] = e["args"]["name"].get<std::string>() + " [" + r.file.filename().string() + "]";
        all.push_back({true, 0, 0, r.pid, seq++, std::move(e)});
        continue;
      }
      double ts = e["ts"].get<double>() + r.offset;
      double dur = e.contains("dur") && e["dur"].is_number() ? e["dur"].get<double>() : 0.0;
      e["ts"] = ts;
      first = std::min(first, ts);
      last = std::max(last, ts + std::max(dur, 0.0));
      ++timed;
      all.push_back({false, ts, dur, r.pid, seq++, std::move(e)});
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const Sorted& a, const Sorted& b) {
    if (a.meta != b.meta) return a.meta;
    if (a.meta) return a.pid < b.pid;  // then input order (stable)
    if (a.ts != b.ts) return a.ts < b.ts;
    if (a.pid != b.pid) return a.pid < b.pid;
    if (a.dur != b.dur) return a.dur > b.dur;
    return a.seq < b.seq;
  });

  json events = json::array();
  for (auto& s : all) events.push_back(std::move(s.event));
  json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  tetra::core::write_file_atomic(output, doc.dump() + "\n");

  std::string pids;
  std::vector<int> sorted_pids;
  for (const auto& r : ranks) sorted_pids.push_back(r.pid);
  std::sort(sorted_pids.begin(), sorted_pids.end());
  for (size_t i = 0; i < sorted_pids.size() && i < 8; ++i) pids += (i ? "," : "") + std::to_string(sorted_pids[i]);
  if (sorted_pids.size() > 8) pids += ",...";
  const double span = timed ? last - first : 0.0;
  std::printf("trace-merge: %zu rank%s (%s), %zu events, span %s, %s -> %s\n", ranks.size(), ranks.size() == 1 ? "" : "s", pids.c_str(), timed,
              human_span(span).c_str(), how.c_str(), output.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trace-merge: the per-rank Chrome traces of a job as one trace, one process per rank",
               "trace-merge"};
  std::string output;
  std::vector<std::string> inputs;
  app.add_option("-o,--output", output, "the merged trace (JSON) to write")->required();
  app.add_option("inputs", inputs,
                 "trace files, folders (their *rank<N>.json), globs, or a missing X.json (its X.rank<N>.json)")
      ->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    return run(inputs, output);
  } catch (const InputError& e) {
    std::fprintf(stderr, "trace-merge: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trace-merge: %s\n", e.what());
    return 1;
  } catch (...) {
    std::fprintf(stderr, "trace-merge: unknown error\n");
    return 1;
  }
}
