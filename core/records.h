// What a run leaves for a person or a tool to read: its results, the train records of
// metrics.jsonl (and TensorBoard), job.yaml and summary.json in its run folder.
// Note [Run folder] and Note [Per-rank records] (records.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "core/job_spec.h"
#include "core/mesh.h"
#include "core/model_state.h"
#include "core/plan.h"
#include "core/run_folder.h"
#include "core/step.h"

namespace tetra::core {

struct EvalResult {
  double test_loss = 0;
  std::optional<double> accuracy;    // classifiers: top-1; language models: next-token
  std::optional<double> perplexity;  // language models
  int64_t samples = 0;
};

struct TrainResult {
  int64_t steps = 0;            // optimizer steps taken by this run (after any resume)
  int64_t final_step = 0;       // global step count at the end
  double train_seconds = 0;     // time in training steps (no eval, no checkpoints)
  double total_seconds = 0;
  double samples_per_s = 0;     // global samples per second of training time
  double final_loss = 0;
  std::vector<double> losses;   // training loss of each step this run took (skipped ones aside)
  // Steps this run skipped because their loss or gradients were not finite
  // (train.on_nonfinite: skip): each consumed its batch and advanced the step count and
  // the learning-rate schedule, but changed neither the parameters nor the optimizer
  // state. Not in `steps` or `losses`.
  int64_t skipped_steps = 0;
  std::optional<EvalResult> final_eval;
  std::optional<double> best_accuracy;
  std::string checkpoint;       // the last checkpoint written ("" when none)
  std::string resumed_from;     // "" when the run started fresh
  // Where the training time went, summed over the steps (seconds): reading batches,
  // forward, backward, finishing gradients (waiting on what backward did not hide),
  // and the optimizer (clipping included).
  struct Phases {
    double data = 0, forward = 0, backward = 0, gradients = 0, optimizer = 0;
  } phases;
  ModelStateBytes memory;  // this rank's model state after the last step
  // Note [A finished run stays]: what the run folder already held made this run train
  // nothing and write nothing ("finished at step 6: nothing to train; ..."); "" when it trained.
  std::string nothing_to_train;
};

// One rank's cumulative counters at a moment: its memory now, where its time went.
struct RankState {
  ModelStateBytes memory;
  TrainResult::Phases phases;
  StepRunner::Idle idle;
  int64_t step = 0;
};

// One train record's figures (metrics.jsonl).
struct StepRecord {
  int64_t step = 0, epoch = 0, skipped_steps = 0;
  double loss = 0, lr = 0, samples_per_s = 0, time_s = 0;
  bool skipped = false;
  double grad_norm = -1;  // -1: not clipped, not reported
};

// The run's records, on every rank of the job (each joins their collectives).
class RunRecords {
 public:
  // `mesh` and `ranks` (every rank of the job): nullptr for one process.
  RunRecords(const JobSpec& spec, const Plan& plan, const Mesh* mesh, collectives::CommunicatorPtr ranks);
  // The loop's start: later intervals and totals count from here, not from the set-up.
  void start(const RankState& now);
  // A train record: its figures, this rank's memory and step split over the interval
  // since the last record, and (collective over every rank, when the records go
  // somewhere) every rank's (Note [Per-rank records]).
  TrainRecord train_record(const StepRecord& r, const RankState& now);
  // job.yaml in log.dir (the writer, when the run starts).
  void write_run_start() const;
  // summary.json in log.dir: collective (every rank sends its totals); the writer writes.
  // Nothing when log.dir is "".
  // `identity`: the run's (RunIdentity::identity()), which a later run of the same
  // name is checked against (Note [A finished run stays]).
  void write_summary(const TrainResult& r, const RankState& now, const std::string& trace_path,
                     const std::string& started_at, const nlohmann::json& identity);

 private:
  std::vector<double> counters(const RankState& s) const;
  std::vector<std::vector<double>> gather(const std::vector<double>& mine);
  const JobSpec& spec_;
  const Plan& plan_;
  const Mesh* mesh_;
  collectives::CommunicatorPtr ranks_;
  std::vector<std::string> comm_axes_;  // the mesh axes of more than one rank
  std::vector<double> start_, logged_;
};

// One trace per rank when there are several: trace.json -> trace.rank1.json beside it.
std::string rank_trace_path(const std::string& trace, int rank, int world);
// Now, UTC, ISO 8601.
std::string utc_now();

}  // namespace tetra::core
