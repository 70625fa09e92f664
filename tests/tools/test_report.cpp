// `report` as a user runs it. A hand-written run folder (a summary, metrics that a
// resumed run appended to, evals, a skipped step, a failed checkpoint, a pipeline job, two
// rank traces with stage and step tracks) gives a chart per section with the series the
// files imply and the bubble the traces imply; missing files are said on the page; bad
// input exits 2 naming file:line. A real pipeline run under mpirun reports too, a real
// browser shows every chart (headless Chromium), --png writes a PNG, and 10,000 logged
// steps render in well under a second. The chart writer's ticks, thinning and escaping
// are tested on their own at the end.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "collectives/build_config.h"
#include "tools/chart/chart.h"
#include "tests/tools/spawn.h"

namespace fs = std::filesystem;
using nlohmann::json;
using tetra::testing_tools::Outcome;
using tetra::testing_tools::slurp;

namespace {

const std::string kReport = std::string(TETRA_BIN_DIR) + "/report";
const std::string kTrain = std::string(TETRA_BIN_DIR) + "/train";

fs::path fresh_dir(const std::string& name) {
  return tetra::testing_tools::fresh_dir("tetra_report", name);
}

Outcome report(const fs::path& dir, const std::vector<std::string>& args) {
  return tetra::testing_tools::run_tool(kReport, dir, args);
}

size_t count(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t at = hay.find(needle); at != std::string::npos;
       at = hay.find(needle, at + needle.size()))
    ++n;
  return n;
}

// <section id="ID"> ... </section> of the page ("" when there is none).
std::string section(const std::string& html, const std::string& id) {
  const size_t begin = html.find("<section id=\"" + id + "\"");
  if (begin == std::string::npos) return "";
  return html.substr(begin, html.find("</section>", begin) - begin);
}

// The d="..." of the element of class `cls` drawing series `name`.
std::string path_of(const std::string& html, const std::string& cls, const std::string& name) {
  const std::string head = "class=\"" + cls + "\" data-series=\"" + name + "\" d=\"";
  const size_t at = html.find(head);
  if (at == std::string::npos) return "";
  const size_t begin = at + head.size();
  return html.substr(begin, html.find('"', begin) - begin);
}

// The circles of the markers of series `name`.
size_t markers_of(const std::string& html, const std::string& name) {
  const size_t at = html.find("class=\"markers\" data-series=\"" + name + "\"");
  if (at == std::string::npos) return 0;
  return count(html.substr(at, html.find("</g>", at) - at), "<circle");
}

// ---- the hand-written run -------------------------------------------------------------

// A span of a rank's trace, in µs on that rank's own clock.
struct Span {
  std::string track, name;
  double begin, end;
};

// Two pipeline stages, two micro-batches: step 1 and step 2 on both ranks, step 3 on rank 0
// only (rank 1's trace ends mid-step: the report must not pick it).
const std::vector<std::vector<Span>>& fixture_spans() {
  // A step a line:
  // clang-format off
  static const std::vector<std::vector<Span>> ranks = {
      {{"step", "step 1", 0, 200}, {"stage 0", "F0", 0, 20}, {"stage 0", "wait recvG0", 20, 100},
       {"stage 0", "B0", 100, 150}, {"compute", "optimizer", 170, 200},
       {"step", "step 2", 1000, 1100}, {"stage 0", "F0", 1000, 1010}, {"stage 0", "F1", 1010, 1020},
       {"stage 0", "wait recvG1", 1020, 1050}, {"stage 0", "B1", 1050, 1070}, {"stage 0", "wait recvG0", 1070, 1075},
       {"stage 0", "B0", 1075, 1095},
       {"step", "step 3", 2000, 2100}, {"stage 0", "F0", 2000, 2010}},
      {{"step", "step 1", 10, 200}, {"stage 1", "wait recvA0", 10, 20}, {"stage 1", "F0", 20, 40},
       {"stage 1", "B0", 50, 100},
       {"step", "step 2", 1005, 1100}, {"stage 1", "wait recvA0", 1005, 1010}, {"stage 1", "F0", 1010, 1020},
       {"stage 1", "wait recvA1", 1020, 1022}, {"stage 1", "F1", 1022, 1032}, {"stage 1", "B1", 1032, 1052},
       {"stage 1", "B0", 1052, 1072}, {"compute", "optimizer", 1080, 1100}},
  };
  // clang-format on
  return ranks;
}

// Idle fraction of `rank`'s step `n`, worked out here from the spans above: 1 - (forward
// + backward inside the step) / the step (the spans of a stage never overlap).
double expected_idle(int rank, int n) {
  double begin = 0, end = 0, busy = 0;
  for (const Span& s : fixture_spans()[rank])
    if (s.name == "step " + std::to_string(n)) begin = s.begin, end = s.end;
  for (const Span& s : fixture_spans()[rank])
    if (s.track.rfind("stage", 0) == 0 && (s.name[0] == 'F' || s.name[0] == 'B'))
      busy += std::max(0.0, std::min(s.end, end) - std::max(s.begin, begin));
  return 1 - busy / (end - begin);
}

double expected_overall_idle(int n) {
  double span = 0, idle = 0;
  for (int r = 0; r < 2; ++r) {
    for (const Span& s : fixture_spans()[r])
      if (s.name == "step " + std::to_string(n)) {
        span += s.end - s.begin;
        idle += expected_idle(r, n) * (s.end - s.begin);
      }
  }
  return idle / span;
}

std::string pct(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100 * f);
  return buf;
}

// A trace as core::Trace writes it: its process, its clock, a thread per track.
void write_trace(const fs::path& file, int rank, double epoch_us) {
  json events = json::array();
  events.push_back({{"ph", "M"},
                    {"name", "process_name"},
                    {"pid", rank},
                    {"args", {{"name", "fixture rank " + std::to_string(rank)}}}});
  events.push_back(
      {{"ph", "M"}, {"name", "clock_sync"}, {"pid", rank}, {"args", {{"epoch_us", epoch_us}}}});
  std::vector<std::string> tracks;
  for (const Span& s : fixture_spans()[rank]) {
    auto it = std::find(tracks.begin(), tracks.end(), s.track);
    const size_t tid = it - tracks.begin();
    if (it == tracks.end()) {
      tracks.push_back(s.track);
      events.push_back({{"ph", "M"},
                        {"name", "thread_name"},
                        {"pid", rank},
                        {"tid", tid},
                        {"args", {{"name", s.track}}}});
    }
    events.push_back({{"ph", "X"},
                      {"name", s.name},
                      {"pid", rank},
                      {"tid", tid},
                      {"ts", s.begin},
                      {"dur", s.end - s.begin}});
  }
  std::ofstream(file) << json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

json state(double params) {
  return {{"parameters", params},
          {"gradients", params},
          {"optimizer", 2 * params},
          {"buffers", 0},
          {"total", 4 * params}};
}

json train_record(int step, double loss) {
  json r = {{"step", step},
            {"epoch", 0},
            {"loss", loss},
            {"lr", 0.01 * step},
            {"samples_per_s", 1000 + 10 * step},
            {"time_s", 0.5 * step},
            {"skipped_steps", 0},
            {"model_state_bytes", state(1 << 20)},
            {"grad_norm", 1 + 0.1 * step},
            {"peak_rss_bytes", 300 << 20},
            {"step_ms",
             {{"data", 0.5},
              {"forward", 2.0},
              {"backward", 4.0},
              {"gradients", 1.0},
              {"optimizer", 0.5}}},
            {"comm_ms", {{"pipeline", 0.3 + 0.01 * step}}},
            {"pipeline_bubble", 0.2},
            {"ranks", json::array({{{"model_state_bytes", 4 << 20},
                                    {"peak_rss_bytes", 300 << 20},
                                    {"pipeline_bubble", 0.2}},
                                   {{"model_state_bytes", 2 << 20},
                                    {"peak_rss_bytes", 280 << 20},
                                    {"pipeline_bubble", 0.3}}})}};
  if (std::isnan(loss)) {
    r["loss"] = nullptr;
    r["skipped"] = true;
    r.erase("grad_norm");
  }
  return r;
}

json eval_record(int step, double loss, double accuracy) {
  return {{"step", step},
          {"epoch", 0},
          {"eval", true},
          {"test_loss", loss},
          {"test_accuracy", accuracy},
          {"time_s", 0.5 * step}};
}

const char* const kFixtureJob =
    "# a comment the page must escape: <b>bold & \"quoted\"</b>\n"
    "name: fixture\n"
    "model: {type: mlp, hidden: [32, 32, 32]}\n"
    "data: {type: synthetic, batch_size: 32, train_samples: 256, test_samples: 64}\n"
    "optimizer: {type: sgd, lr: 0.01}\n"
    "train: {max_steps: 8, threads: 1}\n"
    "mesh: {pipeline: 2}\n"
    "pipeline: {schedule: gpipe, micro_batches: 4, balance: uniform}\n"
    "checkpoint: {dir: \"\"}\n";

// The run: steps 1-6 and evals at 3 and 6, then a run resumed from step 3's checkpoint
// appends steps 4-8 (step 5 skipped: loss null), evals at 6 and 8 and a failed checkpoint
// at 7. What counts: train 1-3 of the first run and 4-8 of the second, evals 3, 6 (the
// second's) and 8.
fs::path write_fixture(const std::string& name) {
  const fs::path d = fresh_dir(name);
  {
    std::ofstream m(d / "metrics.jsonl");
    for (int s = 1; s <= 6; ++s) {
      m << train_record(s, 2.0 - 0.1 * s).dump() << "\n";
      if (s == 3) m << eval_record(3, 1.9, 0.5).dump() << "\n";
    }
    m << eval_record(6, 1.7, 0.6).dump() << "\n";
    for (int s = 4; s <= 8; ++s) {
      m << train_record(s, s == 5 ? std::nan("") : 1.5 - 0.1 * s).dump() << "\n";
      if (s == 6) m << eval_record(6, 1.6, 0.65).dump() << "\n";
      if (s == 7)
        m << json{{"step", 7},
                  {"checkpoint_failures", 1},
                  {"checkpoint_error", "cannot write <disk & full>"}}
                 .dump()
          << "\n";
    }
    m << eval_record(8, 1.4, 0.7).dump() << "\n";
  }
  std::ofstream(d / "job.yaml") << kFixtureJob;
  write_trace(d / "trace.rank0.json", 0, 1.7e15);
  write_trace(d / "trace.rank1.json", 1, 1.7e15 + 5);
  json ranks = json::array();
  for (int r = 0; r < 2; ++r)
    ranks.push_back({{"rank", r},
                     {"host", "h" + std::to_string(r)},
                     {"model_state_bytes", state(r == 0 ? 1 << 20 : 1 << 19)},
                     {"peak_rss_bytes", (300 - 20 * r) << 20},
                     {"step_ms",
                      {{"data", 0.1},
                       {"forward", 1.2 + r},
                       {"backward", 2.3},
                       {"gradients", 0.5},
                       {"optimizer", 0.2}}},
                     {"comm_s", {{"pipeline", 0.7}}},
                     {"comm_ms", {{"pipeline", 3.5}}},
                     {"pipeline_bubble", 0.23}});
  const json summary = {{"job", "fixture"},
                        {"tetra", "0.9.0"},
                        {"commit", "aabba10"},
                        {"started", "2026-12-05T03:50:00Z"},
                        {"finished", "2026-12-05T03:51:10Z"},
                        {"world", 2},
                        {"replicas", 1},
                        {"mesh", {{"pipeline", 2}, {"data", 1}}},
                        {"metrics", fs::absolute(d / "metrics.jsonl").string()},
                        {"traces",
                         {fs::absolute(d / "trace.rank0.json").string(),
                          fs::absolute(d / "trace.rank1.json").string()}},
                        {"job_yaml", "job.yaml"},
                        {"steps", 5},
                        {"final_step", 8},
                        {"skipped_steps", 1},
                        {"train_seconds", 61.2},
                        {"total_seconds", 70.1},
                        {"samples_per_s", 1043.0},
                        {"final_loss", 0.7},
                        {"resumed_from", "ckpt/step-3"},
                        {"final_eval", {{"test_loss", 1.4}, {"test_accuracy", 0.7}}},
                        {"ranks", ranks}};
  std::ofstream(d / "summary.json") << summary.dump(2);
  return d;
}

std::string rsvg_convert() {
  for (const char* dir : {"/usr/bin", "/usr/local/bin", "/bin"}) {
    const std::string p = std::string(dir) + "/rsvg-convert";
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

// A tiny pipeline job on Fashion-MNIST, trained by `mpirun -np 2` into `d` (a few seconds),
// from d/tiny.yaml; train leaves job.yaml and summary.json in d, its log.dir.
void train_tiny_pipeline(const fs::path& d) {
  std::ofstream(d / "tiny.yaml")
      << "name: tiny\n"
         "model: {type: mlp, hidden: [64, 64, 64]}\n"
         "data: {type: fashion-mnist, batch_size: 64, eval_samples: 500}\n"
         "optimizer: {type: adamw, lr: 1.0e-3, clip_grad_norm: 1.0}\n"
         "train: {max_steps: 16, eval_every: 8, seed: 1, threads: 1}\n"
         "mesh: {pipeline: 2}\n"
         "pipeline: {schedule: 1f1b, micro_batches: 4, balance: uniform}\n"
         "checkpoint: {dir: \"\"}\n"
         "log: {every: 2, progress: off, metrics: "
      << (d / "metrics.jsonl").string() << ", trace: " << (d / "trace.json").string()
      << ", dir: " << d.string() << "}\n";
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  const Outcome t = tetra::testing_tools::run_tool(
      TETRA_MPIEXEC, d,
      {"--oversubscribe", "--bind-to", "none", "-np", "2", kTrain, (d / "tiny.yaml").string()});
  ASSERT_EQ(t.status, 0) << t.out << t.err;
  ASSERT_TRUE(fs::exists(d / "job.yaml") && fs::exists(d / "summary.json")) << "train wrote no run folder";
}

}  // namespace

TEST(Report, HandWrittenRunGivesEveryChartWithTheSeriesItsFilesImply) {
  const fs::path d = write_fixture("fixture");
  const Outcome o = report(d, {d.string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  EXPECT_NE(o.out.find("report: wrote " + (d / "report.html").string()), std::string::npos)
      << o.out;
  EXPECT_NE(
      o.out.find("run, loss, eval, lr, throughput, grad-norm, step-time, memory, pipeline, job"),
      std::string::npos)
      << o.out;
  EXPECT_EQ(o.out.find("missing"), std::string::npos) << o.out;
  const std::string html = slurp(d / "report.html");

  // Loss: train 1-4 of which 1-3 are the first run's, a gap at the skipped step 5, then
  // 6-8: two pieces, 7 points. Test loss at 3, 6 and 8. Rules at the resume and the failure.
  const std::string loss = section(html, "loss");
  EXPECT_EQ(count(loss, "<svg class=\"plot\""), 1u);
  const std::string train = path_of(loss, "line", "train loss");
  EXPECT_EQ(count(train, "M"), 2u) << train;
  EXPECT_EQ(count(train, "L"), 5u) << train;
  EXPECT_EQ(markers_of(loss, "test loss (eval)"), 3u);
  EXPECT_EQ(count(loss, "class=\"rule\""), 2u);
  EXPECT_NE(loss.find("resumed"), std::string::npos);
  EXPECT_NE(loss.find("cannot write &lt;disk &amp; full&gt;"), std::string::npos);
  EXPECT_NE(loss.find("1 logged step(s) skipped"), std::string::npos);

  const std::string eval = section(html, "eval");
  EXPECT_EQ(count(eval, "<svg class=\"plot\""), 1u);
  EXPECT_EQ(markers_of(eval, "test accuracy"), 3u);
  EXPECT_NE(eval.find(">70%<"), std::string::npos) << "the accuracy axis is in percent";
  for (const char* id : {"lr", "throughput", "grad-norm"}) {
    const std::string s = section(html, id);
    EXPECT_EQ(count(s, "<svg class=\"plot\""), 1u) << id;
    EXPECT_EQ(count(s, "class=\"line\""), 1u) << id;
  }
  EXPECT_EQ(count(path_of(section(html, "lr"), "line", "Learning rate"), "L"), 7u);
  EXPECT_EQ(count(path_of(section(html, "grad-norm"), "line", "Gradient norm (L2, before clipping)"), "M"), 2u)
      << "no grad_norm at the skipped step";

  // Time per step: five phases stacked, the pipeline axis's communication over them, and
  // summary.json's mean per rank.
  const std::string time = section(html, "step-time");
  EXPECT_EQ(count(time, "<svg class=\"plot\""), 1u);
  EXPECT_EQ(count(time, "class=\"layer\""), 5u);
  EXPECT_EQ(count(path_of(time, "line", "communication, pipeline axis"), "L"), 7u);
  EXPECT_NE(time.find("<td>1.20 ms</td>"), std::string::npos) << "rank 0's forward";
  EXPECT_NE(time.find("<td>2.20 ms</td>"), std::string::npos) << "rank 1's forward";
  EXPECT_NE(time.find("<th>comm pipeline</th>"), std::string::npos) << time;
  EXPECT_NE(time.find("<td>3.50 ms</td>"), std::string::npos) << "the pipeline axis's comm_ms per step";

  // Memory: per rank, measured (4 kinds), the estimate (5, pale) and peak RSS.
  const std::string mem = section(html, "memory");
  EXPECT_EQ(count(mem, "<svg class=\"plot\""), 1u);
  EXPECT_EQ(count(mem, "class=\"bar\""), 2u * (4 + 5 + 1)) << mem;
  EXPECT_EQ(count(mem, "class=\"bar\" fill-opacity=\"0.35\""), 2u * 5);
  EXPECT_EQ(mem.find("No estimate"), std::string::npos) << mem;
  EXPECT_NE(mem.find("<td>h1</td>"), std::string::npos);

  // The pipeline: step 2 (the last whole on both ranks), 6 blocks a rank, the idle
  // fractions the spans imply and the textbook's (p-1)/(m+p-1) for p=2, m=4; then the
  // trainer's bubble per logged interval, a line per rank.
  const std::string pipe = section(html, "pipeline");
  EXPECT_EQ(count(pipe, "<svg class=\"plot\""), 2u);
  EXPECT_EQ(count(pipe, "class=\"line\""), 2u);
  EXPECT_NE(pipe.find("Pipeline, step 2:"), std::string::npos);
  EXPECT_EQ(count(pipe, "class=\"block\""), 12u);
  EXPECT_EQ(count(pipe, "data-kind=\"forward\""), 4u);
  EXPECT_EQ(count(pipe, "data-kind=\"waiting for a neighbour\""), 4u);
  const std::regex row0("<td>rank 0, stage 0</td>(<td>[^<]*</td>){3}<td>" +
                        pct(expected_idle(0, 2)) + "</td>");
  const std::regex row1("<td>rank 1, stage 1</td>(<td>[^<]*</td>){3}<td>" +
                        pct(expected_idle(1, 2)) + "</td>");
  const std::regex all("<td>all pipeline ranks</td>(<td>[^<]*</td>){3}<td>" +
                       pct(expected_overall_idle(2)) + "</td>");
  EXPECT_TRUE(std::regex_search(pipe, row0)) << pct(expected_idle(0, 2)) << "\n" << pipe;
  EXPECT_TRUE(std::regex_search(pipe, row1)) << pct(expected_idle(1, 2)) << "\n" << pipe;
  EXPECT_TRUE(std::regex_search(pipe, all)) << pct(expected_overall_idle(2)) << "\n" << pipe;
  EXPECT_NE(pipe.find("(P-1)/(m+P-1) = 20.0%"), std::string::npos) << pipe;
  EXPECT_NE(pipe.find("Pipeline bubble per logged interval"), std::string::npos);

  // The job, escaped; the header from summary.json.
  const std::string job = section(html, "job");
  EXPECT_NE(job.find("&lt;b&gt;bold &amp; &quot;quoted&quot;&lt;/b&gt;"), std::string::npos) << job;
  EXPECT_EQ(html.find("<b>bold"), std::string::npos);
  const std::string run = section(html, "run");
  for (const char* want :
       {"0.9.0 (commit aabba10)", "2 processes, mesh data=1 x pipeline=2",
        "8 (5 this run), 1 skipped", "1043 samples/s", "ckpt/step-3", "accuracy 70.00%"})
    EXPECT_NE(run.find(want), std::string::npos) << want << "\n" << run;
  EXPECT_EQ(html.find("<script"), std::string::npos);
}

TEST(Report, StepPicksThePipelineStepAndOneNotOnEveryRankIsExit2) {
  const fs::path d = write_fixture("step");
  const Outcome one = report(d, {d.string(), "--step", "1", "--no-estimate"});
  ASSERT_EQ(one.status, 0) << one.out << one.err;
  const std::string pipe = section(slurp(d / "report.html"), "pipeline");
  EXPECT_NE(pipe.find("Pipeline, step 1:"), std::string::npos);
  EXPECT_EQ(count(pipe, "class=\"block\""), 6u);
  EXPECT_TRUE(std::regex_search(pipe, std::regex("<td>rank 1, stage 1</td>(<td>[^<]*</td>){3}<td>" +
                                                 pct(expected_idle(1, 1)) + "</td>")))
      << pipe;
  const Outcome three = report(d, {d.string(), "--step", "3"});
  EXPECT_EQ(three.status, 2) << three.out << three.err;
  EXPECT_NE(three.err.find("--step 3: not whole on every pipeline rank"), std::string::npos)
      << three.err;
}

TEST(Report, MissingFilesAreSaidOnThePage) {
  const fs::path d = fresh_dir("missing");
  std::ofstream(d / "metrics.jsonl") << R"({"step": 10, "loss": 2.0, "lr": 0.1})"
                                        "\n"
                                        R"({"step": 20, "loss": 1.5, "lr": 0.1})"
                                        "\n";
  const Outcome o = report(d, {d.string(), "-o", (d / "r.html").string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  EXPECT_NE(o.out.find("missing: eval, throughput, grad-norm, step-time, memory, pipeline, job"),
            std::string::npos)
      << o.out;
  const std::string html = slurp(d / "r.html");
  EXPECT_NE(section(html, "run").find("No summary.json: the run did not finish"),
            std::string::npos);
  EXPECT_NE(section(html, "pipeline").find("no trace: set log.trace to see the pipeline timeline"),
            std::string::npos);
  EXPECT_NE(section(html, "job").find("no job.yaml in"), std::string::npos);
  EXPECT_NE(section(html, "step-time").find("no step_ms"), std::string::npos);
  EXPECT_NE(section(html, "memory").find("no memory"), std::string::npos);
  for (const char* id :
       {"eval", "throughput", "grad-norm", "step-time", "memory", "pipeline", "job"}) {
    EXPECT_EQ(count(section(html, id), "<svg"), 0u)
        << id << ": an empty chart instead of a line saying why";
    EXPECT_EQ(count(section(html, id), "class=\"missing\""), 1u) << id;
  }
  EXPECT_EQ(count(section(html, "loss"), "<svg class=\"plot\""), 1u);
}

TEST(Report, BadInputExits2NamingTheFileAndLine) {
  const fs::path d = fresh_dir("bad");
  const fs::path metrics = d / "metrics.jsonl";
  std::ofstream(metrics) << R"({"step": 1, "loss": 2.0})"
                            "\n"
                            R"({"step": 2, "loss": 1.9})"
                            "\n{not json\n";
  Outcome o = report(d, {d.string()});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find(metrics.string() + ":3: not JSON"), std::string::npos) << o.err;
  std::ofstream(metrics) << "{\"step\": 1, \"loss\": 2.0}\n[1, 2]\n";
  o = report(d, {d.string()});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find(metrics.string() + ":2: not a JSON object"), std::string::npos) << o.err;
  // Records of kinds it does not know are left out (and said), not an error; none it knows is.
  std::ofstream(metrics) << "{\"loss\": 2.0}\n{\"step\": 1, \"what\": \"a later kind\"}\n";
  o = report(d, {d.string()});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find("no train or eval records (2 records"), std::string::npos) << o.err;
  std::ofstream(metrics, std::ios::app) << "{\"step\": 2, \"loss\": 1.0}\n";
  o = report(d, {d.string()});
  EXPECT_EQ(o.status, 0) << o.out << o.err;
  EXPECT_NE(slurp(d / "report.html").find("2 of the 3 records in"), std::string::npos);
  std::ofstream(metrics) << "\n";
  o = report(d, {d.string()});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find("no train or eval records"), std::string::npos) << o.err;
  fs::remove(metrics);
  o = report(d, {d.string()});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find("no metrics"), std::string::npos) << o.err;
  o = report(d, {(d / "nowhere").string()});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find((d / "nowhere").string() + ": no such folder"), std::string::npos) << o.err;
  std::ofstream(d / "summary.json") << "{\"job\": ";
  o = report(d, {d.string()});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find((d / "summary.json").string() + ": not JSON"), std::string::npos) << o.err;
  EXPECT_EQ(o.err.find("terminate"), std::string::npos) << o.err;
}

TEST(Report, RealPipelineRunUnderMpirun) {
  const fs::path d = fresh_dir("real");
  train_tiny_pipeline(d);
  const Outcome o = report(d, {d.string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  EXPECT_NE(
      o.out.find("run, loss, eval, lr, throughput, grad-norm, step-time, memory, pipeline, job"),
      std::string::npos)
      << o.out;
  const std::string html = slurp(d / "report.html");
  // What train itself left: its summary, its job.yaml, and a "step" span per step.
  EXPECT_EQ(html.find("No summary.json"), std::string::npos);
  EXPECT_EQ(html.find("no job.yaml in"), std::string::npos);
  EXPECT_EQ(html.find("have no \"step\" track"), std::string::npos);
  EXPECT_NE(section(html, "job").find("name: tiny"), std::string::npos);
  EXPECT_EQ(count(path_of(section(html, "loss"), "line", "train loss"), "L"), 7u)
      << "steps 2, 4, ..., 16";
  EXPECT_EQ(markers_of(section(html, "loss"), "test loss (eval)"), 2u) << "evals at 8 and 16";
  const std::string pipe = section(html, "pipeline");
  EXPECT_GE(count(pipe, "<svg class=\"plot\""), 1u) << pipe;
  EXPECT_EQ(count(pipe, "data-kind=\"forward\""), 8u) << "4 micro-batches on each of 2 stages";
  EXPECT_EQ(count(pipe, "data-kind=\"backward\""), 8u);
  EXPECT_NE(pipe.find("(P-1)/(m+P-1) = 20.0%"), std::string::npos) << pipe;
  EXPECT_EQ(count(section(html, "memory"), "class=\"bar\" fill-opacity=\"0.35\""), 2u * 5)
      << "both ranks' estimates";
}

// Issue 48, item 7: the estimate is per process, the run's ranks are processes x replica
// threads: each replica is set against its process's estimate (before: rank 1 of a
// process of two replicas had none, and in a 4D run ranks 2-3 got stage 1's).
TEST(Report, EachReplicaIsSetAgainstItsProcesssEstimate) {
  const fs::path d = fresh_dir("replicas");
  std::ofstream(d / "rep.yaml") << "name: rep\n"
                                   "model: {type: mlp, hidden: [32]}\n"
                                   "data: {type: synthetic, batch_size: 32, train_samples: 256, test_samples: 64}\n"
                                   "train: {max_steps: 4, seed: 1, threads: 1}\n"
                                   "replicate: {replicas: 2}\n"
                                   "checkpoint: {dir: \"\"}\n"
                                   "log: {every: 2, progress: off, dir: "
                                << d.string() << "}\n";
  const Outcome t = tetra::testing_tools::run_tool(kTrain, d, {(d / "rep.yaml").string()});
  ASSERT_EQ(t.status, 0) << t.out << t.err;
  const Outcome o = report(d, {d.string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  const std::string memory = section(slurp(d / "report.html"), "memory");
  EXPECT_EQ(count(memory, "class=\"bar\" fill-opacity=\"0.35\""), 2u * 5) << "both replicas' estimates";
}

// Headless Chromium through chromedriver (tests/tools/report_browser_check.py): no
// console errors, every chart shown and not blank, no text cut off, nothing from
// elsewhere; the screenshots stay in the build folder to be looked at.
TEST(Report, ABrowserShowsEveryChart) {
  for (const char* need : {"/usr/bin/chromium", "/usr/bin/chromedriver"})
    if (::access(need, X_OK) != 0)
      GTEST_SKIP() << "no " << need << " (Debian's chromium and chromium-driver)";
  if (std::system("/usr/bin/python3 -c 'import selenium, PIL' >/dev/null 2>&1") != 0)
    GTEST_SKIP()
        << "no selenium or PIL for /usr/bin/python3 (Debian's python3-selenium and python3-pil)";
  const fs::path d = fresh_dir("browser");
  train_tiny_pipeline(d);
  Outcome o = report(d, {d.string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  const fs::path fixture = write_fixture("browser_fixture");
  o = report(fixture, {fixture.string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  const fs::path shots = TETRA_TEST_OUTPUT_DIR;
  const std::string cmd = "/usr/bin/python3 " + std::string(TETRA_SOURCE_DIR) +
                          "/tests/tools/report_browser_check.py " + (d / "report.html").string() +
                          " " + (shots / "report-screenshot.png").string() + " 8 " +
                          (fixture / "report.html").string() + " " +
                          (shots / "report-fixture-screenshot.png").string() + " 9 >" +
                          (d / "browser.txt").string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  const std::string said = slurp(d / "browser.txt");
  if (WIFEXITED(rc) && WEXITSTATUS(rc) == 77) GTEST_SKIP() << said;
  EXPECT_EQ(rc, 0) << said;
  std::cout << said;
}

TEST(Report, PngIsOneValidPictureOfEveryChart) {
  const fs::path d = write_fixture("png");
  const fs::path png = d / "report.png";
  if (rsvg_convert().empty()) {
    GTEST_SKIP() << "no rsvg-convert (Debian's librsvg2-bin)";
  }
  Outcome o = report(d, {d.string(), "--png", png.string(), "--no-estimate"});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  const std::string bytes = slurp(png);
  ASSERT_GT(bytes.size(), 24u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(bytes.substr(12, 4), "IHDR");
  auto be32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<unsigned char>(bytes[at + i]);
    return v;
  };
  EXPECT_EQ(be32(16), 1152u) << "the widest chart (1120) and its margins";
  EXPECT_GT(be32(20), 1500u) << "every chart, one under another or two abreast";
  EXPECT_NE(o.out.find(png.string()), std::string::npos) << o.out;
  EXPECT_FALSE(fs::exists(png.string() + ".svg.tmp"));

  // Without rsvg-convert on PATH: exit 2 naming the package.
  const pid_t pid =
      tetra::testing_tools::spawn_tool(kReport, {d.string(), "--png", (d / "x.png").string()},
                                       d / "out.txt", d / "err.txt", {"PATH=/nonexistent"});
  EXPECT_EQ(tetra::testing_tools::wait_status(pid), 2);
  EXPECT_NE(slurp(d / "err.txt").find("librsvg2-bin"), std::string::npos) << slurp(d / "err.txt");
}

// 10,000 steps logged every step: the page is written in well under a second, each
// series is drawn from at most about 1000 points, and a one-step spike survives.
TEST(Report, TenThousandStepsRenderFastAndKeepTheirSpikes) {
  const fs::path d = fresh_dir("big");
  {
    std::ofstream m(d / "metrics.jsonl");
    for (int s = 1; s <= 10000; ++s) {
      json r = train_record(s, s == 7777 ? 50.0 : 2.0 / std::sqrt(s) + 0.01 * std::sin(s));
      r["lr"] = 1e-3 * std::min(1.0, s / 500.0);
      m << r.dump() << "\n";
      if (s % 1000 == 0) m << eval_record(s, 1.0 / std::sqrt(s), 0.8).dump() << "\n";
    }
  }
  const Outcome o = report(d, {d.string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      o.out, m, std::regex("read ([0-9.]+) s, estimate [0-9.]+ s, render ([0-9.]+) s")))
      << o.out;
  const double read = std::stod(m[1]), render = std::stod(m[2]);
  std::cout << "10,000 steps: " << o.out;
  RecordProperty("read_s", std::to_string(read));
  RecordProperty("render_s", std::to_string(render));
  EXPECT_LT(render, 1.0);
  const std::string html = slurp(d / "report.html");
  EXPECT_LT(html.size(), 2u << 20);
  const std::string loss = path_of(section(html, "loss"), "line", "train loss");
  const size_t points = count(loss, "L") + count(loss, "M");
  EXPECT_LE(points, 1002u);
  EXPECT_GE(points, 900u);
  // The spike: one point far above every other (smaller y is higher).
  std::vector<double> ys;
  const std::regex xy("[ML]([0-9.]+) ([0-9.]+)");
  for (auto it = std::sregex_iterator(loss.begin(), loss.end(), xy); it != std::sregex_iterator();
       ++it)
    ys.push_back(std::stod((*it)[2]));
  ASSERT_GE(ys.size(), 2u);
  std::sort(ys.begin(), ys.end());
  EXPECT_LT(ys[0], ys[1] - 100) << "the spike at step 7777 was lost";
}

// The chart writer's pieces on their own (tools/chart/chart.h).
TEST(Chart, TicksAreNiceInHumanUnits) {
  namespace chart = tetra::chart;
  using chart::Unit;
  auto texts = [](const chart::Ticks& t) {
    std::vector<std::string> out;
    for (double v : t.at) out.push_back(chart::tick_text(v, t));
    return out;
  };
  EXPECT_EQ(texts(chart::nice_ticks(0, 0.93, Unit::kNumber, 6)),
            (std::vector<std::string>{"0", "0.2", "0.4", "0.6", "0.8", "1.0"}));
  EXPECT_EQ(texts(chart::nice_ticks(0, 2e-4, Unit::kNumber, 5)),
            (std::vector<std::string>{"0", "5e-5", "1e-4", "1.5e-4", "2e-4"}));
  EXPECT_EQ(texts(chart::nice_ticks(0, 31000, Unit::kNumber, 4)),
            (std::vector<std::string>{"0", "10k", "20k", "30k", "40k"}));
  EXPECT_EQ(texts(chart::nice_ticks(0, 3.1 * (1 << 30), Unit::kBytes, 4)),
            (std::vector<std::string>{"0", "1 GiB", "2 GiB", "3 GiB", "4 GiB"}));
  EXPECT_EQ(texts(chart::nice_ticks(0, 2400, Unit::kMilliseconds, 3)),
            (std::vector<std::string>{"0", "1 s", "2 s", "3 s"}));
  EXPECT_EQ(texts(chart::nice_ticks(0, 0.09, Unit::kMilliseconds, 4)),
            (std::vector<std::string>{"0", "50 \xc2\xb5s", "100 \xc2\xb5s"}));
  EXPECT_EQ(texts(chart::nice_ticks(18, 22, Unit::kNumber, 8, true)).front(), "18")
      << "steps are whole";
  EXPECT_EQ(chart::nice_ticks(18, 22, Unit::kNumber, 8, true).step, 1.0);
  EXPECT_EQ(chart::human(1536.0 * 1024, Unit::kBytes), "1.50 MiB");
  EXPECT_EQ(chart::human(41.54, Unit::kMilliseconds), "41.5 ms");
  const chart::Ticks one =
      chart::nice_ticks(5, 5, Unit::kNumber);  // a single value still gets a scale
  EXPECT_LT(one.lo, 5);
  EXPECT_GT(one.hi, 5);
}

TEST(Chart, ManyPointsKeepEachBucketsExtremesAndGaps) {
  namespace chart = tetra::chart;
  std::vector<double> y(100000, 1.0);
  y[12345] = 100;           // a spike
  y[54321] = -100;          // a dip
  y[77777] = std::nan("");  // a skipped step
  const std::vector<size_t> kept = chart::keep_extremes(y);
  EXPECT_LE(kept.size(), chart::kMaxPoints + 2);
  EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
  for (size_t want : {size_t{0}, size_t{12345}, size_t{54321}, size_t{77777}, y.size() - 1})
    EXPECT_TRUE(std::binary_search(kept.begin(), kept.end(), want)) << want;
  EXPECT_EQ(chart::keep_extremes(std::vector<double>(10, 0.0)).size(), 10u);
}

TEST(Chart, TextIsEscapedAndTheComposedSvgIsOneDocument) {
  namespace chart = tetra::chart;
  EXPECT_EQ(chart::escape("a<b & \"c\" 'd'>\x01"),
            "a&lt;b &amp; &quot;c&quot; &#39;d&#39;&gt;\xef\xbf\xbd");
  chart::Frame f;
  f.title = "<loss & more>";
  f.x = {"step", chart::Unit::kNumber, false, true};
  f.y = {"loss", chart::Unit::kNumber, false};
  const chart::Chart c =
      chart::line_chart(f, {{"<train>", {1, 2, 3}, {3, 2, 1}, "", true, false, false}});
  EXPECT_EQ(c.body.find("<loss"), std::string::npos);
  EXPECT_NE(c.body.find("&lt;loss &amp; more&gt;"), std::string::npos);
  EXPECT_NE(c.svg().find("<svg class=\"plot\" viewBox=\"0 0 880 280\""), std::string::npos);
  const std::string doc = chart::compose("run", {c, c});
  EXPECT_EQ(count(doc, "xmlns=\"http://www.w3.org/2000/svg\""), 1u);
  EXPECT_EQ(count(doc, "<svg x="), 2u);
}

// Issue 33, item 7: a y-axis label longer than a short chart's plot ran up into its
// legend; it now shrinks to the plot's height (down to 9 px).
TEST(Chart, ALongYLabelStaysBesideItsPlot) {
  namespace chart = tetra::chart;
  chart::Frame f;
  f.title = "Gradient norm";
  f.width = 430;
  f.height = 200;
  f.x = {"step", chart::Unit::kNumber, false, true};
  f.y = {"gradient norm (L2, before clipping)", chart::Unit::kNumber, false};
  const chart::Chart c = chart::line_chart(f, {{"a series", {1, 2, 3}, {3, 2, 1}, "", true, false, false}});
  // Each line of it (two, here) no longer than the plot is high, at the size it is drawn.
  const std::regex label("rotate\\(-90\\)\" text-anchor=\"middle\" font-size=\"([0-9.]+)\">([^<]*)</text>");
  const std::regex plot("<rect x=\"[0-9.]+\" y=\"([0-9.]+)\" width=\"[0-9.]+\" height=\"([0-9.]+)\" fill=\"none\"");
  std::smatch p;
  ASSERT_TRUE(std::regex_search(c.body, p, plot)) << c.body;
  const double plot_height = std::stod(p[2].str());
  size_t lines = 0;
  for (auto it = std::sregex_iterator(c.body.begin(), c.body.end(), label); it != std::sregex_iterator(); ++it) {
    const double size = std::stod((*it)[1].str());
    EXPECT_GE(size, 9);
    // chart.cpp's layout measure: 0.6 em a character.
    EXPECT_LE(0.6 * size * static_cast<double>((*it)[2].length()), plot_height) << (*it)[2].str();
    ++lines;
  }
  EXPECT_EQ(lines, 2u) << c.body;
  // A short label keeps the chart's font.
  f.y.label = "loss";
  EXPECT_EQ(chart::line_chart(f, {{"a", {1, 2}, {2, 1}, "", true, false, false}}).body.find("font-size=\"9"),
            std::string::npos);
}
