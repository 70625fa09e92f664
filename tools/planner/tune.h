// The tuner behind `train JOB --tune` (Note [Tuner] in tools/planner/tune.cpp): every
// layout and knob the job's ranks allow, priced by the cost model, the best few measured
// in short trials, and the fastest written out as a complete job. Part of the planner:
// it starts no process itself; the trials and the calibration run are started by a
// TrialLauncher its caller gives (the train tool's runs them under mpirun or srun).
//
//   tetra::TuneOptions o;
//   o.job = "job.yaml";
//   o.np = 4;
//   o.dry_run = true;                       // on paper: no launcher needed
//   tetra::TuneResult r = tetra::tune(o);   // progress on o.progress; the job in r.written
//
// The steps are separate functions so that a test (or another search) can drive them:
// enumerate_candidates (what is valid), prune_by_memory, trial_order (which to measure,
// best predicted first), and tune() with hooks in place of the cost model and the trials.
#pragma once

#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/job_spec.h"
#include "tools/planner/cost_model.h"

namespace tetra::planner {

struct TuneOptions {
  std::string job;                // the job file
  std::vector<std::string> sets;  // its --set overrides, applied before anything is tuned
  int np = 1;                     // the processes the job will run on (mpirun -np N)
  int ranks_per_host = 0;         // consecutive processes per host; 0: all on this host
  // The memory one rank may use, in GiB; 0: this host's memory shared by its ranks (a job
  // on cuda: the device's, which a plan on paper does not know; give it).
  double memory_gb = 0;
  double budget_s = 300;    // the whole search; the best measured so far when it runs out
  std::string calibration;  // a bench-collectives --calibrate file; "": measured on the ranks first
  bool dry_run = false;     // rank on paper only: no calibration run, no trials
  int trials = 4;           // the best predicted measured (besides the job as given)
  int trial_steps = 30;     // measured steps per trial, after
  int warmup_steps = 5;     // steps that are not measured (the first allocates and plans)
  // The fastest this many measured run a second time, in the opposite order, and keep
  // the mean of their two (a shared machine's slow moment then falls on more than one).
  int confirm = 3;
  std::string output;       // the chosen job's file; "": <job>-tuned.yaml beside the job
  std::string work_dir;     // the trials' folders; "": <log.dir>/tune
  std::FILE* progress = stdout;
};

// One point of the search: the job with some keys set (or sections removed).
struct Candidate {
  std::string label;      // "data 2 | zero 1, bucket 4 MB", what the table shows
  std::string structure;  // the layout and its knobs but buckets, hierarchy and prefetch
  bool as_given = false;  // the job as the user wrote it
  bool refinement = false;  // a bucket, hierarchy or prefetch variant of a structure
  std::map<std::string, std::string> keys;  // dotted key -> YAML value ("~" removes a section)
  std::string yaml;       // the resolved job with `keys` applied (complete, every default)
  core::JobSpec spec;     // parsed from `yaml`

  // The cost model.
  bool priced = false;
  std::string invalid;          // what the pricing found wrong ("" fine)
  double predicted_s = -1;      // a step
  int64_t predicted_bytes = 0;  // the largest rank's model state and activations
  StepPrediction prediction;
  std::string pruned;           // why memory drops it ("" kept)

  // The trial.
  enum class Trial { kNotRun, kOk, kFailed, kOutOfMemory, kTimedOut };
  Trial trial = Trial::kNotRun;
  std::string failure;          // the trial's last error line
  double measured_s = -1;       // its median step after the warm-up (the mean over its rounds)
  std::vector<double> rounds;   // each trial's median step
  int64_t measured_rss = 0;     // the largest rank's peak RSS
  int64_t measured_state = 0;   // the largest rank's model state, as the run counted it
  std::map<std::string, double> measured_phases, predicted_phases;  // seconds per step
  std::string dir;              // its folder (job.yaml, log.txt, metrics.jsonl)
};

std::string to_string(Candidate::Trial t);

// Every layout (data x pipeline x tensor = np, replicas) and knob (ZeRO stage, micro-batches
// and schedule, threads; buckets, hierarchy and ZeRO-3 prefetch as refinements) the job
// allows, each parsed and checked against the composition's rules and the world (what
// `train --check` checks before the model is built; the pricing asks the model's rules).
// The job as given comes first when it fits np. `rejected`, when given, counts the
// combinations the rules turned down.
std::vector<Candidate> enumerate_candidates(const TuneOptions& options, int* rejected = nullptr);

// Marks every priced candidate whose largest rank exceeds `limit_bytes` as pruned.
void prune_by_memory(std::vector<Candidate>& candidates, int64_t limit_bytes);

// The candidate's predicted step with each phase scaled by what the trials so far measured
// of it (`ratios`: measured / predicted, as TuneResult::phase_ratios): compute, the
// pipeline's bubble and transfers, optimizer and loading; the other axes' communication
// as predicted (its measured busy time overlaps compute). predicted_s without ratios or
// without the prediction's phases.
double corrected_step(const Candidate& c, const std::map<std::string, double>& ratios);

// The candidates to measure next, best predicted first (corrected by `ratios`): priced,
// valid, not pruned, not run yet, and at most `count` of them (the job as given is not
// counted: tune() runs it first). Steps within 0.5% of each other are a tie, which the
// smaller memory wins; the best of each structure not yet measured comes before a
// second variant of any.
std::vector<int> trial_order(const std::vector<Candidate>& candidates, int count,
                             const std::map<std::string, double>& ratios = {});

// Spearman's rank correlation of two samples (ties share their mean rank); NaN below 3.
double rank_correlation(const std::vector<double>& a, const std::vector<double>& b);

struct TuneResult {
  std::vector<Candidate> candidates;
  int chosen = -1;             // the fastest measured (on paper: the best predicted)
  int trials_run = 0;
  std::vector<int> order;      // the candidates measured, as they ran
  double correlation = 0;      // of predicted and measured step, over the trials that ran
  std::map<std::string, double> phase_ratios;  // measured / predicted, over the trials
  int64_t memory_limit = 0;
  std::string written;         // the chosen job's file
  std::string calibration;     // where the prices' links and compute came from
  double seconds = 0;
  bool out_of_budget = false;
  std::string table() const;   // every candidate measured, and the best on paper
};

// How a started program ended: its exit status (128 + signal when a signal ended it; -1
// when it could not be started), whether the deadline stopped it, and its log (stdout
// and stderr together).
struct Launched {
  int status = -1;
  bool timed_out = false;
  std::string log;
};

// What starts the processes of a trial and of the calibration run: the `train` tool's
// (tools/trials/launcher.h: fork and exec under mpirun, srun or --launcher), a test's
// own. Each call blocks until the processes end or `seconds` pass (then they are ended).
class TrialLauncher {
 public:
  virtual ~TrialLauncher() = default;
  // The launch before the program, as the written job's header names it ("" for one
  // process without a launcher).
  virtual std::string command() const = 0;
  // `train JOB_FILE` on the job's processes, its output to `log`.
  virtual Launched train(const std::string& job_file, const std::string& log, double seconds) = 0;
  // Whether calibrate() can run (a bench-collectives is there to run).
  virtual bool can_calibrate() const = 0;
  // `bench-collectives --calibrate FILE` on the same processes.
  virtual Launched calibrate(const std::string& file, const std::string& log, double seconds) = 0;
};

// Stand-ins for the expensive steps (tests): `price` fills predicted_s and
// predicted_bytes (or invalid); `trial` fills trial, measured_s and the measured fields.
// Without `trial`, a search that measures (not options.dry_run) runs its trials with
// `launcher`, which it then needs.
struct TuneHooks {
  std::function<void(Candidate&)> price;
  std::function<void(Candidate&, double seconds_left)> trial;
  TrialLauncher* launcher = nullptr;
};

TuneResult tune(const TuneOptions& options, const TuneHooks& hooks = {});

}  // namespace tetra::planner
