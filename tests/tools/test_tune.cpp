// The tuner (tetra/tune.h, Note [Tuner]): what it enumerates against an independent
// enumeration of layouts, memory pruning against the dry run's estimate, trials in the
// cost model's order, failed trials recorded and passed over; and `train --tune` as a user
// runs it, from a poorly chosen job to one that `train --check` accepts and mpirun runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "collectives/build_config.h"
#include "core/job_file.h"
#include "core/model_plan.h"
#include "spawn.h"
#include "tetra/run.h"
#include "tetra/tetra.h"
#include "tetra/tune.h"

namespace {

namespace fs = std::filesystem;
using namespace tetra;
using namespace tetra::testing_tools;

const std::string kTrain = std::string(TETRA_BIN_DIR) + "/train";

// A small GPT (4 heads: no tensor split of 8), whose batch of 32 splits over 16 data ranks.
fs::path gpt_job(const fs::path& dir) {
  const fs::path p = dir / "gpt.yaml";
  std::ofstream(p) << "name: tune_gpt\n"
                      "model: {type: gpt, layers: 4, heads: 4, d_model: 32}\n"
                      "data: {type: text, path: /usr/share/common-licenses/GPL-3, seq_len: 16, batch_size: 32, "
                      "eval_samples: 32}\n"
                      "optimizer: {type: sgd, lr: 0.05}\n"
                      "train: {max_steps: 20, seed: 1, threads: 1}\n"
                      "checkpoint: {dir: \"\"}\n"
                      "log: {dir: " << (dir / "run").string() << ", progress: off}\n";
  return p;
}

// The quickstart MLP, poorly laid out for 2 ranks: ZeRO-3 with 0.05 MB buckets and no prefetch.
fs::path poor_job(const fs::path& dir) {
  const fs::path p = dir / "poor.yaml";
  std::ofstream(p) << "name: poor\n"
                      "model: {type: mlp, hidden: [1024, 1024]}\n"
                      "data: {type: fashion-mnist, batch_size: 128}\n"
                      "optimizer: {type: adamw, lr: 1.0e-3, weight_decay: 0.01}\n"
                      "train: {epochs: 1, seed: 1, threads: 2}\n"
                      "mesh: {data: 2}\n"
                      "zero: {stage: 3, bucket_mb: 0.05, prefetch: 0}\n"
                      "checkpoint: {dir: \"\"}\n"
                      "log: {dir: " << (dir / "run").string() << ", progress: off}\n";
  return p;
}

// A layout: data, pipeline, tensor, replicas.
using Layout = std::tuple<int, int, int, int>;

Layout layout_of(const core::JobSpec& spec) {
  const core::Plan plan(spec);
  return {spec.mesh.size("data"), spec.mesh.size("pipeline"), spec.mesh.size("tensor"), plan.replicas()};
}

core::SectionRegistry& registry() {
  static core::SectionRegistry r = [] {
    core::SectionRegistry x;
    register_builtin_plugins(x);
    return x;
  }();
  return r;
}

// What `train --check` asks of a job (but its paths, which are the base job's): its
// parse, the plan's rules, the world, the model's rules on its shapes.
std::string check_problem(const std::string& yaml, int np) {
  try {
    core::ParsedJob parsed =
        core::parse_job_string(yaml, "candidate", {}, registry(), {}, core::JobWorld{np, "--np " + std::to_string(np)});
    const core::Plan plan(parsed.spec);
    plan.check_world(np, "--np " + std::to_string(np));
    core::ModelPlan(parsed.spec).check();
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

TEST(Tune, EnumerationCoversEveryValidLayoutAndNoInvalidOne) {
  const fs::path dir = fresh_dir("tune", "enumerate");
  const fs::path job = gpt_job(dir);
  for (int n : {1, 2, 4, 8}) {
    SCOPED_TRACE("np " + std::to_string(n));
    TuneOptions o;
    o.job = job.string();
    o.np = n;
    int rejected = 0;
    const std::vector<Candidate> cs = enumerate_candidates(o, &rejected);
    ASSERT_FALSE(cs.empty());
    std::set<Layout> found;
    std::set<std::string> structures;
    for (const Candidate& c : cs) {
      found.insert(layout_of(c.spec));
      // Every structure is checked in full; a refinement differs from its structure by a
      // bucket size, hierarchy or prefetch, which the plan's rules see without the model.
      if (c.refinement) {
        core::ParsedJob parsed = core::parse_job_string(c.yaml, "candidate", {}, registry());
        EXPECT_NO_THROW(core::Plan(parsed.spec).check_world(n, "np")) << c.label;
      } else {
        EXPECT_EQ(check_problem(c.yaml, n), "") << c.label;
        structures.insert(c.structure);
      }
    }
    // Independently: every data x pipeline x tensor = n, with 1 or 2 replicas, is either a
    // valid job (then the tuner has it) or one `train --check` rejects (then it has not).
    for (int t = 1; t <= n; ++t)
      for (int p = 1; p <= n; ++p)
        for (int r : {1, 2}) {
          if (n % (t * p)) continue;
          const int d = n / (t * p);
          std::string yaml = "name: layout\nmodel: {type: gpt, layers: 4, heads: 4, d_model: 32}\n"
                             "data: {type: text, path: /usr/share/common-licenses/GPL-3, seq_len: 16, batch_size: 32}\n"
                             "optimizer: {type: sgd, lr: 0.05}\ntrain: {max_steps: 20, seed: 1, threads: 1}\n"
                             "checkpoint: {dir: \"\"}\nlog: {dir: \"\"}\n";
          yaml += "mesh: {data: " + std::to_string(d) + ", pipeline: " + std::to_string(p) +
                  ", tensor: " + std::to_string(t) + "}\n";
          if (p > 1) yaml += "pipeline: {micro_batches: " + std::to_string(p) + "}\n";
          if (r > 1) yaml += "replicate: {replicas: " + std::to_string(r) + "}\n";
          const bool valid = check_problem(yaml, n).empty();
          const bool listed = found.count({d, p, t, r}) > 0;
          EXPECT_EQ(valid, listed) << "data " << d << " pipeline " << p << " tensor " << t << " replicas " << r << ": "
                                   << check_problem(yaml, n);
        }
    if (n == 8) {
      // 4 heads: no tensor split of 8, which the rules turned down.
      EXPECT_EQ(found.count({1, 1, 8, 1}), 0u);
      EXPECT_GT(rejected, 0);
    }
    if (n == 4) {
      // Every knob is there: the ZeRO stages, the schedules and micro-batch counts.
      std::set<std::string> seen;
      for (const Candidate& c : cs) {
        for (const char* key : {"zero.stage", "pipeline.schedule", "pipeline.micro_batches", "zero.bucket_mb",
                                "data_parallel.bucket_mb", "zero.prefetch"}) {
          auto it = c.keys.find(key);
          if (it != c.keys.end()) seen.insert(std::string(key) + "=" + it->second);
        }
      }
      for (const char* want : {"zero.stage=1", "zero.stage=2", "zero.stage=3", "pipeline.schedule=gpipe",
                               "pipeline.schedule=1f1b", "pipeline.schedule=interleaved_1f1b", "pipeline.schedule=zbh1",
                               "pipeline.schedule=zbv", "pipeline.micro_batches=2", "pipeline.micro_batches=8",
                               "data_parallel.bucket_mb=1", "data_parallel.bucket_mb=25", "zero.bucket_mb=4",
                               "zero.prefetch=2"})
        EXPECT_TRUE(seen.count(want)) << want;
    }
  }
}

// data_parallel.hierarchical on stops a run whose data groups do not fit their hosts
// (Note [One host map]): the tuner offers "on" only where every data group has the same
// number (> 1) of its ranks on each of several hosts.
TEST(Tune, NoHierarchyThatTheHostsDoNotFit) {
  const fs::path dir = fresh_dir("tune", "hierarchy");
  const fs::path job = gpt_job(dir);
  auto on_layouts = [&](int ranks_per_host) {
    TuneOptions o;
    o.job = job.string();
    o.np = 4;
    o.ranks_per_host = ranks_per_host;
    std::set<Layout> found;
    for (const Candidate& c : enumerate_candidates(o)) {
      const auto h = c.keys.find("data_parallel.hierarchical");
      // (Under one data process, with replicas, data_parallel reduces nothing across hosts.)
      if (h != c.keys.end() && h->second == "on" && std::get<0>(layout_of(c.spec)) > 1)
        found.insert(layout_of(c.spec));
    }
    return found;
  };
  // Hosts of 2: data 4 fits (2 + 2); data 2 x pipeline 2 keeps each data group on one host.
  for (const Layout& l : on_layouts(2)) EXPECT_EQ(std::get<0>(l), 4);
  EXPECT_EQ(on_layouts(2).count({4, 1, 1, 1}), 1u);
  // Hosts of 3 and 1: no data group fits.
  EXPECT_TRUE(on_layouts(3).empty());
}

TEST(Tune, CandidatesPassTrainCheckAsFiles) {
  // One structure of each layout of 4 processes, written out and checked by `train --check`.
  const fs::path dir = fresh_dir("tune", "check_files");
  TuneOptions o;
  o.job = gpt_job(dir).string();
  o.np = 4;
  std::set<Layout> done;
  int checked = 0;
  for (const Candidate& c : enumerate_candidates(o)) {
    if (c.refinement || !done.insert(layout_of(c.spec)).second) continue;
    const fs::path f = dir / ("candidate-" + std::to_string(checked++) + ".yaml");
    std::ofstream(f) << c.yaml;
    const Outcome r = run_tool(kTrain, dir, {f.string(), "--check"});
    EXPECT_EQ(r.status, 0) << c.label << "\n" << r.err;
  }
  EXPECT_GE(checked, 5);  // data 4; pipeline 2 x data 2; pipeline 4; tensor 2 x data 2; ...
}

TEST(Tune, MemoryPruningDropsExactlyTheCandidatesOverTheLimit) {
  const fs::path dir = fresh_dir("tune", "memory");
  TuneOptions o;
  o.job = gpt_job(dir).string();
  o.np = 2;
  o.dry_run = true;
  o.progress = nullptr;
  o.output = (dir / "paper.yaml").string();
  const TuneResult all = tune(o);
  std::vector<int64_t> sizes;
  for (const Candidate& c : all.candidates)
    if (c.priced && c.invalid.empty()) sizes.push_back(c.predicted_bytes);
  ASSERT_GT(sizes.size(), 10u);
  std::sort(sizes.begin(), sizes.end());
  const int64_t limit = sizes[sizes.size() / 2];
  ASSERT_LT(sizes.front(), limit);
  ASSERT_LT(limit, sizes.back());
  o.memory_gb = double(limit) / double(int64_t{1} << 30);
  const TuneResult r = tune(o);
  ASSERT_NEAR(double(r.memory_limit), double(limit), 1.0);
  int pruned = 0, kept = 0;
  for (const Candidate& c : r.candidates) {
    if (!c.priced || !c.invalid.empty()) continue;
    EXPECT_EQ(!c.pruned.empty(), c.predicted_bytes > r.memory_limit) << c.label << " " << c.predicted_bytes;
    (c.pruned.empty() ? kept : pruned)++;
  }
  EXPECT_GT(pruned, 0);
  EXPECT_GT(kept, 0);
  const Candidate& chosen = r.candidates[static_cast<size_t>(r.chosen)];
  EXPECT_LE(chosen.predicted_bytes, r.memory_limit);
  // The estimate is the dry run's: its largest rank's state and activations, per process.
  for (const Candidate* c : {&chosen, &r.candidates.front()}) {
    DryRunOptions how;
    how.np = 2;
    const PlanReport rep = plan_report(c->spec, {}, how);
    int64_t most = 0;
    for (const auto& e : rep.estimates) most = std::max(most, e.state.total() + e.activations);
    EXPECT_EQ(c->predicted_bytes, most * rep.plan.replicas()) << c->label;
  }
}

// The options of a search driven by hooks: the small GPT as given for 2 processes
// (measured first), `trials` more, no second rounds, nothing printed.
TuneOptions hooked_options(const fs::path& dir, int trials) {
  TuneOptions o;
  o.job = gpt_job(dir).string();
  o.sets = {"mesh.data=2"};
  o.np = 2;
  o.trials = trials;
  o.confirm = 0;
  o.progress = nullptr;
  o.output = (dir / "tuned.yaml").string();
  return o;
}

// A cost model of the test's own: predicted steps at least 1% apart (beyond the tuner's
// 0.5% tie), in an order that has nothing to do with the layout.
void fake_price(Candidate& c) {
  const size_t h = std::hash<std::string>{}(c.label);
  c.predicted_s = 0.010 * std::pow(1.01, double(h % 1000));
  c.predicted_bytes = 1000;
}

TEST(Tune, TrialsFollowTheCostModelsOrder) {
  const fs::path dir = fresh_dir("tune", "order");
  TuneOptions o = hooked_options(dir, 4);
  std::vector<std::string> ran;
  TuneHooks hooks;
  hooks.price = fake_price;
  hooks.trial = [&](Candidate& c, double) {
    ran.push_back(c.label);
    c.trial = Candidate::Trial::kOk;
    c.measured_s = 1.0 - c.predicted_s;  // the measurement disagrees: the slowest predicted is fastest
  };
  const TuneResult r = tune(o, hooks);
  // Expected: the job as given, then the cheapest by the fake model, one per structure.
  std::vector<const Candidate*> sorted;
  for (const Candidate& c : r.candidates)
    if (!c.as_given && c.priced) sorted.push_back(&c);
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const Candidate* a, const Candidate* b) { return a->predicted_s < b->predicted_s; });
  ASSERT_TRUE(r.candidates.front().as_given);
  std::vector<std::string> want = {r.candidates.front().label};
  std::set<std::string> structures;
  for (const Candidate* c : sorted)
    if (want.size() < 5 && structures.insert(c->structure).second) want.push_back(c->label);
  EXPECT_EQ(ran, want);
  // The answer is the fastest measured, not the best predicted.
  double fastest = 1e9;
  for (const Candidate& c : r.candidates)
    if (c.trial == Candidate::Trial::kOk) fastest = std::min(fastest, c.measured_s);
  EXPECT_EQ(r.candidates[static_cast<size_t>(r.chosen)].measured_s, fastest);
  EXPECT_LT(r.correlation, 0);  // measured against predicted: the wrong way round
  const std::string written = slurp(r.written);
  EXPECT_EQ(written.rfind("# Chosen by `train ", 0), 0u) << written.substr(0, 300);
  EXPECT_NE(written.find("rank correlation"), std::string::npos);
  EXPECT_NE(written.find("\nname: tune_gpt-tuned\n"), std::string::npos);  // a run of its own
}

// Issue 48, item 6: the tuner chose ZeRO-1 on one noisy measurement (28.0 ms, then 14.0).
// Every finalist, and the job as given, is measured twice at least; two rounds more than
// 10% apart get a third; the table shows each trial's rounds and spread.
TEST(Tune, EveryFinalistIsMeasuredTwiceAndAThirdTimeWhenTwoRoundsDisagree) {
  const fs::path dir = fresh_dir("tune", "rounds");
  TuneOptions o = hooked_options(dir, 3);
  o.confirm = 3;
  std::map<std::string, int> calls;
  TuneHooks hooks;
  hooks.price = fake_price;
  std::string noisy;  // the first measured after the job as given: its second round is 30% slower
  hooks.trial = [&](Candidate& c, double) {
    const int n = calls[c.label]++;
    if (!c.as_given && noisy.empty()) noisy = c.label;
    c.trial = Candidate::Trial::kOk;
    c.measured_s = c.predicted_s * (c.label == noisy && n == 1 ? 1.3 : 1.0);
  };
  const TuneResult r = tune(o, hooks);
  ASSERT_FALSE(noisy.empty());
  // The finalists: the three fastest first rounds, and the job as given.
  std::vector<const Candidate*> ok;
  for (const Candidate& c : r.candidates)
    if (c.trial == Candidate::Trial::kOk) ok.push_back(&c);
  ASSERT_EQ(ok.size(), 4u);  // the job as given and three trials
  std::sort(ok.begin(), ok.end(), [](const Candidate* a, const Candidate* b) { return a->rounds[0] < b->rounds[0]; });
  for (size_t i = 0; i < ok.size(); ++i) {
    const Candidate& c = *ok[i];
    EXPECT_EQ(calls[c.label], static_cast<int>(c.rounds.size())) << c.label;
    if (i >= 3 && !c.as_given) continue;  // not a finalist: measured once
    if (c.label == noisy) {
      EXPECT_EQ(c.rounds.size(), 3u) << c.label;  // 1.0, then 1.3: a third
      EXPECT_NEAR(c.measured_s, c.predicted_s * 3.3 / 3, 1e-9 * c.predicted_s);
    } else {
      EXPECT_EQ(c.rounds.size(), 2u) << c.label;  // two that agree
    }
  }
  EXPECT_TRUE(r.candidates.front().as_given);
  EXPECT_GE(r.candidates.front().rounds.size(), 2u);
  const std::string table = r.table();
  EXPECT_NE(table.find("3 rounds, 30%"), std::string::npos) << table;
  EXPECT_NE(table.find("2 rounds, 0%"), std::string::npos) << table;
}

TEST(Tune, AFailedTrialIsRecordedAndTheSearchGoesOn) {
  const fs::path dir = fresh_dir("tune", "failed");
  TuneOptions o = hooked_options(dir, 4);
  int calls = 0;
  TuneHooks hooks;
  hooks.price = fake_price;
  hooks.trial = [&](Candidate& c, double) {
    ++calls;
    if (calls == 2) {  // the best predicted
      c.trial = Candidate::Trial::kFailed;
      c.failure = "exit 1: train: error: the test's";
    } else if (calls == 3) {
      c.trial = Candidate::Trial::kOutOfMemory;
      c.failure = "exit 137: killed";
    } else {
      c.trial = Candidate::Trial::kOk;
      c.measured_s = c.predicted_s;
    }
  };
  const TuneResult r = tune(o, hooks);
  EXPECT_EQ(calls, 5);  // the job as given and 4: the search went on past both
  int failed = 0, oom = 0, ok = 0;
  for (const Candidate& c : r.candidates) {
    failed += c.trial == Candidate::Trial::kFailed;
    oom += c.trial == Candidate::Trial::kOutOfMemory;
    ok += c.trial == Candidate::Trial::kOk;
  }
  EXPECT_EQ(failed, 1);
  EXPECT_EQ(oom, 1);
  EXPECT_EQ(ok, 3);
  const Candidate& chosen = r.candidates[static_cast<size_t>(r.chosen)];
  EXPECT_EQ(chosen.trial, Candidate::Trial::kOk);
  const std::string table = r.table();
  EXPECT_NE(table.find("failed"), std::string::npos) << table;
  EXPECT_NE(table.find("out of memory"), std::string::npos) << table;
  EXPECT_NE(table.find("the test's"), std::string::npos) << table;
}

TEST(Tune, PredictionsWithinHalfAPercentAreATieThatLessMemoryWins) {
  std::vector<Candidate> cs(4);
  const double steps[] = {0.0100, 0.009995, 0.0110, 0.00999};
  const int64_t bytes[] = {500, 100, 50, 900};
  for (size_t i = 0; i < cs.size(); ++i) {
    cs[i].priced = true;
    cs[i].structure = "s" + std::to_string(i);
    cs[i].predicted_s = steps[i];
    cs[i].predicted_bytes = bytes[i];
  }
  // 0.00999, 0.009995 and 0.0100 are one tie (on one cell of the 0.5% grid); 0.0110 is
  // 10% slower whatever its memory.
  const std::vector<int> order = trial_order(cs, 4);
  ASSERT_EQ(order.size(), 4u);
  EXPECT_EQ(order.back(), 2);
  EXPECT_EQ(order.front(), 1) << "the smallest of the tie";
}

// The cost model learns: a trial that measures a phase at five times its prediction
// moves every candidate with that phase down the order of the trials still to run.
TEST(Tune, TrialsAfterTheFirstFollowThePredictionsTheTrialsCorrected) {
  const fs::path dir = fresh_dir("tune", "learn");
  TuneOptions o = hooked_options(dir, 3);
  auto pipelined = [](const Candidate& c) { return c.spec.mesh.size("pipeline") > 1; };
  TuneHooks hooks;
  hooks.price = [&](Candidate& c) {
    // On paper every pipeline beats every other layout: 10 ms of which 4 are bubble,
    // against 10.5 ms of compute; ties broken by the label's hash.
    const double jitter = double(std::hash<std::string>{}(c.label) % 1000) * 1e-8;
    tetra::planner::StepPrediction& p = c.prediction;
    p.compute_s = pipelined(c) ? 0.006 : 0.0105;
    p.bubble_s = pipelined(c) ? 0.004 : 0;
    p.compute_s += jitter;
    p.total_s = p.compute_s + p.bubble_s;
    c.predicted_s = p.total_s;
    c.predicted_bytes = 1000;
  };
  std::vector<bool> ran_pipeline;
  hooks.trial = [&](Candidate& c, double) {
    ran_pipeline.push_back(pipelined(c));
    c.trial = Candidate::Trial::kOk;
    c.measured_phases = {{"compute", c.prediction.compute_s}};
    if (pipelined(c)) c.measured_phases["bubble"] = 5 * c.prediction.bubble_s;  // the bubble is five times worse
    c.measured_s = c.prediction.compute_s + (pipelined(c) ? 5 * c.prediction.bubble_s : 0);
    c.measured_phases["step"] = c.measured_s;
  };
  const TuneResult r = tune(o, hooks);
  // The job as given (data 2), the best on paper (a pipeline), then no pipeline again.
  ASSERT_EQ(ran_pipeline.size(), 4u);
  EXPECT_FALSE(ran_pipeline[0]);
  EXPECT_TRUE(ran_pipeline[1]);
  EXPECT_FALSE(ran_pipeline[2]);
  EXPECT_FALSE(ran_pipeline[3]);
  EXPECT_NEAR(r.phase_ratios.at("bubble"), 5.0, 1e-9);
  Candidate c;
  c.predicted_s = c.prediction.total_s = 0.010;
  c.prediction.compute_s = 0.004;
  c.prediction.bubble_s = 0.002;
  c.prediction.pipeline_s = 0.001;
  c.prediction.other_s = 0.002;
  c.prediction.optimizer_s = 0.001;
  EXPECT_NEAR(corrected_step(c, {{"compute", 2.0}, {"bubble", 3.0}, {"optimizer", 0.5}, {"comm data", 9.0}}),
              0.008 + 0.009 + 0.002 + 0.0005, 1e-12);
  EXPECT_EQ(corrected_step(c, {}), 0.010);
}

TEST(Tune, StopsAtTheBudgetWithTheBestSoFar) {
  const fs::path dir = fresh_dir("tune", "budget");
  TuneOptions o;
  o.job = gpt_job(dir).string();
  o.sets = {"mesh.data=2"};
  o.np = 2;
  o.trials = 4;
  o.progress = nullptr;
  o.output = (dir / "tuned.yaml").string();
  o.budget_s = 12;
  int calls = 0;
  TuneHooks hooks;
  hooks.price = fake_price;
  hooks.trial = [&](Candidate& c, double seconds_left) {
    ++calls;
    // A trial that takes all but 3 s of what is left: no second one fits.
    std::this_thread::sleep_for(std::chrono::duration<double>(std::max(0.0, seconds_left - 3)));
    c.trial = Candidate::Trial::kOk;
    c.measured_s = c.predicted_s;
  };
  const auto start = std::chrono::steady_clock::now();
  const TuneResult r = tune(o, hooks);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(r.out_of_budget);
  EXPECT_LE(took, o.budget_s + 2);
  EXPECT_EQ(r.candidates[static_cast<size_t>(r.chosen)].trial, Candidate::Trial::kOk);
  EXPECT_NE(slurp(r.written).find("the budget ran out first"), std::string::npos);
}

TEST(Tune, RankCorrelation) {
  EXPECT_NEAR(rank_correlation({1, 2, 3, 4}, {10, 20, 30, 40}), 1.0, 1e-12);
  EXPECT_NEAR(rank_correlation({1, 2, 3, 4}, {4, 3, 2, 1}), -1.0, 1e-12);
  EXPECT_NEAR(rank_correlation({1, 2, 3}, {1, 3, 2}), 0.5, 1e-12);
  EXPECT_NEAR(rank_correlation({1, 1, 2}, {1, 2, 3}), 0.8660254037844386, 1e-9);  // ties share a rank
  EXPECT_TRUE(std::isnan(rank_correlation({1, 2}, {1, 2})));
}

TEST(TrainTune, FromAPoorJobToOneThatChecksAndRuns) {
  const fs::path dir = fresh_dir("tune", "cli");
  const fs::path job = poor_job(dir), out = dir / "tuned.yaml";
  const Outcome r = run_tool(kTrain, dir,
                             {job.string(), "--tune", "--np", "2", "--trials", "2", "--trial-steps", "10", "--budget",
                              "240", "-o", out.string()});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("calibrating the links and compute of 2 ranks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(as given)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("<- chosen"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("written: " + out.string()), std::string::npos) << r.out;
  const std::string written = slurp(out);
  EXPECT_NE(written.find("#   measured "), std::string::npos) << written.substr(0, 1500);
  EXPECT_NE(written.find("#   measured / predicted per phase"), std::string::npos) << written.substr(0, 1500);
  // As written: `train --check` takes it, and it trains under mpirun (a few steps).
  const Outcome check = run_tool(kTrain, dir, {out.string(), "--check"});
  EXPECT_EQ(check.status, 0) << check.out << check.err;
  const Outcome run = run_tool(TETRA_MPIEXEC, dir,
                               mpirun_args(2, kTrain, {out.string(), "--set", "train.max_steps=3", "--set",
                                                       "log.dir=" + (dir / "tuned-run").string()}));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
}

TEST(TrainTune, TrialsThatFailAreRecordedAndThePaperAnswerWritten) {
  // A launcher that fails every trial (/bin/false): each is recorded with its exit, the
  // search ends, and the best predicted is written, said to be unmeasured.
  const fs::path dir = fresh_dir("tune", "cli_failed");
  const fs::path job = poor_job(dir), out = dir / "tuned.yaml";
  const Outcome r = run_tool(kTrain, dir,
                             {job.string(), "--tune", "--np", "2", "--trials", "2", "--launcher", "/bin/false",
                              "--calibration", (dir / "none.json").string(), "-o", out.string()});
  // A calibration file that is not there is the user's mistake, said before anything runs.
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("none.json"), std::string::npos) << r.err;
  const Outcome f = run_tool(kTrain, dir,
                             {job.string(), "--tune", "--np", "2", "--trials", "2", "--launcher", "/bin/false", "-o",
                              out.string()});
  ASSERT_EQ(f.status, 0) << f.out << f.err;
  EXPECT_NE(f.out.find("failed"), std::string::npos) << f.out;
  EXPECT_NE(f.out.find("exit 1"), std::string::npos) << f.out;
  const std::string written = slurp(out);
  EXPECT_NE(written.find("not measured (no trial finished)"), std::string::npos) << written.substr(0, 1500);
  EXPECT_EQ(run_tool(kTrain, dir, {out.string(), "--check"}).status, 0);
}

TEST(TrainTune, ATrialPastTheBudgetIsCutAndLeavesNoRank) {
  // Trials far longer than the budget: the first is stopped at it (mpirun and its ranks),
  // recorded as out of time, and the best on paper written.
  const fs::path dir = fresh_dir("tune", "cli_budget");
  const fs::path job = poor_job(dir), out = dir / "tuned.yaml";
  double took = 0;
  const pid_t pid = spawn_tool(kTrain,
                               {job.string(), "--tune", "--np", "2", "--trials", "1", "--trial-steps", "1000000",
                                "--budget", "40", "-o", out.string()},
                               dir / "stdout.txt", dir / "stderr.txt");
  const int status = wait_within(pid, std::chrono::seconds(120), &took);
  const std::string printed = slurp(dir / "stdout.txt") + slurp(dir / "stderr.txt");
  ASSERT_EQ(status, 0) << printed;
  EXPECT_LE(took, 40 + 15) << printed;  // the budget, and SIGTERM's grace
  EXPECT_NE(printed.find("out of time"), std::string::npos) << printed;
  EXPECT_NE(slurp(out).find("the budget ran out first"), std::string::npos);
  // No rank of the cut trial is left running.
  const Outcome ps = run_tool("/usr/bin/pgrep", dir, {"-f", (dir / "run" / "tune" / "trial-0" / "trial.yaml").string()});
  EXPECT_EQ(ps.out, "") << ps.out;
  EXPECT_EQ(ps.status, 1);  // pgrep: nothing matched
}

TEST(TrainTune, ClearErrorsForOptionsOutOfPlace) {
  const fs::path dir = fresh_dir("tune", "options");
  const fs::path job = poor_job(dir);
  Outcome r = run_tool(kTrain, dir, {job.string(), "--memory-gb", "4"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("options of --tune"), std::string::npos) << r.err;
  r = run_tool(kTrain, dir, {job.string(), "--tune", "--np", "3", "--dry-run"});
  // 3 processes: data 3 does not divide the batch of 128... but pipeline 3 may: whatever
  // is valid is tuned; nothing valid is a clear error.
  EXPECT_TRUE(r.status == 0 || r.err.find("no layout of 3 processes") != std::string::npos) << r.out << r.err;
  // Where the answer cannot be written: said, naming the path, not "written".
  r = run_tool(kTrain, dir,
               {job.string(), "--tune", "--np", "2", "--dry-run", "-o", (dir / "no" / "such" / "t.yaml").string()});
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("no/such/t.yaml: cannot write"), std::string::npos) << r.err;
  r = run_tool(kTrain, dir, {job.string(), "--tune", "--np", "2", "--json"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--tune does not take --json"), std::string::npos) << r.err;
}

}  // namespace
