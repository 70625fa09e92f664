// The tuner (tools/planner/tune.h): its steps, one function each.
#include "tools/planner/tune.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>

#include "collectives/error.h"
#include "collectives/launch.h"
#include "hardware/topology.h"
#include "tools/planner/pricing.h"
#include "tools/planner/tune_steps.h"

// Note [Tuner]
// `train JOB --tune --np N` chooses the job's layout and knobs the way a careful user
// would, in four steps, and keeps every step's figures:
//   1. Enumerate (enumerate_candidates). Every data x pipeline x tensor = N, times 1 or 2
//      replica threads per process (on a CPU priced here: a FLOP rate is a device's, which
//      replicas would share); for each, ZeRO stages 0-3 where the data group has more than
//      one rank, micro-batches P, 2P and 4P and every schedule (gpipe, 1f1b,
//      interleaved_1f1b and zbv with 2 chunks, zbh1) where P > 1, and the job's threads or
//      the host's cores shared out. These are the structures; their refinements are the
//      gradient buckets (1, 4, 25 MB), the hierarchical allreduce (off, on) where the
//      data group spans hosts, and ZeRO-3's prefetch (1, 2 layers). A candidate is the
//      job's resolved YAML with those keys set (sections the layout does not use removed),
//      parsed like a file and checked against the composition's rules and N: a candidate
//      is a job `train --check` accepts, and every key the user set that is not tuned
//      (optimizer, compression, checkpointing, balance) stays as written.
//   2. Price (the cost model, Note [Cost model]): every structure, then the refinements of
//      the best few, as `train --dry-run` prices them (JobPricer: the model's shapes, the
//      layers' timings and the calibration built once). The calibration is measured on the
//      ranks the job will run on (`bench-collectives --calibrate` under the launcher) unless
//      a file is given; compute is the layers timed here. The model's own rules (a stage
//      over pipeline.memory_gb, a split that does not divide) are asked here too.
//   3. Prune: a candidate whose largest process (its rank's model state and activations
//      times its replicas, the dry run's estimate) exceeds --memory-gb, else the host's
//      memory shared by its processes, is dropped before anything runs.
//   4. Measure: the job as given, then the best predicted, each a short run of the real job
//      under the launcher (trial_steps after warmup_steps, no checkpoints, metrics every 5
//      steps), its step the median of the intervals after the warm-up; a trial that fails,
//      runs out of memory or of time is recorded and the search goes on. The cost model
//      learns as it goes: each trial after the first is the best by the predictions with
//      each phase (compute, bubble, optimizer, loading) scaled by what the trials before
//      it measured of that phase (corrected_step), so a term the model got wrong stops
//      steering the search (a bubble measured at 7x its prediction on ranks that share
//      cores sends the next trial to a layout without one). The fastest three, and the job
//      as given, run again in the opposite order and keep the mean of their rounds; two
//      rounds more than 10% apart (kRoundsAgree) get a third, and the table shows each
//      trial's rounds and their spread. The fastest
//      measured is written, with a header saying how it was chosen, what it measured and
//      how far each phase's measurement was from its prediction (compute, each axis's
//      communication, the bubble: the ratios a user reads to see which term the model got
//      wrong).
// The budget covers it all: pricing stops at 40% of it (the structures priced so far
// stand), each trial is cut at what is left, and the best measured so far is the answer.


namespace tetra::planner {

using namespace tetra::core;
using namespace tetra::planner::tuning;

using hardware::ByteDigits;
using hardware::format_bytes;

namespace {

// One search: its options, its clock, the trials' launcher and folder, and the result it
// fills step by step.
struct Search {
  Search(const TuneOptions& options, const TuneHooks& h) : o(options), hooks(h) {}
  TuneOptions o;
  const TuneHooks& hooks;
  const Clock::time_point start = Clock::now();
  TuneResult r;
  std::string work;      // the trials' folders
  std::string launcher;  // the trials' launch, as the written job names it
  std::string calibration;
  std::unique_ptr<JobPricer> pricer;
  std::function<void(Candidate&)> price;
  std::function<void(Candidate&, double)> trial;
  int trial_no = 0;
  int structures = 0;
  bool as_given = false;  // the job as given is measured first

  double elapsed() const { return std::chrono::duration<double>(Clock::now() - start).count(); }
  double left() const { return o.budget_s - elapsed(); }
  std::string clock() const { return clock_text(elapsed()); }
  std::vector<Candidate>& cs() { return r.candidates; }
};

// What the search cannot start without: one process to run it, the calibration file it
// names, and a way to run its trials.
void check_options(const TuneOptions& o, const TuneHooks& hooks) {
  const collectives::LaunchInfo launch = collectives::detect_launch();
  if (launch.multi_process() && launch.world_size > 1)
    throw ConfigError("--tune runs as one process and launches its trials itself (" + launch.launcher + " started " +
                      std::to_string(launch.world_size) + "): run `train JOB --tune --np N` alone");
  if (!o.calibration.empty() && o.calibration != "gpu-cluster" && !std::filesystem::exists(o.calibration))
    throw ConfigError("--calibration " + o.calibration +
                      ": no such file (bench-collectives --calibrate FILE writes one; without --calibration the tuner "
                      "measures its own)");
  if (!o.dry_run && !hooks.trial && !hooks.launcher)
    throw ConfigError("tune: measuring trials needs a TrialLauncher (TuneHooks::launcher; `train --tune` gives one); "
                      "TuneOptions::dry_run searches on paper");
}

// Step 1: the candidates, and where the trials will write.
void enumerate(Search& s) {
  const TuneOptions& o = s.o;
  int rejected = 0;
  say(o.progress, "[tune %s] enumerating the layouts and knobs of %d process%s...\n", s.clock().c_str(), o.np,
      o.np == 1 ? "" : "es");
  s.r.candidates = enumerate_candidates(o, &rejected);
  std::vector<Candidate>& cs = s.cs();
  for (const Candidate& c : cs) s.structures += !c.refinement;
  say(o.progress, "[tune %s] %zu candidates (%d layouts and schedules, %zu bucket, hierarchy and prefetch variants); %d "
                  "combinations the rules turn down\n",
      s.clock().c_str(), cs.size(), s.structures, cs.size() - s.structures, rejected);
  if (cs.empty()) throw ConfigError(o.job + ": no layout of " + std::to_string(o.np) + " processes is valid for this job");
  const JobSpec& base = cs.front().spec;
  s.r.memory_limit = memory_limit(o, base);
  s.launcher = s.hooks.launcher ? s.hooks.launcher->command() : "";
  s.work = !o.work_dir.empty()       ? o.work_dir
           : !base.log.dir.empty()  ? base.log.dir + "/tune"
                                    : (std::filesystem::temp_directory_path() / ("tetra-tune-" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(s.work);
}

// The calibration: the given file, else measured on the ranks the trials run on.
void calibrate(Search& s) {
  const TuneOptions& o = s.o;
  s.calibration = o.calibration;
  if (s.hooks.price || !s.calibration.empty() || o.dry_run || o.np <= 1 || !s.hooks.launcher ||
      !s.hooks.launcher->can_calibrate())
    return;
  const std::string file = s.work + "/calibration.json", log = s.work + "/calibration.log";
  say(o.progress, "[tune %s] calibrating the links and compute of %d ranks: %s bench-collectives --calibrate\n",
      s.clock().c_str(), o.np, s.launcher.c_str());
  const Launched e = s.hooks.launcher->calibrate(file, log, std::min(120.0, s.left() * 0.2));
  if (e.status == 0 && std::filesystem::exists(file))
    s.calibration = file;
  else
    say(o.progress, "[tune %s] the calibration failed (%s); pricing with this machine's own figures\n",
        s.clock().c_str(), failure_line(e.log).c_str());
}

// The cost model's price of one candidate (JobPricer: what `train --dry-run` finds).
void make_pricer(Search& s) {
  s.price = s.hooks.price;
  if (s.price) return;
  DryRunOptions how;
  how.np = s.o.np;
  how.ranks_per_host = s.o.ranks_per_host;
  how.calibration = s.calibration;
  how.time_layers = !s.calibration.empty() && !(s.o.dry_run && !s.o.calibration.empty());
  s.pricer = std::make_unique<JobPricer>(ModelSource{}, how);
  JobPricer& pricer = *s.pricer;
  s.price = [&pricer](Candidate& c) {
    const PlanReport rep = pricer.price(c.spec);
    c.prediction = rep.prediction;
    c.predicted_s = rep.prediction.total_s;
    int64_t most = 0;
    for (const RankEstimate& e : rep.estimates) most = std::max(most, e.state.total() + e.activations);
    c.predicted_bytes = most * rep.plan.replicas();
  };
}

void price_one(Search& s, Candidate& c) {
  c.priced = true;
  try {
    s.price(c);
  } catch (const std::exception& e) {
    c.invalid = e.what();
    if (!c.invalid.empty() && c.invalid.back() == '\n') c.invalid.pop_back();
  }
  c.predicted_phases = predicted_phases(c.prediction);
}

// Step 2a: every structure, at most 40% of the budget on paper work when trials follow.
void price_structures(Search& s, double pricing_budget) {
  const TuneOptions& o = s.o;
  say(o.progress, "[tune %s] pricing %d structures with the cost model%s\n", s.clock().c_str(), s.structures,
      s.calibration.empty() ? " (this machine's figures)" : (" (calibration " + s.calibration + ")").c_str());
  double said = s.elapsed();
  int done = 0;
  const Candidate* best_so_far = nullptr;
  for (Candidate& c : s.cs()) {
    if (c.refinement) continue;
    if (s.elapsed() > pricing_budget) {
      s.r.out_of_budget = true;
      say(o.progress, "[tune %s] pricing stopped at %s of the budget: %d of %d structures priced\n", s.clock().c_str(),
          clock_text(pricing_budget).c_str(), done, s.structures);
      break;
    }
    price_one(s, c);
    ++done;
    if (c.invalid.empty() && c.predicted_s > 0 && (!best_so_far || c.predicted_s < best_so_far->predicted_s))
      best_so_far = &c;
    if (s.elapsed() - said > 15) {
      said = s.elapsed();
      say(o.progress, "[tune %s] priced %d of %d structures; best so far %s ms: %s\n", clock_text(said).c_str(), done,
          s.structures, best_so_far ? ms(best_so_far->predicted_s).c_str() : "-",
          best_so_far ? best_so_far->label.c_str() : "none valid yet");
    }
  }
  prune_by_memory(s.cs(), s.r.memory_limit);
}

// Step 2b: the refinements (buckets, hierarchy, prefetch) of the best six structures.
// Returns how many were priced, and the structures refined in `best`.
int refine(Search& s, double pricing_budget, std::vector<std::string>& best) {
  std::vector<Candidate>& cs = s.cs();
  for (int i : trial_order(cs, static_cast<int>(cs.size())))
    if (std::find(best.begin(), best.end(), cs[static_cast<size_t>(i)].structure) == best.end() && best.size() < 6)
      best.push_back(cs[static_cast<size_t>(i)].structure);
  int refined = 0;
  for (Candidate& c : cs) {
    if (!c.refinement || std::find(best.begin(), best.end(), c.structure) == best.end()) continue;
    if (s.elapsed() > pricing_budget) {
      s.r.out_of_budget = true;
      break;
    }
    price_one(s, c);
    ++refined;
  }
  prune_by_memory(cs, s.r.memory_limit);
  return refined;
}

// What the pricing found: how many it turned down (the first named), kept and dropped.
void say_priced(Search& s, int refined, size_t refined_structures) {
  int valid = 0, kept = 0, turned = 0;
  const Candidate* first = nullptr;
  for (const Candidate& c : s.cs()) {
    valid += c.priced && c.invalid.empty();
    kept += c.priced && c.invalid.empty() && c.pruned.empty();
    if (c.priced && !c.invalid.empty() && !turned++) first = &c;
  }
  if (first)
    say(s.o.progress, "[tune %s] %d turned down by the pricing, the first: %s: %s\n", s.clock().c_str(), turned,
        first->label.c_str(), first->invalid.c_str());
  s.r.calibration = s.pricer && s.pricer->calibration() ? s.pricer->calibration()->source
                    : s.calibration.empty()              ? "the test's"
                                                         : s.calibration;
  say(s.o.progress, "[tune %s] priced %d (%d refinements of the best %zu); %d valid, %d within %s a process\n",
      s.clock().c_str(), valid + turned, refined, refined_structures, valid, kept,
      format_bytes(s.r.memory_limit, ByteDigits::kWhole).c_str());
}

// Step 2: the cost model's prices, then the memory's pruning.
void price(Search& s) {
  make_pricer(s);
  const double pricing_budget = s.o.dry_run ? s.o.budget_s : s.o.budget_s * 0.4;
  price_structures(s, pricing_budget);
  std::vector<std::string> best;
  const int refined = refine(s, pricing_budget, best);
  say_priced(s, refined, best.size());
}

// Step 3: the trials: the job as given, then the best predicted, each chosen after the
// trials before it have corrected the predictions phase by phase (Note [Tuner]).
void measure(Search& s) {
  const TuneOptions& o = s.o;
  std::vector<Candidate>& cs = s.cs();
  s.trial = s.hooks.trial;
  if (!s.trial)
    s.trial = [&s](Candidate& c, double seconds) {
      run_trial(c, s.o, *s.hooks.launcher, s.work + "/trial-" + std::to_string(s.trial_no), seconds);
    };
  s.as_given = !o.dry_run && cs.front().as_given && cs.front().priced && cs.front().invalid.empty() &&
               cs.front().pruned.empty();
  const size_t planned = o.dry_run ? 0 : (s.as_given ? 1 : 0) + trial_order(cs, o.trials).size();
  for (size_t k = 0; k < planned; ++k) {
    const std::map<std::string, double> ratios = phase_ratios(cs);
    int next = 0;
    if (k > 0 || !s.as_given) {
      const std::vector<int> best_now = trial_order(cs, 1, ratios);
      if (best_now.empty()) break;
      next = best_now.front();
    }
    Candidate& c = cs[static_cast<size_t>(next)];
    if (s.left() < 5) {
      s.r.out_of_budget = true;
      say(o.progress, "[tune %s] the budget (%s) is spent: %zu trial%s not run\n", s.clock().c_str(),
          clock_text(o.budget_s).c_str(), planned - k, planned - k == 1 ? "" : "s");
      break;
    }
    const double corrected = corrected_step(c, ratios);
    say(o.progress, "[tune %s] trial %zu/%zu: %s (predicted %s ms%s; %s left)\n", s.clock().c_str(), k + 1, planned,
        c.label.c_str(), ms(c.predicted_s).c_str(),
        std::abs(corrected - c.predicted_s) > 1e-3 * c.predicted_s
            ? (", " + ms(corrected) + " as the trials so far correct it").c_str()
            : "",
        clock_text(s.left()).c_str());
    s.r.order.push_back(next);
    s.trial_no = static_cast<int>(k);
    s.trial(c, s.left());
    ++s.r.trials_run;
    if (c.trial == Candidate::Trial::kOk) c.rounds = {c.measured_s};
    if (c.trial == Candidate::Trial::kOk)
      say(o.progress, "[tune %s]   measured %s ms a step, peak RSS %s\n", s.clock().c_str(), ms(c.measured_s).c_str(),
          format_bytes(c.measured_rss, ByteDigits::kWhole).c_str());
    else
      say(o.progress, "[tune %s]   %s: %s\n", s.clock().c_str(), to_string(c.trial).c_str(), c.failure.c_str());
    if (c.trial == Candidate::Trial::kTimedOut) {
      s.r.out_of_budget = true;
      break;
    }
  }
}

// The finalists of the confirmation: the fastest few measured, and the job as given,
// the slowest first (the opposite of the order they ran).
std::vector<int> finalists(Search& s) {
  const std::vector<Candidate>& cs = s.cs();
  std::vector<int> measured;
  for (int i : s.r.order)
    if (cs[static_cast<size_t>(i)].trial == Candidate::Trial::kOk) measured.push_back(i);
  std::stable_sort(measured.begin(), measured.end(), [&](int a, int b) {
    return cs[static_cast<size_t>(a)].measured_s < cs[static_cast<size_t>(b)].measured_s;
  });
  if (static_cast<int>(measured.size()) > s.o.confirm) measured.resize(static_cast<size_t>(std::max(0, s.o.confirm)));
  // Every finalist twice at least (one round on a shared machine is one draw of its noise:
  // ZeRO-1 was once chosen on 28.0 ms that measured 14.0 ms next), and the job as given too,
  // so that "this one trains Nx as fast" compares two means; a finalist whose two rounds
  // differ by more than kRoundsAgree gets a third.
  if (s.o.confirm > 0 && s.as_given && cs.front().trial == Candidate::Trial::kOk &&
      std::find(measured.begin(), measured.end(), 0) == measured.end())
    measured.push_back(0);
  std::reverse(measured.begin(), measured.end());
  return measured;
}

// Step 4: the confirmation: the fastest few again, the other way round.
void confirm(Search& s) {
  const TuneOptions& o = s.o;
  std::vector<int> measured = finalists(s);
  for (size_t k = 0; k < measured.size() && !s.r.out_of_budget; ++k) {
    Candidate& c = s.cs()[static_cast<size_t>(measured[k])];
    if (c.rounds.size() >= 2) {
      if (c.rounds.size() >= 3 || rounds_agree(c.rounds)) continue;  // two that agree, or three
      say(o.progress, "[tune %s]   its rounds differ by %.0f%%: a third\n", s.clock().c_str(), 100 * spread_of(c.rounds));
    }
    if (s.left() < 5) {
      s.r.out_of_budget = true;
      break;
    }
    say(o.progress, "[tune %s] again %zu/%zu: %s (%s left)\n", s.clock().c_str(), k + 1, measured.size(), c.label.c_str(),
        clock_text(s.left()).c_str());
    Candidate again = c;
    s.trial_no = static_cast<int>(s.r.order.size() + k);
    s.trial(again, s.left());
    if (again.trial != Candidate::Trial::kOk) {
      say(o.progress, "[tune %s]   %s: %s\n", s.clock().c_str(), to_string(again.trial).c_str(), again.failure.c_str());
      continue;  // the first round stands
    }
    again.rounds = c.rounds;
    again.rounds.push_back(again.measured_s);
    double sum = 0;
    for (double x : again.rounds) sum += x;
    again.measured_s = sum / double(again.rounds.size());
    say(o.progress, "[tune %s]   measured %s ms a step; %s over %zu rounds\n", s.clock().c_str(),
        ms(again.rounds.back()).c_str(), ms(again.measured_s).c_str(), again.rounds.size());
    c = std::move(again);
    // Two rounds that disagree: this finalist once more (the loop comes back to it).
    if (c.rounds.size() == 2 && !rounds_agree(c.rounds)) measured.insert(measured.begin() + static_cast<long>(k) + 1, measured[k]);
  }
}

// Step 5: the answer: the fastest measured, else (on paper, or no trial finished) the
// best predicted; and how the predictions compared with the measurements.
void choose(Search& s) {
  TuneResult& r = s.r;
  const std::vector<Candidate>& cs = s.cs();
  std::vector<double> pred, meas;
  for (size_t i = 0; i < cs.size(); ++i) {
    const Candidate& c = cs[i];
    if (c.trial != Candidate::Trial::kOk) continue;
    pred.push_back(c.predicted_s);
    meas.push_back(c.measured_s);
    if (r.chosen < 0 || c.measured_s < cs[static_cast<size_t>(r.chosen)].measured_s) r.chosen = static_cast<int>(i);
  }
  if (r.chosen < 0) {
    const std::vector<int> paper = trial_order(cs, 1);
    if (!paper.empty()) r.chosen = paper.front();
    else if (cs.front().as_given && cs.front().invalid.empty() && cs.front().pruned.empty()) r.chosen = 0;
  }
  r.correlation = rank_correlation(pred, meas);
  r.phase_ratios = phase_ratios(cs);
  r.seconds = s.elapsed();
  if (r.chosen < 0)
    throw ConfigError(s.o.job + ": no candidate fits " + format_bytes(r.memory_limit, ByteDigits::kWhole) +
                      " a process (--memory-gb) or passes the model's rules; the first turned down: " +
                      [&] {
                        for (const Candidate& c : cs)
                          if (!c.invalid.empty()) return c.invalid;
                          else if (!c.pruned.empty()) return c.label + ": " + c.pruned;
                        return std::string("none");
                      }());
}

// Step 6: the chosen job, written.
void write(Search& s) {
  std::string out = s.o.output;
  if (out.empty()) {
    std::filesystem::path p(s.o.job);
    out = (p.parent_path() / (p.stem().string() + "-tuned.yaml")).string();
  }
  std::ofstream f(out);
  f << written_job(s.r, s.o, s.launcher);
  f.close();
  if (!f) throw ConfigError("-o " + out + ": cannot write the chosen job there (" + std::strerror(errno) + ")");
  s.r.written = out;
}

}  // namespace

TuneResult tune(const TuneOptions& options, const TuneHooks& hooks) {
  check_options(options, hooks);
  Search s(options, hooks);
  enumerate(s);
  calibrate(s);
  price(s);
  measure(s);
  confirm(s);
  choose(s);
  write(s);
  return std::move(s.r);
}

}  // namespace tetra::planner
