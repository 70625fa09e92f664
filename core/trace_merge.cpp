#include "core/trace_merge.h"

#include <glob.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "collectives/error.h"

namespace tetra::core {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// ---- finding the inputs ---------------------------------------------------------------

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
    long ka = ra ? *ra : std::numeric_limits<long>::max(),
         kb = rb ? *rb : std::numeric_limits<long>::max();
    if (ka != kb) return ka < kb;
    return a.filename().string() < b.filename().string();
  });
}

// Files in `dir` whose name passes `keep`.
std::vector<fs::path> list_dir(const fs::path& dir,
                               bool (*keep)(const std::string&, const std::string&),
                               const std::string& stem) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code fec;
    if (!it->is_regular_file(fec)) continue;
    if (keep(it->path().filename().string(), stem)) out.push_back(it->path());
  }
  if (ec) throw ConfigError("cannot list " + dir.string() + ": " + ec.message());
  sort_by_rank(out);
  return out;
}

bool is_rank_file(const std::string& name, const std::string&) {
  return rank_in_filename(name).has_value();
}

// "<stem>.rank<N>.json"
bool is_stem_rank_file(const std::string& name, const std::string& stem) {
  const std::string head = stem + ".rank";
  if (name.size() <= head.size() + 5 || name.compare(0, head.size(), head) != 0) return false;
  if (name.compare(name.size() - 5, 5, ".json") != 0) return false;
  std::string digits = name.substr(head.size(), name.size() - head.size() - 5);
  return !digits.empty() &&
         std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
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

// ---- reading one rank -----------------------------------------------------------------

struct Rank {
  fs::path file;
  std::vector<json> events;        // as read (objects only)
  std::optional<long> named_rank;  // from process_name "... rank N"
  std::optional<double> epoch_us;  // unix µs of ts=0
  std::string clock;               // "clock_sync", "wall_start_us" or ""
  double earliest = std::numeric_limits<double>::infinity();
  bool has_process_name = false;
  size_t pids = 0;     // distinct pids among its events
  size_t skipped = 0;  // entries that are not objects or lack a numeric ts
  int pid = 0;         // in the output
  bool moved = false;  // pid is not the rank it claimed (taken by another file)
  double offset = 0;   // added to every ts
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
  if (!in) throw ConfigError("cannot read " + file.string() + ": No such file or not readable");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw ConfigError("cannot read " + file.string());
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    throw ConfigError(file.string() + ": not JSON (" + e.what() + ")");
  }
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array())
    throw ConfigError(file.string() + ": not a Chrome trace (no \"traceEvents\" array)");

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
      if (name == "clock_sync" && args && args->contains("epoch_us") &&
          (*args)["epoch_us"].is_number() && !sync)
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

void assign_pids(std::vector<Rank>& ranks, std::vector<std::string>& warnings) {
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
      warnings.push_back(ranks[i].file.string() + ": rank " + std::to_string(pid) +
                         " is already taken; shown as pid " + std::to_string(free));
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
    if (std::isfinite(r.earliest))
      synced_earliest = std::min(synced_earliest, r.earliest + r.offset);
  }
  const double anchor = std::isfinite(synced_earliest) ? synced_earliest : 0.0;
  for (auto& r : ranks)
    if (!r.epoch_us) r.offset = std::isfinite(r.earliest) ? anchor - r.earliest : anchor;
  if (synced == ranks.size()) {
    std::set<std::string> kinds;
    for (const auto& r : ranks) kinds.insert(r.clock);
    return kinds.size() == 1 ? "aligned by " + *kinds.begin()
                             : "aligned by clock_sync / wall_start_us";
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

}  // namespace

long rank_in_trace_filename(const std::string& name) { return rank_in_filename(name).value_or(-1); }

std::string rank_trace_file(const std::string& trace, int rank) {
  const std::filesystem::path p(trace);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) + p.extension().string())).string();
}

std::vector<std::string> find_trace_files(const std::vector<std::string>& inputs,
                                          const std::string& exclude) {
  const std::string out_key = exclude.empty() ? std::string() : key_of(exclude);
  std::vector<std::string> files;
  std::set<std::string> seen;
  auto add = [&](const fs::path& p, bool expanded) {
    std::string k = key_of(p);
    if (expanded && k == out_key) return;
    if (seen.insert(k).second) files.push_back(p.string());
  };
  for (const std::string& a : inputs) {
    fs::path p(a);
    std::error_code ec;
    fs::file_status st = fs::status(p, ec);
    if (fs::is_directory(st)) {
      auto found = list_dir(p, is_rank_file, "");
      if (found.empty())
        throw ConfigError(a + ": a folder with no trace files named *rank<N>.json");
      for (const auto& f : found) add(f, true);
    } else if (fs::exists(st)) {
      add(p, false);
    } else if (has_glob_chars(a)) {
      auto found = expand_glob(a);
      if (found.empty()) throw ConfigError(a + ": no file matches");
      for (const auto& f : found) add(f, true);
    } else {
      std::vector<fs::path> found;
      if (p.extension() == ".json") {
        fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
        std::error_code dec;
        if (fs::is_directory(dir, dec)) found = list_dir(dir, is_stem_rank_file, p.stem().string());
      }
      if (found.empty()) throw ConfigError("cannot read " + a + ": No such file or directory");
      for (const auto& f : found) add(p.parent_path().empty() ? f.filename() : f, true);
    }
  }
  return files;
}

MergedTrace merge_traces(const std::vector<std::string>& files) {
  std::vector<Rank> ranks;
  ranks.reserve(files.size());
  for (const auto& f : files) ranks.push_back(read_rank(f));
  MergedTrace m;
  assign_pids(ranks, m.warnings);
  m.alignment = align(ranks);

  std::vector<Sorted> all;
  size_t seq = 0;
  double first = std::numeric_limits<double>::infinity(),
         last = -std::numeric_limits<double>::infinity();
  for (auto& r : ranks) {
    m.pids.push_back(r.pid);
    if (r.pids > 1)
      m.warnings.push_back(r.file.string() + " has events of " + std::to_string(r.pids) +
                           " processes; all are shown as pid " + std::to_string(r.pid));
    if (r.skipped)
      m.warnings.push_back(r.file.string() + ": skipped " + std::to_string(r.skipped) +
                           " entries that are not events with a numeric ts");
    const std::string label =
        "rank " + std::to_string(r.pid) + " (" + r.file.filename().string() + ")";
    if (!r.has_process_name)
      all.push_back({true, 0, 0, r.pid, seq++,
                     json{{"ph", "M"},
                          {"name", "process_name"},
                          {"pid", r.pid},
                          {"args", {{"name", label}}}}});
    all.push_back({true, 0, 0, r.pid, seq++,
                   json{{"ph", "M"},
                        {"name", "process_sort_index"},
                        {"pid", r.pid},
                        {"args", {{"sort_index", r.pid}}}}});
    for (auto& e : r.events) {
      e["pid"] = r.pid;
      if (is_meta(e)) {
        const std::string name = e.value("name", std::string());
        if (name == "process_sort_index") continue;  // ours orders by rank
        if (name == "process_name" && r.moved && e.contains("args") && e["args"].is_object() &&
            e["args"].contains("name") && e["args"]["name"].is_string())
          e["args"]["name"] =
              e["args"]["name"].get<std::string>() + " [" + r.file.filename().string() + "]";
        all.push_back({true, 0, 0, r.pid, seq++, std::move(e)});
        continue;
      }
      double ts = e["ts"].get<double>() + r.offset;
      double dur = e.contains("dur") && e["dur"].is_number() ? e["dur"].get<double>() : 0.0;
      e["ts"] = ts;
      first = std::min(first, ts);
      last = std::max(last, ts + std::max(dur, 0.0));
      ++m.timed_events;
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
  m.doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  if (m.timed_events) {
    m.first_us = first;
    m.last_us = last;
  }
  return m;
}

}  // namespace tetra::core
