// The run folder's records as types (Note [Run folder] in records.cpp): the train, eval
// and checkpoint-failure records of metrics.jsonl, and summary.json. Each record's JSON is
// written and read in one place, run_folder.cpp, where every key is spelled once (Note
// [Record fields]); the trainer writes through these types and the tools (report, the
// tuner's trials) read through them. read_run_folder() reads a whole folder as `report`
// shows it.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace tetra::core {

// Model state bytes by kind (the record's and the summary's model_state_bytes).
struct StateBytesRecord {
  std::optional<int64_t> parameters, gradients, optimizer, buffers, total;
};

// Where a step's time went, ms per step (step_ms): reading the batch, forward, backward,
// finishing the gradients, the optimizer.
struct StepMsRecord {
  std::optional<double> data, forward, backward, gradients, optimizer;
};

// Milliseconds (or seconds: a summary's comm_s) per mesh axis; a value that is not a
// number reads as NaN.
using AxisTimes = std::map<std::string, double>;

// What a train record says of one rank, and what each of its per-rank rows says
// (Note [Per-rank records]): absent where the writer had nothing to say.
struct RankFigures {
  std::optional<int64_t> peak_rss_bytes;
  std::optional<double> pipeline_bubble;  // time waiting on a neighbour / time in the schedule
  std::optional<StepMsRecord> step_ms;
  std::optional<AxisTimes> comm_ms;  // per step; only for the mesh axes of several ranks
};

// One line of metrics.jsonl every log.every steps. `loss` is NaN for a skipped step
// (written as JSON null, read back as absent).
struct TrainRecord : RankFigures {
  // One rank's row in `ranks`: its model state is a total.
  struct Rank : RankFigures {
    std::optional<int64_t> model_state_bytes;
  };
  int64_t step = 0;
  std::optional<int64_t> epoch, skipped_steps;
  std::optional<double> loss, lr, samples_per_s, time_s;
  std::optional<double> grad_norm;  // before clipping; only when optimizer.clip_grad_norm is set
  bool skipped = false;             // written only when true: the step's loss was not finite
  std::optional<StateBytesRecord> model_state_bytes;  // this rank's (the writer's)
  std::optional<std::vector<Rank>> ranks;            // every rank's, for worlds of 2 to 256
};

// An evaluation's figures: an eval record's, and the summary's final_eval.
struct EvalFigures {
  std::optional<double> test_loss, perplexity, test_accuracy;
};

// An eval record (written with "eval": true).
struct EvalRecord : EvalFigures {
  int64_t step = 0;
  std::optional<int64_t> epoch;
  std::optional<double> time_s;
};

// A checkpoint that failed under checkpoint.on_error: warn.
struct CheckpointFailureRecord {
  int64_t step = 0;
  std::optional<int64_t> checkpoint_failures;  // so far in this run
  std::string checkpoint_error;
};

// summary.json: written when the run ends (Note [Run folder]). Strings read as "" when absent.
struct Summary {
  // One rank's totals over the run.
  struct Rank : RankFigures {
    std::optional<int64_t> rank;
    std::string host;
    std::optional<StateBytesRecord> model_state_bytes;
    std::optional<AxisTimes> comm_s;  // seconds over the run
  };
  std::string job, tetra, commit, started, finished;
  std::optional<int64_t> world;      // ranks: processes x replica threads
  std::optional<int64_t> processes;  // older summaries have only world
  std::optional<int64_t> replicas;
  std::optional<std::map<std::string, int64_t>> mesh;
  std::string metrics, job_yaml;  // where metrics.jsonl and job.yaml are ("" none)
  nlohmann::json identity;        // Note [Checkpoint identity]
  std::optional<std::vector<std::string>> traces;
  std::optional<int64_t> steps, final_step, skipped_steps;
  std::optional<double> train_seconds, total_seconds, samples_per_s, final_loss;
  std::string resumed_from, checkpoint;
  std::optional<EvalFigures> final_eval;  // written as null when the run had none
  std::optional<std::vector<Rank>> ranks;
};

// Each record as its JSON object, and back. The readers leave absent (or null, or
// mistyped) keys absent; they throw nothing.
nlohmann::json to_json(const TrainRecord& r);
nlohmann::json to_json(const EvalRecord& r);
nlohmann::json to_json(const CheckpointFailureRecord& r);
nlohmann::json to_json(const Summary& s);
Summary summary_from_json(const nlohmann::json& j);

// Note [Resumed runs] (run_folder.cpp): metrics.jsonl as the later run wrote it.
struct MetricsFile {
  std::string path;
  std::map<int64_t, TrainRecord> train;  // by step
  std::map<int64_t, EvalRecord> eval;
  std::map<int64_t, CheckpointFailureRecord> failures;
  std::vector<int64_t> resumed_at;  // steps where the file went back
  size_t records = 0, other = 0;    // lines read; records of no known kind
};

// How read_metrics takes a file that cannot be read and a line that is not a JSON object.
enum class BadLines {
  kThrow,  // ConfigError naming file:line (the report's)
  kSkip,   // left out, a missing file read as empty (a trial killed mid-line)
};
MetricsFile read_metrics(const std::string& path, BadLines bad = BadLines::kThrow);

// A run folder as the report reads it: summary.json when there is one, the metrics it
// names (else DIR/metrics.jsonl), job.yaml and the traces.
struct RunFolder {
  std::string dir;
  std::optional<Summary> summary;  // none: the run did not finish
  MetricsFile metrics;
  std::string job_yaml;  // its text
  std::string job_path;
  bool has_job = false;
  std::vector<std::string> traces;  // the per-rank Chrome traces that are there
  std::vector<std::string> notes;   // what a reader should know about the files themselves
};
// ConfigError: no such folder, no metrics, a summary or a metrics line that is not JSON.
RunFolder read_run_folder(const std::string& dir);

}  // namespace tetra::core
