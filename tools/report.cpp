// report — one self-contained HTML page about a training run: what it was, how the loss,
// evaluation, learning rate, throughput and gradient norm went, where each step's time
// went, memory per rank against the plan's estimate, and one pipeline step per rank.
//
//   report RUN_DIR [-o OUT.html] [--png OUT.png] [--step N] [--no-estimate]
//
// RUN_DIR is the job's log.dir (runs/<name>/ by default). It reads, each when present:
//   summary.json    rank 0 writes it when the run ends (a killed run has none: the page
//                   says so and draws what the other files give). It names the metrics
//                   and trace files; without it they are RUN_DIR/metrics.jsonl and
//                   RUN_DIR/trace*.json.
//   metrics.jsonl   one record per line: train, eval, checkpoint failures (Note [Resumed
//                   runs] in core/run_folder.cpp for a file a resumed run appended to).
// The files are read by core/run_folder.h (read_run_folder): the records arrive as types,
// and no key of theirs is spelled here.
//   job.yaml        the resolved job: shown as it is, and `train --dry-run`'s per-rank
//                   estimate is worked out from it (--no-estimate skips that: it builds
//                   the model and reads the data).
//   traces          per-rank Chrome traces (log.trace), merged onto one clock as
//                   trace-merge does (core/trace_merge.h); a step is cut out of them for
//                   the pipeline timeline (Note [Pipeline step]).
// The charts are SVG drawn by tools/chart/chart.h: the page has no script and fetches nothing.
// --png composes every chart into one SVG and converts it with rsvg-convert (Debian's
// librsvg2-bin).
//
// Prints one line: what it wrote, its size, the sections drawn and those missing.
// Exit status: 0 written; 2 the input is wrong (RUN_DIR missing, no metrics, a line
// that is not JSON: named as file:line; --step not in the traces; no rsvg-convert for
// --png); 1 anything else (the page cannot be written).
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "collectives/error.h"
#include "tools/chart/chart.h"
#include "core/job_file.h"
#include "core/job_spec.h"
#include "core/run_folder.h"
#include "core/safetensors.h"
#include "core/telemetry.h"
#include "core/text.h"
#include "core/trace_merge.h"
#include "hardware/env.h"
#include "hardware/topology.h"
#include "pipeline/schedule.h"
#include "tetra/run.h"
#include "tetra/tetra.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
namespace chart = tetra::chart;
using chart::Unit;
using nlohmann::json;
using tetra::ConfigError;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// j[key] as a number; NaN when j is not an object or the key is missing, null or not a number.
// (A Chrome trace's events: the run folder's records are core/run_folder.h's types.)
double number(const json& j, const char* key) {
  if (!j.is_object()) return kNaN;
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : kNaN;
}

const json& member(const json& j, const char* key) {
  static const json none;
  if (!j.is_object()) return none;
  const auto it = j.find(key);
  return it != j.end() ? *it : none;
}

std::string text_of(const json& j, const char* key) {
  const json& v = member(j, key);
  return v.is_string() ? v.get<std::string>() : std::string();
}

using tetra::core::fmt;

// ---- the run folder's records ----------------------------------------------------------

using tetra::core::EvalFigures;
using tetra::core::MetricsFile;
using tetra::core::RunFolder;
using tetra::core::StateBytesRecord;
using tetra::core::StepMsRecord;
using tetra::core::Summary;
using tetra::core::TrainRecord;

// A figure of a record; NaN where the record does not have it.
template <class T>
double num(const std::optional<T>& v) {
  return v ? static_cast<double>(*v) : kNaN;
}
// One figure of a sub-object (step_ms, model_state_bytes); NaN where either is absent.
template <class S, class T>
double num(const std::optional<S>& sub, std::optional<T> S::*figure) {
  return sub ? num((*sub).*figure) : kNaN;
}
// A mesh axis's time in comm_ms; NaN where absent.
double num(const std::optional<tetra::core::AxisTimes>& times, const std::string& axis) {
  if (!times) return kNaN;
  const auto it = times->find(axis);
  return it != times->end() ? it->second : kNaN;
}

// `figure` of each record, in step order (NaN where absent).
template <class R, class F>
std::vector<double> column(const std::map<int64_t, R>& recs, F figure) {
  std::vector<double> out;
  out.reserve(recs.size());
  for (const auto& kv : recs) out.push_back(figure(kv.second));
  return out;
}
template <class R, class T, class Base>
std::vector<double> column(const std::map<int64_t, R>& recs, std::optional<T> Base::*figure) {
  return column(recs, [&](const R& r) { return num(r.*figure); });
}

template <class R>
std::vector<double> steps_of(const std::map<int64_t, R>& recs) {
  std::vector<double> out;
  out.reserve(recs.size());
  for (const auto& kv : recs) out.push_back(static_cast<double>(kv.first));
  return out;
}

bool any_finite(const std::vector<double>& v) {
  return std::any_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}

// ---- the page -------------------------------------------------------------------------

class Page {
 public:
  void open(const std::string& id, const std::string& title) {
    id_ = id;
    missing_ = false;
    html += "<section id=\"" + id + "\"><h2>" + chart::escape(title) + "</h2>\n";
  }
  void close() {
    html += "</section>\n";
    (missing_ ? missing : drawn).push_back(id_);
  }
  // The section has nothing to draw; says why.
  void missing_line(const std::string& why) {
    missing_ = true;
    html += "<p class=\"missing\">" + chart::escape(why) + "</p>\n";
  }
  void note(const std::string& text) {
    html += "<p class=\"note\">" + chart::escape(text) + "</p>\n";
  }
  void add(chart::Chart c) {
    html += c.svg() + "\n";
    charts.push_back(std::move(c));
  }
  void table(const std::vector<std::string>& head,
             const std::vector<std::vector<std::string>>& rows) {
    html += "<table><thead><tr>";
    for (const auto& h : head) html += "<th>" + chart::escape(h) + "</th>";
    html += "</tr></thead><tbody>\n";
    for (const auto& r : rows) {
      html += "<tr>";
      for (const auto& c : r) html += "<td>" + chart::escape(c) + "</td>";
      html += "</tr>\n";
    }
    html += "</tbody></table>\n";
  }

  std::string html;
  std::vector<chart::Chart> charts;
  std::vector<std::string> drawn, missing;

 private:
  std::string id_;
  bool missing_ = false;
};

constexpr int kWide = 1120, kHalf = 552;

// Colours kept across charts: a phase is the same colour in the step-time chart and the
// timeline, a kind of memory the same in every bar.
const std::string& kForward = chart::colour(0);
const std::string& kBackward = chart::colour(1);
const std::string kWaitColour = "#BBBBBB";

// summary.json's processes; its world counts replica threads too (older summaries: world).
double processes(const std::optional<Summary>& summary) {
  if (!summary) return kNaN;
  const double p = num(summary->processes);
  return std::isfinite(p) ? p : num(summary->world);
}

std::string pct(double fraction) {
  return std::isfinite(fraction) ? fmt("%.1f%%", 100 * fraction) : "n/a";
}
std::string ms(double v) { return chart::human(v, Unit::kMilliseconds); }
std::string bytes(double v) { return chart::human(v, Unit::kBytes); }
// "0.4 s" under a minute (a short test run), else "1m05s".
std::string duration(double seconds) {
  return std::isfinite(seconds) && seconds < 60 ? fmt("%.1f s", seconds)
                                                : tetra::core::human_duration(seconds);
}

// ---- header ---------------------------------------------------------------------------

// Returns the job's name (the page's title).
std::string header_section(Page& page, const RunFolder& run) {
  const MetricsFile& m = run.metrics;
  const bool have = run.summary.has_value();
  std::string name = have ? run.summary->job : "";
  const fs::path dir(run.dir);
  if (name.empty())
    name = dir.filename().empty() ? dir.parent_path().filename().string() : dir.filename().string();
  page.html += "<h1>" + chart::escape(name) + "</h1>\n";
  page.open("run", "Run");
  if (!have)
    page.note(
        "No summary.json: the run did not finish (killed, or still running). What follows is "
        "from " +
        m.path + (run.traces.empty() ? "" : " and the traces") + ".");
  std::vector<std::pair<std::string, std::string>> facts;
  auto fact = [&](const std::string& k, const std::string& v) {
    if (!v.empty()) facts.emplace_back(k, v);
  };
  if (have) {
    const Summary& s = *run.summary;
    std::string version = s.tetra;
    if (!s.commit.empty()) version += " (commit " + s.commit + ")";
    fact("tetra", version);
    fact("started", s.started);
    fact("finished", s.finished);
    std::string world =
        std::isfinite(processes(run.summary)) ? fmt("%.0f processes", processes(run.summary)) : "";
    if (s.mesh && !s.mesh->empty()) {
      std::vector<std::string> axes;
      for (const auto& [axis, n] : *s.mesh) axes.push_back(axis + "=" + std::to_string(n));
      world += ", mesh " + tetra::core::join(axes, " x ");
    }
    if (num(s.replicas) > 1) world += fmt(", %.0f replicas per process", num(s.replicas));
    fact("world", world);
    std::string steps = fmt("%.0f", num(s.final_step));
    if (num(s.steps) != num(s.final_step)) steps += fmt(" (%.0f this run)", num(s.steps));
    if (num(s.skipped_steps) > 0) steps += fmt(", %.0f skipped", num(s.skipped_steps));
    fact("steps", steps);
    fact("time", duration(num(s.total_seconds)) + " (training " + duration(num(s.train_seconds)) + ")");
    fact("throughput", fmt("%.0f samples/s", num(s.samples_per_s)));
    fact("final loss", fmt("%.4f", num(s.final_loss)));
    fact("resumed from", s.resumed_from);
  } else if (!m.train.empty()) {
    const TrainRecord& last = m.train.rbegin()->second;
    fact("steps", std::to_string(m.train.rbegin()->first) + " logged (the last record)");
    fact("time", duration(num(last.time_s)) + " at the last record");
    fact("throughput", fmt("%.0f samples/s at the last record", num(last.samples_per_s)));
    double loss = kNaN;
    for (const auto& kv : m.train)
      if (std::isfinite(num(kv.second.loss))) loss = num(kv.second.loss);
    fact("last loss", fmt("%.4f", loss));
  }
  std::optional<EvalFigures> eval = have ? run.summary->final_eval : std::nullopt;
  const bool final_eval = eval.has_value();
  if (!final_eval && !m.eval.empty()) eval = static_cast<const EvalFigures&>(m.eval.rbegin()->second);
  if (eval) {
    std::string e = fmt("test loss %.4f", num(eval->test_loss));
    if (std::isfinite(num(eval->perplexity))) e += fmt(", perplexity %.3f", num(eval->perplexity));
    if (std::isfinite(num(eval->test_accuracy))) e += fmt(", accuracy %.2f%%", 100 * num(eval->test_accuracy));
    fact(final_eval ? "final eval" : "last eval", e);
  }
  if (!m.resumed_at.empty()) {
    std::vector<std::string> at;
    for (int64_t st : m.resumed_at) at.push_back(std::to_string(st));
    fact("metrics", "resumed at step " + tetra::core::join(at) + " (the later records win)");
  }
  page.html += "<dl class=\"facts\">";
  for (const auto& [k, v] : facts)
    page.html += "<dt>" + chart::escape(k) + "</dt><dd>" + chart::escape(v) + "</dd>";
  page.html += "</dl>\n";
  for (const auto& n : run.notes) page.note(n);
  page.close();
  return name;
}

// ---- loss, evaluation and the other curves over steps ---------------------------------

std::vector<chart::Rule> rules_of(const MetricsFile& m) {
  std::vector<chart::Rule> rules;
  for (int64_t st : m.resumed_at) rules.push_back({static_cast<double>(st), "resumed", "#555555"});
  for (const auto& [st, rec] : m.failures)
    rules.push_back({static_cast<double>(st), "checkpoint failed", "#AA3377"});
  return rules;
}

chart::Frame frame_over_steps(const std::string& title, const std::string& y, Unit unit, int width,
                              bool zero) {
  chart::Frame f;
  f.title = title;
  f.x = {"step", Unit::kNumber, false, true};
  f.y = {y, unit, zero};
  f.width = width;
  f.height = width == kWide ? 300 : 250;
  return f;
}

void loss_section(Page& page, const MetricsFile& m) {
  page.open("loss", "Loss");
  const std::vector<double> loss = column(m.train, &TrainRecord::loss),
                            test = column(m.eval, &EvalFigures::test_loss);
  if (!any_finite(loss) && !any_finite(test)) {
    page.missing_line(
        "no loss in the metrics: neither train records with a finite loss nor eval records");
    page.close();
    return;
  }
  std::vector<chart::Series> series;
  if (any_finite(loss))
    series.push_back({"train loss", steps_of(m.train), loss, kForward, true, false, false});
  if (any_finite(test))
    series.push_back({"test loss (eval)", steps_of(m.eval), test, kBackward, true, true, true});
  chart::Frame f = frame_over_steps("Loss", "loss", Unit::kNumber, kWide, false);
  const auto skipped = std::count_if(m.train.begin(), m.train.end(), [](const auto& kv) {
    return kv.second.skipped;
  });
  if (skipped)
    f.note =
        std::to_string(skipped) + " logged step(s) skipped (loss not finite): gaps in the line";
  page.add(chart::line_chart(f, series, rules_of(m)));
  for (const auto& [st, rec] : m.failures)
    page.note("step " + std::to_string(st) + ": checkpoint failed (" +
              rec.checkpoint_error + ")");
  page.close();
}

void eval_section(Page& page, const MetricsFile& m) {
  page.open("eval", "Evaluation");
  const std::vector<double> ppl = column(m.eval, &EvalFigures::perplexity),
                            acc = column(m.eval, &EvalFigures::test_accuracy);
  if (m.eval.empty()) {
    page.missing_line(
        "no eval records in the metrics (train.eval_every, or the end of an epoch, writes them)");
  } else if (any_finite(ppl)) {
    page.add(chart::line_chart(
        frame_over_steps("Perplexity (test)", "perplexity", Unit::kNumber, kHalf, false),
        {{"perplexity", steps_of(m.eval), ppl, kBackward, true, true, false}}, rules_of(m)));
  } else if (any_finite(acc)) {
    std::vector<double> percent = acc;
    for (double& v : percent) v *= 100;
    page.add(chart::line_chart(
        frame_over_steps("Accuracy (test)", "accuracy (%)", Unit::kPercent, kHalf, false),
        {{"test accuracy", steps_of(m.eval), percent, kBackward, true, true, false}}, rules_of(m)));
  } else {
    page.missing_line("the eval records carry neither test_accuracy nor perplexity");
  }
  page.close();
}

// One number of the train records over steps, in a half-width section.
void curve_section(Page& page, const MetricsFile& m, const std::string& id, const std::string& title,
                   std::optional<double> TrainRecord::*figure, const std::string& y,
                   const std::string& why_missing) {
  page.open(id, title);
  const std::vector<double> v = column(m.train, figure);
  if (!any_finite(v))
    page.missing_line(why_missing);
  else
    page.add(chart::line_chart(
        frame_over_steps(title, y, Unit::kNumber, kHalf, true),
        {{title, steps_of(m.train), v, chart::colour(2), true, m.train.size() < 40, false}},
        rules_of(m)));
  page.close();
}

// ---- time per step --------------------------------------------------------------------

// A phase of the records' step_ms, its name on the page and its colour in every chart.
struct Phase {
  std::optional<double> StepMsRecord::*ms;
  const char* name;
  std::string colour;
};
// The trainer's phases (core/trainer.cpp's step_ms), bottom to top; "gradients" is the
// gradient synchronisation after backward.
const std::vector<Phase>& phases() {
  static const std::vector<Phase> p = {{&StepMsRecord::data, "data", chart::colour(4)},
                                       {&StepMsRecord::forward, "forward", kForward},
                                       {&StepMsRecord::backward, "backward", kBackward},
                                       {&StepMsRecord::gradients, "gradient sync", chart::colour(5)},
                                       {&StepMsRecord::optimizer, "optimizer", chart::colour(2)}};
  return p;
}

// The step-time chart: each phase per logged interval, rank 0's, and the time in
// communication per mesh axis. False when the records carry no step_ms.
bool step_time_chart(Page& page, const MetricsFile& m) {
  std::vector<chart::Layer> layers;
  bool any = false;
  for (const auto& ph : phases()) {
    layers.push_back({ph.name, column(m.train, [&](const TrainRecord& r) { return num(r.step_ms, ph.ms); }),
                      ph.colour});
    any = any || any_finite(layers.back().y);
  }
  if (!any) return false;
  std::set<std::string> axes;
  for (const auto& kv : m.train)
    if (kv.second.comm_ms)
      for (const auto& [axis, v] : *kv.second.comm_ms) axes.insert(axis);
  std::vector<chart::Series> lines;
  size_t k = 0;
  for (const auto& axis : axes)
    lines.push_back({"communication, " + axis + " axis", steps_of(m.train),
                     column(m.train, [&](const TrainRecord& r) { return num(r.comm_ms, axis); }),
                     k++ ? chart::colour(6) : chart::colour(3), true, false, true});
  chart::Frame f = frame_over_steps("Time per step, by phase (rank 0)", "time per step",
                                    Unit::kMilliseconds, kWide, true);
  f.note =
      "each record's mean over the steps since the one before" +
      std::string(lines.empty()
                      ? ""
                      : "; dashed: time in communication per mesh axis, which overlaps the phases");
  page.add(chart::stacked_steps_chart(f, steps_of(m.train), layers, lines));
  return true;
}

void step_time_section(Page& page, const RunFolder& run) {
  const MetricsFile& m = run.metrics;
  page.open("step-time", "Time per step");
  if (!step_time_chart(page, m)) {
    page.missing_line("the train records carry no step_ms (where a step's time went)");
    page.close();
    return;
  }

  // Means per rank from summary.json; else rank 0's from the records, each weighted by
  // the steps it covers.
  std::vector<std::string> head = {"rank"};
  for (const auto& ph : phases()) head.push_back(ph.name);
  head.push_back("total");
  std::vector<std::vector<std::string>> rows;
  if (run.summary && run.summary->ranks && !run.summary->ranks->empty()) {
    const std::vector<Summary::Rank>& ranks = *run.summary->ranks;
    std::set<std::string> comm_axes;
    bool bubble = false;
    for (const auto& r : ranks) {
      if (r.comm_ms)
        for (const auto& [axis, v] : *r.comm_ms) comm_axes.insert(axis);
      bubble = bubble || std::isfinite(num(r.pipeline_bubble));
    }
    for (const auto& axis : comm_axes) head.push_back("comm " + axis);
    if (bubble) head.push_back("bubble over the run");
    for (const auto& r : ranks) {
      std::vector<std::string> row = {fmt("%.0f", num(r.rank))};
      double total = 0;
      for (const auto& ph : phases()) {
        const double v = num(r.step_ms, ph.ms);
        row.push_back(ms(v));
        if (std::isfinite(v)) total += v;
      }
      row.push_back(ms(total));
      for (const auto& axis : comm_axes) {
        const double v = num(r.comm_ms, axis);
        row.push_back(std::isfinite(v) ? ms(v) : "");
      }
      if (bubble) row.push_back(pct(num(r.pipeline_bubble)));
      rows.push_back(std::move(row));
    }
    page.note("Mean per step over the run, per rank (summary.json):");
  } else {
    std::vector<std::string> row = {"0"};
    double total = 0;
    for (const auto& ph : phases()) {
      double sum = 0, n = 0;
      int64_t before = 0;
      for (const auto& [st, rec] : m.train) {
        const double v = num(rec.step_ms, ph.ms);
        const double steps = static_cast<double>(std::max<int64_t>(1, st - before));
        before = st;
        if (std::isfinite(v)) sum += v * steps, n += steps;
      }
      row.push_back(n > 0 ? ms(sum / n) : "n/a");
      if (n > 0) total += sum / n;
    }
    row.push_back(ms(total));
    rows.push_back(std::move(row));
    page.note(
        "Mean per step over the logged steps, rank 0 only (no summary.json with every rank's):");
  }
  page.table(head, rows);
  page.close();
}

// ---- memory ---------------------------------------------------------------------------

// One process's bytes as train --dry-run estimates them.
struct Planned {
  int rank = 0;
  tetra::core::ModelStateBytes state;
  int64_t activations = 0;  // saved for backward at the peak
};

struct Estimate {
  std::vector<Planned> ranks;  // dry_run's estimate, per process
  std::string why;             // when there is none
  double seconds = 0;
  YAML::Node resolved;  // the job with every default, when job.yaml parsed
};

Estimate estimate(const RunFolder& run, bool wanted) {
  Estimate e;
  if (!run.has_job) {
    e.why = "no job.yaml in " + run.dir;
    return e;
  }
  const auto t0 = Clock::now();
  try {
    tetra::core::SectionRegistry plugins;
    tetra::register_builtin_plugins(plugins);
    // The run's world sizes an auto mesh axis (Note [Auto axis]) as it did for the run.
    const double world = processes(run.summary);
    const tetra::core::JobWorld job_world =
        std::isfinite(world) ? tetra::core::JobWorld{static_cast<int>(world), "the run's summary.json"}
                             : tetra::core::JobWorld{};
    tetra::core::ParsedJob parsed =
        tetra::core::parse_job_string(run.job_yaml, run.job_path, {}, plugins, {}, job_world);
    e.resolved = parsed.resolved;
    if (!wanted) {
      e.why = "not worked out (--no-estimate)";
      return e;
    }
    tetra::DryRunOptions how;
    how.timing_rounds = 1;  // the estimate's bytes are what the page uses, not the step's spread
    how.np = std::isfinite(world) ? static_cast<int>(world) : 0;
    for (const tetra::core::RankEstimate& r : tetra::plan_report(parsed.spec, {}, how).estimates)
      e.ranks.push_back({r.rank, r.state, r.activations});
  } catch (const std::exception& ex) {
    std::string why = ex.what();
    while (!why.empty() && why.back() == '\n') why.pop_back();
    e.why = "the plan's estimate failed: " + why;
  }
  e.seconds = seconds_since(t0);
  return e;
}

// A kind of model state: its name on the page, its colour in every bar, and its bytes as
// measured (none for activations: estimated only) and as estimated.
struct StateKind {
  const char* name;
  std::string colour;
  std::optional<int64_t> StateBytesRecord::*measured;
  int64_t (*planned)(const Planned&);
};
const std::vector<StateKind>& state_kinds() {
  static const std::vector<StateKind> k = {
      {"parameters", chart::colour(0), &StateBytesRecord::parameters,
       [](const Planned& p) { return p.state.parameters; }},
      {"gradients", chart::colour(1), &StateBytesRecord::gradients,
       [](const Planned& p) { return p.state.gradients; }},
      {"optimizer state", chart::colour(2), &StateBytesRecord::optimizer,
       [](const Planned& p) { return p.state.optimizer; }},
      {"buffers", chart::colour(3), &StateBytesRecord::buffers,
       [](const Planned& p) { return p.state.buffers; }},
      {"activations (estimate only)", chart::colour(4), nullptr,
       [](const Planned& p) { return p.activations; }}};
  return k;
}

struct RankMemory {
  int rank = 0;
  std::string host;
  StateBytesRecord state;  // by kind, or the total only
  double rss = kNaN;
};

// From summary.json; else from the last train record (rank 0's breakdown, the others'
// totals from its per-rank rows).
std::vector<RankMemory> measured_memory(const RunFolder& run, std::string* source) {
  std::vector<RankMemory> out;
  if (run.summary && run.summary->ranks && !run.summary->ranks->empty()) {
    *source = "summary.json";
    for (const auto& r : *run.summary->ranks)
      out.push_back({static_cast<int>(num(r.rank)), r.host, r.model_state_bytes.value_or(StateBytesRecord{}),
                     num(r.peak_rss_bytes)});
    return out;
  }
  if (run.metrics.train.empty()) return out;
  const TrainRecord& last = run.metrics.train.rbegin()->second;
  *source =
      "the last train record (step " + std::to_string(run.metrics.train.rbegin()->first) + ")";
  const size_t n = last.ranks && !last.ranks->empty() ? last.ranks->size() : 1;
  for (size_t i = 0; i < n; ++i) {
    RankMemory r;
    r.rank = static_cast<int>(i);
    const TrainRecord::Rank pr = last.ranks && i < last.ranks->size() ? (*last.ranks)[i] : TrainRecord::Rank{};
    if (i == 0 && last.model_state_bytes) {
      r.state = *last.model_state_bytes;
      r.rss = num(last.peak_rss_bytes);
    } else {
      r.state.total = pr.model_state_bytes;
      r.rss = num(pr.peak_rss_bytes);
    }
    if (std::isfinite(num(r.state.total)) || std::isfinite(r.rss)) out.push_back(std::move(r));
  }
  return out;
}

void memory_section(Page& page, const RunFolder& run, const Estimate& est) {
  page.open("memory", "Memory per rank");
  std::string source;
  const std::vector<RankMemory> measured = measured_memory(run, &source);
  std::map<int, const RankMemory*> by_rank;
  for (const auto& r : measured) by_rank[r.rank] = &r;
  // The estimate is per process; the run's ranks are processes x replica threads, rank
  // p * R + r being process p's replica r (make_hierarchical's order): each replica is
  // set against its process's estimate.
  const double replicas_read = run.summary ? num(run.summary->replicas) : kNaN;
  const int R = std::isfinite(replicas_read) && replicas_read > 1 ? static_cast<int>(replicas_read) : 1;
  std::map<int, const Planned*> planned;  // by the run's rank
  for (const auto& r : est.ranks)
    for (int replica = 0; replica < R; ++replica) planned[r.rank * R + replica] = &r;
  std::set<int> ranks;
  for (const auto& kv : by_rank) ranks.insert(kv.first);
  for (const auto& kv : planned) ranks.insert(kv.first);
  if (ranks.empty()) {
    page.missing_line(
        "no memory: neither summary.json's ranks nor a train record with model_state_bytes, and " +
        (est.why.empty() ? std::string("no estimate") : "no estimate (" + est.why + ")"));
    page.close();
    return;
  }
  std::vector<chart::Group> groups;
  std::vector<std::vector<std::string>> rows;
  for (int rank : ranks) {
    chart::Group g;
    g.label = "rank " + std::to_string(rank);
    const auto mi = by_rank.find(rank);
    const auto pi = planned.find(rank);
    double state = kNaN, plan_state = kNaN, rss = kNaN;
    if (mi != by_rank.end()) {
      const RankMemory& r = *mi->second;
      chart::Bar bar{"measured", {}, false};
      state = num(r.state.total);
      rss = r.rss;
      if (std::isfinite(num(r.state.parameters))) {
        for (const auto& k : state_kinds())
          if (k.measured) bar.segments.push_back({k.name, num(r.state.*k.measured), k.colour});
      } else {
        bar.segments.push_back({"model state (total only)", state, chart::colour(5)});
      }
      g.bars.push_back(std::move(bar));
    }
    if (pi != planned.end()) {
      chart::Bar bar{"estimate", {}, true};
      const Planned& p = *pi->second;
      for (const auto& k : state_kinds())
        bar.segments.push_back({k.name, static_cast<double>(k.planned(p)), k.colour});
      // The estimate's total less its activations, as the dry run's JSON gives them.
      plan_state = static_cast<double>(p.state.total() + p.activations) - static_cast<double>(p.activations);
      g.bars.push_back(std::move(bar));
    }
    const double ratio = plan_state > 0 ? state / plan_state : kNaN;
    if (std::isfinite(ratio)) g.note = fmt("%.2fx", ratio);
    if (std::isfinite(rss))
      g.bars.push_back({"RSS", {{"peak RSS (whole process)", rss, "#888888"}}, false, true});
    groups.push_back(std::move(g));
    rows.push_back({std::to_string(rank), mi != by_rank.end() ? mi->second->host : "", bytes(state),
                    bytes(plan_state), std::isfinite(ratio) ? fmt("%.3f", ratio) : "n/a",
                    pi != planned.end() ? bytes(static_cast<double>(pi->second->activations)) : "n/a",
                    bytes(rss)});
  }
  chart::Frame f;
  f.title = "Model state per rank: measured, the plan's estimate (pale), and peak RSS";
  f.x = {"rank", Unit::kNumber, true};
  f.y = {"bytes", Unit::kBytes, true};
  f.width = kWide;
  f.height = 320;
  if (!planned.empty())
    f.note =
        "over each rank: measured model state / estimated model state (activations are estimated "
        "only)";
  page.add(chart::bar_chart(f, groups));
  if (!est.why.empty()) page.note("No estimate: " + est.why + ".");
  page.note((measured.empty()
                 ? "Nothing measured (no summary.json ranks, no model_state_bytes in the records)."
                 : "Measured from " + source + ".") +
            std::string(
                " The estimate is train --dry-run's (job.yaml, the run's world); n/a: not known."));
  page.table({"rank", "host", "model state", "estimate", "measured / estimate",
              "activations (est.)", "peak RSS"},
             rows);
  page.close();
}

// ---- the pipeline timeline ------------------------------------------------------------

// Note [Pipeline step]: the timeline shows one training step on every rank that has
// "stage S" tracks, on the merged clock (core/trace_merge.h). A step is the rank's span
// "step N" on its "step" track (the trainer's, Note [Run folder]). The step shown is
// --step, else the last one
// every such rank has whole. Per rank: busy = the union of its forward (F<m>) and
// backward (B<m>, and W<m> under a zero-bubble schedule) spans in the step; idle = step span - busy, so it counts the waits for
// a neighbour (wait recvA/recvG) and everything else the step does outside the stages
// (gradient sync, optimizer). The idle fraction between the rank's first and last
// forward/backward is the part the schedule's bubble explains, set beside the textbook
// bubble of the job's schedule (pipeline::ideal_bubble: (P-1)/(m+P-1) for 1F1B) at its mesh.pipeline,
// pipeline.micro_batches and virtual_stages.

struct Span {
  double begin, end;
  std::string name;
};

struct RankSpans {
  std::map<std::string, std::vector<Span>> tracks;  // track name -> spans
  std::vector<int> stages;                          // from the "stage S" tracks
};

std::map<int, RankSpans> spans_by_rank(const json& doc) {
  std::map<int, std::map<int64_t, std::string>> names;  // pid -> tid -> track
  std::map<int, RankSpans> out;
  const json& events = member(doc, "traceEvents");
  for (const auto& e : events) {
    if (e.value("ph", "") != "M" || e.value("name", "") != "thread_name") continue;
    names[e.value("pid", 0)][e.value("tid", int64_t{0})] = text_of(member(e, "args"), "name");
  }
  for (const auto& e : events) {
    if (e.value("ph", "") != "X" || !std::isfinite(number(e, "dur")) ||
        !std::isfinite(number(e, "ts")))
      continue;
    const int pid = e.value("pid", 0);
    const auto& tracks = names[pid];
    const auto t = tracks.find(e.value("tid", int64_t{0}));
    if (t == tracks.end()) continue;
    const double ts = number(e, "ts");
    out[pid].tracks[t->second].push_back({ts, ts + number(e, "dur"), e.value("name", "")});
  }
  for (auto& [pid, r] : out)
    for (const auto& [track, spans] : r.tracks)
      if (track.rfind("stage ", 0) == 0) r.stages.push_back(std::atoi(track.c_str() + 6));
  return out;
}

// Step number -> [begin, end] on one rank (Note [Pipeline step]).
std::map<int64_t, std::pair<double, double>> step_windows(const RankSpans& r) {
  std::map<int64_t, std::pair<double, double>> out;
  const auto step = r.tracks.find("step");
  if (step != r.tracks.end())
    for (const auto& s : step->second)
      if (s.name.rfind("step ", 0) == 0) out[std::atoll(s.name.c_str() + 5)] = {s.begin, s.end};
  return out;
}

// The length of the union of `spans` clipped to [lo, hi].
double covered(std::vector<std::pair<double, double>> spans, double lo, double hi) {
  std::sort(spans.begin(), spans.end());
  double total = 0, at = lo;
  for (auto [b, e] : spans) {
    b = std::max(b, at);
    e = std::min(e, hi);
    if (e > b) total += e - b, at = e;
  }
  return total;
}

// "F12.1" -> "12.1"
std::string micro_batch(const std::string& name) {
  const size_t i = name.find_first_of("0123456789");
  return i == std::string::npos ? name : name.substr(i);
}

// The job's pipeline as the textbook bubble needs it: summary.json's mesh, else job.yaml's
// (p = 0: not known).
struct PipelineShape {
  int p = 0, m = 0, v = 1;
  std::string kind = "1f1b";
};

PipelineShape pipeline_shape(const RunFolder& run, const Estimate& est) {
  PipelineShape s;
  if (run.summary && run.summary->mesh) {
    const auto it = run.summary->mesh->find("pipeline");  // the mesh axis
    if (it != run.summary->mesh->end()) s.p = static_cast<int>(it->second);
  }
  if (est.resolved.IsMap()) {
    try {
      s.p = est.resolved["mesh"]["pipeline"].as<int>(1);
      s.m = est.resolved["pipeline"]["micro_batches"].as<int>(0);
      s.kind = est.resolved["pipeline"]["schedule"].as<std::string>(s.kind);
      s.v = est.resolved["pipeline"]["virtual_stages"].as<int>(s.kind == "zbv" ? 2 : 1);
    } catch (const YAML::Exception&) {
    }
  }
  return s;
}

// The trainer's own measure per logged interval, when the records carry it.
void bubble_curves(Page& page, const MetricsFile& metrics) {
  std::vector<chart::Series> series;
  const std::vector<double> b0 = column(metrics.train, &TrainRecord::pipeline_bubble);
  size_t ranks = 0;
  for (const auto& kv : metrics.train)
    ranks = std::max(ranks, kv.second.ranks ? kv.second.ranks->size() : size_t{0});
  for (size_t r = 0; r < ranks; ++r) {
    std::vector<double> y;
    for (const auto& kv : metrics.train) {
      const auto& pr = kv.second.ranks;
      y.push_back(pr && r < pr->size() ? 100 * num((*pr)[r].pipeline_bubble) : kNaN);
    }
    if (any_finite(y))
      series.push_back({"rank " + std::to_string(r), steps_of(metrics.train), y, chart::colour(r),
                        true, false, false});
  }
  if (series.empty() && any_finite(b0)) {
    std::vector<double> y = b0;
    for (double& x : y) x *= 100;
    series.push_back({"rank 0", steps_of(metrics.train), y, chart::colour(0), true, false, false});
  }
  if (!series.empty())
    page.add(chart::line_chart(
        frame_over_steps(
            "Pipeline bubble per logged interval (the trainer's: time waiting / pipeline time)",
            "bubble (%)", Unit::kPercent, kWide, true),
        series, rules_of(metrics)));
}

using Windows = std::map<int, std::map<int64_t, std::pair<double, double>>>;  // pid -> step -> span

// The step the timeline shows (Note [Pipeline step]), with every staged rank's step
// windows; none (and the section's missing line) when no step is whole on every rank.
std::optional<int64_t> pick_step(Page& page, std::map<int, RankSpans>& ranks, const std::vector<int>& staged,
                                 int64_t wanted_step, Windows& windows) {
  std::set<int64_t> common;
  for (size_t i = 0; i < staged.size(); ++i) {
    windows[staged[i]] = step_windows(ranks[staged[i]]);
    std::set<int64_t> here;
    for (const auto& kv : windows[staged[i]]) here.insert(kv.first);
    if (i == 0) {
      common = here;
    } else {
      std::set<int64_t> both;
      std::set_intersection(common.begin(), common.end(), here.begin(), here.end(),
                            std::inserter(both, both.end()));
      common = both;
    }
  }
  if (common.empty()) {
    page.missing_line(
        "no step is whole on every pipeline rank in the traces (no \"step N\" span of a "
        "\"step\" track common to them)");
    return std::nullopt;
  }
  int64_t step = *common.rbegin();
  if (wanted_step > 0) {
    if (!common.count(wanted_step))
      throw ConfigError("--step " + std::to_string(wanted_step) +
                        ": not whole on every pipeline rank of the traces (steps " +
                        std::to_string(*common.begin()) + " to " +
                        std::to_string(*common.rbegin()) + ")");
    step = wanted_step;
  }
  return step;
}

// One step on every staged rank: the timeline, its table and what to read it against.
void step_timeline(Page& page, const RunFolder& run, const PipelineShape& shape, const Estimate& est,
                   const tetra::core::MergedTrace& merged, std::map<int, RankSpans>& ranks,
                   std::vector<int> staged, int64_t step, Windows& windows) {
  const int p = shape.p, m = shape.m, v = shape.v;
  const std::string& kind = shape.kind;
  std::sort(staged.begin(), staged.end(), [&](int a, int b) {
    return std::make_pair(ranks[a].stages.front(), a) < std::make_pair(ranks[b].stages.front(), b);
  });

  double t0 = std::numeric_limits<double>::infinity();
  for (int pid : staged) t0 = std::min(t0, windows[pid][step].first);
  std::vector<chart::Row> rows;
  std::vector<std::vector<std::string>> table;
  double all_span = 0, all_busy = 0;
  for (int pid : staged) {
    const RankSpans& r = ranks[pid];
    const auto [b, e] = windows[pid][step];
    chart::Row row;
    std::vector<std::string> stages;
    for (int s : r.stages) stages.push_back(std::to_string(s));
    row.label = "rank " + std::to_string(pid) + ", stage" + (stages.size() > 1 ? "s " : " ") +
                tetra::core::join(stages, ",");
    row.begin = (b - t0) / 1e3;
    row.end = (e - t0) / 1e3;
    std::vector<std::pair<double, double>> busy, waits;
    double first = e, last = b;
    for (const auto& [track, spans] : r.tracks) {
      if (track.rfind("stage ", 0) != 0) continue;
      for (const auto& s : spans) {
        if (s.end <= b || s.begin >= e) continue;
        // A zero-bubble schedule's weight pass (W3) is backward work too.
        const bool wait = s.name.rfind("wait", 0) == 0, fwd = !wait && s.name[0] == 'F',
                   bwd = !wait && (s.name[0] == 'B' || s.name[0] == 'W');
        if (!wait && !fwd && !bwd) continue;
        row.blocks.push_back({(std::max(s.begin, b) - t0) / 1e3, (std::min(s.end, e) - t0) / 1e3,
                              wait  ? size_t{2}
                              : fwd ? size_t{0}
                                    : size_t{1},
                              wait ? "" : micro_batch(s.name)});
        (wait ? waits : busy).emplace_back(s.begin, s.end);
        if (!wait) first = std::min(first, s.begin), last = std::max(last, s.end);
      }
    }
    const double span = e - b, on = covered(busy, b, e);
    const double window = last > first ? last - first : 0;
    all_span += span;
    all_busy += on;
    table.push_back({row.label, ms(span / 1e3), ms(on / 1e3), ms(covered(waits, b, e) / 1e3),
                     pct(span > 0 ? 1 - on / span : kNaN),
                     pct(window > 0 ? 1 - covered(busy, first, last) / window : kNaN)});
    rows.push_back(std::move(row));
  }
  chart::Frame f;
  f.title = "Pipeline, step " + std::to_string(step) +
            ": forward and backward per micro-batch on each rank";
  f.x = {"time from the step's start on the first rank", Unit::kMilliseconds, true};
  f.width = kWide;
  f.height = 0;
  f.note = "labels: micro-batch (.c: virtual-stage chunk c); white: idle in the step";
  page.add(chart::timeline_chart(f, rows,
                                 {{"forward", kForward},
                                  {"backward", kBackward},
                                  {"waiting for a neighbour", kWaitColour},
                                  {"idle (no forward/backward)", "#FFFFFF"}}));
  const double overall = all_span > 0 ? 1 - all_busy / all_span : kNaN;
  table.push_back(
      {"all pipeline ranks", ms(all_span / 1e3), ms(all_busy / 1e3), "", pct(overall), ""});
  page.table({"rank", "step", "forward + backward", "waiting", "idle in this step",
              "idle between first F and last B (the schedule's bubble)"},
             table);
  std::string textbook;
  if (p > 1 && m > 0)
    textbook = "Textbook bubble of " + kind + " for p=" + std::to_string(p) + " stages, m=" + std::to_string(m) +
               " micro-batches" + (v > 1 ? ", v=" + std::to_string(v) + " virtual stages" : "") + ": " +
               tetra::pipeline::bubble_formula(kind) + " = " + pct(tetra::pipeline::ideal_bubble(kind, p, m, v)) +
               "; measured overall: " + pct(overall) +
               " of the step (idle includes gradient sync, the optimizer and data loading).";
  else
    textbook = "No textbook bubble: " +
               std::string(est.resolved.IsMap()
                               ? "the job's mesh.pipeline or pipeline.micro_batches is unknown"
                               : "job.yaml is missing or does not parse") +
               ".";
  page.note(textbook);
  // A rank's bubble appears as three figures, each measuring something else: say which.
  page.note("Three measures of a rank's bubble, each of its own span: \"idle in this step\" is this one "
            "step's time outside forward and backward (gradient sync, the optimizer and data loading "
            "included); \"idle between first F and last B\" is the part of it the schedule explains, the one "
            "to set beside the textbook figure; \"bubble over the run\" (the step-time table) and the curve "
            "below are the trainer's own count, time waiting on a neighbour over the time inside the schedule, "
            "over the whole run and over each logged interval.");
  page.note("Traces " + merged.alignment + ": " + tetra::core::join(run.traces) + ".");
  for (const auto& w : merged.warnings) page.note("warning: " + w);
}

void pipeline_section(Page& page, const RunFolder& run, const Estimate& est, int64_t wanted_step) {
  page.open("pipeline", "Pipeline timeline");
  const PipelineShape shape = pipeline_shape(run, est);
  const int p = shape.p;
  if (run.traces.empty()) {
    page.missing_line(p == 1 ? "no pipeline in this job (mesh.pipeline is 1), and no trace"
                             : "no trace: set log.trace to see the pipeline timeline");
    bubble_curves(page, run.metrics);
    page.close();
    return;
  }
  tetra::core::MergedTrace merged;
  try {
    merged = tetra::core::merge_traces(run.traces);
  } catch (const std::exception& e) {
    page.missing_line(std::string("the traces cannot be read: ") + e.what());
    page.close();
    return;
  }
  std::map<int, RankSpans> ranks = spans_by_rank(merged.doc);
  std::vector<int> staged;
  for (const auto& [pid, r] : ranks)
    if (!r.stages.empty()) staged.push_back(pid);
  if (staged.empty()) {
    page.missing_line(
        "the traces have no pipeline stage tracks" +
        std::string(p == 1 ? ": there is no pipeline in this job (mesh.pipeline is 1)" : ""));
    page.close();
    return;
  }
  Windows windows;
  const std::optional<int64_t> step = pick_step(page, ranks, staged, wanted_step, windows);
  if (!step) {
    page.close();
    return;
  }
  step_timeline(page, run, shape, est, merged, ranks, staged, *step, windows);
  bubble_curves(page, run.metrics);
  page.close();
}

// ---- the job ----------------------------------------------------------------------------

void job_section(Page& page, const RunFolder& run) {
  page.open("job", "Job spec");
  if (!run.has_job)
    page.missing_line("no job.yaml in " + run.dir +
                      " (the resolved job is written there by the trainer)");
  else
    page.html += "<p class=\"note\">" + chart::escape(run.job_path) + "</p>\n<pre>" +
                 chart::escape(run.job_yaml) + "</pre>\n";
  page.close();
}

const char* const kStyle = R"(
body{font:14px/1.45 sans-serif;color:#222;background:#f4f4f4;margin:0}
main{max-width:1160px;margin:0 auto;padding:12px 16px}
h1{font-size:22px;margin:10px 0 4px}
h2{font-size:16px;margin:0 0 8px}
section{background:#fff;border:1px solid #ddd;border-radius:4px;padding:10px 14px;margin:10px 0}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(540px,1fr));gap:0 10px}
svg.plot{display:block;max-width:100%;height:auto}
.missing{color:#8a4300;font-style:italic;margin:4px 0}
.note{color:#444;font-size:13px;margin:4px 0}
dl.facts{display:grid;grid-template-columns:max-content 1fr max-content 1fr;gap:2px 14px;margin:4px 0}
dt{color:#555}dd{margin:0}
table{border-collapse:collapse;font-size:13px;font-variant-numeric:tabular-nums;margin:6px 0}
th,td{padding:2px 10px;border-bottom:1px solid #e6e6e6;text-align:right}
th:first-child,td:first-child{text-align:left}
pre{background:#f8f8f8;border:1px solid #e4e4e4;padding:8px;overflow:auto;font:12px/1.35 monospace}
footer{color:#777;font-size:12px;margin:8px 0 16px}
)";

// ---- --png ------------------------------------------------------------------------------

std::string on_path(const std::string& name) {
  const std::string dirs = tetra::env::text(tetra::env::kPath);
  size_t at = 0;
  while (at <= dirs.size()) {
    const size_t colon = std::min(dirs.find(':', at), dirs.size());
    const std::string dir = dirs.substr(at, colon - at);
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    at = colon + 1;
  }
  return "";
}

// The charts as one SVG, converted by rsvg-convert (a child process, no shell).
void write_png(const std::string& rsvg, const std::string& heading,
               const std::vector<chart::Chart>& charts, const std::string& png) {
  const std::string svg_path = png + ".svg.tmp";
  {
    std::ofstream out(svg_path, std::ios::binary);
    out << chart::compose(heading, charts);
    if (!out) throw tetra::Error("cannot write " + svg_path);
  }
  std::vector<std::string> args = {rsvg, "--format=png", "--output", png, svg_path};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, rsvg.c_str(), nullptr, nullptr, argv.data(), environ);
  int status = 0;
  if (rc == 0) ::waitpid(pid, &status, 0);
  std::error_code ec;
  fs::remove(svg_path, ec);
  if (rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw tetra::Error(rsvg + " could not convert the charts to " + png);
}

int report(const std::string& dir, std::string out, const std::string& png, int64_t step,
           bool with_estimate) {
  const auto t_start = Clock::now();
  std::string rsvg;
  if (!png.empty()) {
    rsvg = on_path("rsvg-convert");
    if (rsvg.empty())
      throw ConfigError(
          "--png needs rsvg-convert, which is not on PATH: install Debian's librsvg2-bin "
          "(apt-get install librsvg2-bin)");
  }
  if (out.empty()) out = (fs::path(dir) / "report.html").string();
  const RunFolder run = tetra::core::read_run_folder(dir);
  const double read_s = seconds_since(t_start);
  const Estimate est = estimate(run, with_estimate);

  const auto t_render = Clock::now();
  Page page;
  const std::string name = header_section(page, run), title = chart::escape(name);
  loss_section(page, run.metrics);
  page.html += "<div class=\"grid\">\n";
  eval_section(page, run.metrics);
  curve_section(page, run.metrics, "lr", "Learning rate", &TrainRecord::lr, "learning rate",
                "the train records carry no lr");
  curve_section(page, run.metrics, "throughput", "Throughput", &TrainRecord::samples_per_s, "samples/s",
                "the train records carry no samples_per_s");
  curve_section(page, run.metrics, "grad-norm", "Gradient norm (L2, before clipping)", &TrainRecord::grad_norm,
                "gradient norm",
                "no grad_norm in the train records (the trainer logs it when "
                "optimizer.clip_grad_norm is set)");
  page.html += "</div>\n";
  step_time_section(page, run);
  memory_section(page, run, est);
  pipeline_section(page, run, est, step);
  job_section(page, run);

  std::string html =
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>" + title +
      " — tetra report</title>\n<meta name=\"viewport\" content=\"width=device-width, "
      "initial-scale=1\">\n"
      "<style>" +
      kStyle + "</style></head>\n<body><main>\n" + page.html +
      "<footer>Written by tetra's report from " + chart::escape(fs::absolute(dir).string()) +
      ". Charts: series of more than " + std::to_string(chart::kMaxPoints) +
      " points are drawn from each bucket's lowest and highest.</footer>\n</main></body></html>\n";
  const double render_s = seconds_since(t_render);
  tetra::core::write_file_atomic(out, html);

  using tetra::hardware::ByteDigits;
  std::string line =
      "report: wrote " + out + " (" + tetra::hardware::format_bytes(static_cast<int64_t>(html.size()), ByteDigits::kThree) + ")";
  if (!png.empty()) {
    write_png(rsvg, name + " — tetra report", page.charts, png);
    std::error_code ec;
    line += " and " + png + " (" +
            tetra::hardware::format_bytes(static_cast<int64_t>(fs::file_size(png, ec)), ByteDigits::kThree) + ")";
  }
  line += ": " + tetra::core::join(page.drawn, ", ");
  if (!page.missing.empty()) line += "; missing: " + tetra::core::join(page.missing, ", ");
  line += fmt("; read %.3f s", read_s) + fmt(", estimate %.3f s", est.seconds) +
          fmt(", render %.3f s", render_s);
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, out, png;
  int64_t step = 0;
  bool no_estimate = false;
  CLI::App app{
      "report: one self-contained HTML page about a training run (charts as inline SVG, no script)",
      "report"};
  app.footer(
      "Examples:\n"
      "  report runs/quickstart                      runs/quickstart/report.html\n"
      "  report runs/pp-dp -o pp-dp.html --png pp-dp.png --step 40\n\n"
      "Exit status: 0 written; 2 the input is wrong (no such folder, no metrics, a line that is "
      "not JSON, --step not "
      "in the traces, no rsvg-convert for --png); 1 anything else.");
  app.add_option("run_dir", dir,
                 "the run's folder, its log.dir (summary.json, metrics.jsonl, job.yaml, traces)")
      ->required();
  app.add_option("-o,--output", out, "the page to write (default RUN_DIR/report.html)");
  app.add_option("--png", png,
                 "also every chart in one PNG (rsvg-convert, from Debian's librsvg2-bin)");
  app.add_option("--step", step,
                 "the step the pipeline timeline shows (default: the last whole on every rank)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-estimate", no_estimate,
               "leave out the plan's memory estimate (it builds the model and reads the data)");
  try {
    app.parse(argc, argv);
    return report(dir, out, png, step, !no_estimate);
  } catch (const CLI::ParseError& e) {  // --help and --version are "errors" that exit 0
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const std::exception& e) {  // a ConfigError is the input's fault: 2
    std::fprintf(stderr, "report: %s\n", e.what());
    return dynamic_cast<const ConfigError*>(&e) ? 2 : 1;
  } catch (...) {
    std::fprintf(stderr, "report: unknown error\n");
    return 1;
  }
}
