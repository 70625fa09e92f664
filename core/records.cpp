#include "core/records.h"

#include <algorithm>
#include <ctime>
#include <filesystem>

#include "collectives/build_config.h"
#include "collectives/error.h"
#include "collectives/topology_gather.h"
#include "core/safetensors.h"
#include "core/trace_merge.h"
#include "hardware/host.h"

namespace tetra::core {

namespace fs = std::filesystem;

// Note [Run folder]
// log.dir (runs/<name> by default) is where a run leaves what a person or a tool reads
// afterwards (`report RUN_DIR` renders it as one page):
//   job.yaml      the job as parsed, --set applied, every default written out; written
//                 by the writer when the run starts (a run killed later still has it).
//   summary.json  written by the writer when the run ends: the result, where the metrics
//                 and traces are, and one entry per rank (RankCounter below): its model
//                 state and peak RSS, its mean step split into phases, its seconds of
//                 communication per mesh axis, its pipeline bubble. Gathering the ranks'
//                 entries is one collective at the end; a run that failed or was
//                 preempted has no summary.json, which says it did not finish.
//   metrics.jsonl, trace.rank<N>.json, flight/, ckpt/, model.safetensors and its
//                 config.json: the job's relative paths are taken inside log.dir (Note
//                 [One run folder] in job_spec.h; the trace and the export are off unless
//                 named).
// The records of summary.json and metrics.jsonl are core/run_folder.h's types: written
// here (and by the trainer's eval and checkpoint failures) and read by the report and
// the tuner's trials through the same fields (Note [Record fields]).
//
// Note [Per-rank records]
// A train record carries what differs between ranks, gathered to the writer by one
// allgather of a few doubles per record (every rank logs at the same steps, so every
// rank joins): each rank's model state and peak RSS, and over the interval since the
// last record its pipeline bubble (the seconds it waited on its neighbours out of the
// seconds its schedules ran) and its communication time per mesh axis (the axis
// communicator's busy_seconds(), Note [Traffic counters]). The record's `comm_ms` (per
// step) and `pipeline_bubble` are the means over the ranks; `ranks` lists each rank's
// numbers, for worlds of up to kRanksInRecords ranks (a record of thousands would be
// larger than the rest of the file); summary.json always has every rank. A job that keeps
// no records (log.metrics and log.tensorboard both "") gathers nothing; one without a
// run folder (log.dir "") skips the summary's gather.
namespace {

// The slots of a rank's counters: memory now, then times summed since the loop began.
enum RankCounter {
  kParameters, kGradients, kOptimizerState, kBuffers, kPeakRss,  // bytes, now
  kData, kForward, kBackward, kGradientSync, kOptimizerStep,    // seconds, summed
  kIdleWait, kIdleWall,                                          // the pipeline's bubble
  kStepsTaken,
  kAxisBusy  // then one per comm axis: seconds its communicator was in use
};
constexpr size_t kRanksInRecords = 256;

// Times since `before`, memory as it is now.
std::vector<double> since(std::vector<double> now, const std::vector<double>& before) {
  for (size_t i = kData; i < now.size(); ++i) now[i] -= before[i];
  return now;
}

double bubble_of(const std::vector<double>& c) { return c[kIdleWall] > 0 ? c[kIdleWait] / c[kIdleWall] : -1; }

// Where the counters' steps went, in ms per step (a record's and the summary's step_ms).
StepMsRecord step_ms_of(const std::vector<double>& c) {
  const double steps = std::max(1.0, c[kStepsTaken]);
  StepMsRecord ms;
  ms.data = c[kData] * 1e3 / steps;
  ms.forward = c[kForward] * 1e3 / steps;
  ms.backward = c[kBackward] * 1e3 / steps;
  ms.gradients = c[kGradientSync] * 1e3 / steps;
  ms.optimizer = c[kOptimizerStep] * 1e3 / steps;
  return ms;
}

std::optional<double> bubble_if_staged(const std::vector<double>& c) {
  return bubble_of(c) >= 0 ? std::optional<double>(bubble_of(c)) : std::nullopt;
}

// The record's share of Note [Per-rank records]: `ranks` holds every rank's counters over
// the interval (memory as it is now).
void add_rank_fields(TrainRecord& rec, const std::vector<std::vector<double>>& ranks,
                     const std::vector<std::string>& axes) {
  const double steps = std::max(1.0, ranks[0][kStepsTaken]);
  if (!axes.empty()) {
    AxisTimes comm;
    for (size_t a = 0; a < axes.size(); ++a) {
      double sum = 0;
      for (const auto& c : ranks) sum += c[kAxisBusy + a];
      comm[axes[a]] = sum / static_cast<double>(ranks.size()) * 1e3 / steps;
    }
    rec.comm_ms = comm;
  }
  double bubble = 0;
  int staged = 0;
  for (const auto& c : ranks)
    if (bubble_of(c) >= 0) bubble += bubble_of(c), ++staged;
  if (staged > 0) rec.pipeline_bubble = bubble / staged;
  if (ranks.size() < 2 || ranks.size() > kRanksInRecords) return;
  rec.ranks.emplace();
  for (const auto& c : ranks) {
    TrainRecord::Rank row;
    row.model_state_bytes = static_cast<int64_t>(c[kParameters] + c[kGradients] + c[kOptimizerState] + c[kBuffers]);
    row.peak_rss_bytes = static_cast<int64_t>(c[kPeakRss]);
    row.pipeline_bubble = bubble_if_staged(c);
    // Where each rank's steps went (the record's own step_ms and comm_ms are rank 0's and
    // the ranks' mean): what tells a slow stage or a late rank from the others.
    row.step_ms = step_ms_of(c);
    if (!axes.empty()) row.comm_ms.emplace();
    for (size_t a = 0; a < axes.size(); ++a) (*row.comm_ms)[axes[a]] = c[kAxisBusy + a] * 1e3 / std::max(1.0, c[kStepsTaken]);
    rec.ranks->push_back(row);
  }
}

}  // namespace

std::string rank_trace_path(const std::string& trace, int rank, int world) {
  return trace.empty() || world == 1 ? trace : rank_trace_file(trace, rank);
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

RunRecords::RunRecords(const JobSpec& spec, const Plan& plan, const Mesh* mesh, collectives::CommunicatorPtr ranks)
    : spec_(spec), plan_(plan), mesh_(mesh), ranks_(std::move(ranks)) {
  // Mesh::size counts replica threads in the data axis: a job of replicas alone syncs there.
  for (const std::string& a : kAxisOrder)
    if (mesh_ && mesh_->size(a) > 1) comm_axes_.push_back(a);
}

std::vector<double> RunRecords::counters(const RankState& s) const {
  const ModelStateBytes& m = s.memory;
  const TrainResult::Phases& p = s.phases;
  std::vector<double> c = {static_cast<double>(m.parameters), static_cast<double>(m.gradients),
                           static_cast<double>(m.optimizer), static_cast<double>(m.buffers),
                           static_cast<double>(hardware::peak_rss_bytes()),
                           p.data, p.forward, p.backward, p.gradients, p.optimizer,
                           s.idle.wait_s, s.idle.wall_s, static_cast<double>(s.step)};
  for (const std::string& a : comm_axes_) c.push_back(mesh_->axis(a)->busy_seconds());
  return c;
}

std::vector<std::vector<double>> RunRecords::gather(const std::vector<double>& mine) {
  if (!ranks_ || ranks_->size() == 1) return {mine};
  const int64_t n = static_cast<int64_t>(mine.size());
  at::Tensor in = at::tensor(mine, at::kDouble);
  at::Tensor out = at::empty({ranks_->size() * n}, at::kDouble);
  ranks_->allgather(in, out)->wait();
  const double* p = out.data_ptr<double>();
  std::vector<std::vector<double>> all;
  for (int r = 0; r < ranks_->size(); ++r) all.emplace_back(p + r * n, p + (r + 1) * n);
  return all;
}

void RunRecords::start(const RankState& now) {
  start_ = counters(now);
  logged_ = start_;
}

TrainRecord RunRecords::train_record(const StepRecord& r, const RankState& state) {
  const ModelStateBytes& m = state.memory;
  TrainRecord rec;
  rec.step = r.step;
  rec.epoch = r.epoch;
  rec.loss = r.loss;  // a skipped step's is not finite: JSON null
  rec.lr = r.lr;
  rec.samples_per_s = r.samples_per_s;
  rec.time_s = r.time_s;
  rec.skipped_steps = r.skipped_steps;
  rec.model_state_bytes = StateBytesRecord{m.parameters, m.gradients, m.optimizer, m.buffers, m.total()};
  rec.skipped = r.skipped;
  if (r.grad_norm >= 0) rec.grad_norm = r.grad_norm;
  rec.peak_rss_bytes = hardware::peak_rss_bytes();
  // The interval since the last record, from this rank's counters.
  const std::vector<double> now = counters(state);
  const std::vector<double> interval = since(now, logged_);
  logged_ = now;
  // Where the interval's steps went, per step (this rank's clock).
  rec.step_ms = step_ms_of(interval);
  // Note [Per-rank records]: every rank joins (the job's log settings are every rank's),
  // when the records go somewhere; the writer adds what they sent.
  if (!spec_.log.metrics.empty() || !spec_.log.tensorboard.empty()) {
    const auto ranks = gather(interval);
    if (!ranks_ || ranks_->rank() == 0) add_rank_fields(rec, ranks, comm_axes_);
  }
  return rec;
}

void RunRecords::write_run_start() const {
  if (spec_.resolved.empty()) return;
  try {
    write_file_atomic((fs::path(spec_.log.dir) / "job.yaml").string(), spec_.resolved);
  } catch (const Error& e) {
    throw ConfigError(std::string("log.dir: ") + e.what() + " (set log.dir to a folder this run may write, or \"\" for none)");
  }
}

void RunRecords::write_summary(const TrainResult& r, const RankState& now, const std::string& trace_path,
                               const std::string& started_at, const nlohmann::json& identity) {
  if (spec_.log.dir.empty()) return;
  // Every rank's totals since the loop began (collective: every rank joins).
  const auto ranks = gather(since(counters(now), start_));
  std::vector<std::string> hosts;
  if (ranks_ && ranks_->size() > 1) {
    const collectives::HostMap map = collectives::gather_hosts(*ranks_);
    for (int h : map.host_of) hosts.push_back(map.hosts.at(static_cast<size_t>(h)));
  }
  if (ranks_ && ranks_->rank() != 0) return;
  auto absolute = [](const std::string& p) { return p.empty() ? p : fs::absolute(p).lexically_normal().string(); };
  Summary j;
  j.job = spec_.name;
  j.tetra = TETRA_VERSION;
  j.commit = TETRA_GIT_COMMIT;
  j.started = started_at;
  j.finished = utc_now();
  j.world = ranks_ ? ranks_->size() : 1;  // ranks: processes x replica threads
  j.processes = plan_.process_count();
  j.replicas = plan_.replicas();
  j.mesh.emplace();
  for (const MeshAxis& a : spec_.mesh.axes) (*j.mesh)[a.name] = a.size;
  j.metrics = absolute(spec_.log.metrics);
  j.job_yaml = spec_.resolved.empty() ? "" : "job.yaml";
  j.identity = identity;  // Note [Checkpoint identity]: what a later run of this name must match
  // The files Trace::write left: trace.json alone, else one per rank beside it.
  j.traces.emplace();
  if (!trace_path.empty())
    for (size_t i = 0; i < ranks.size(); ++i)
      j.traces->push_back(absolute(rank_trace_path(spec_.log.trace, static_cast<int>(i), static_cast<int>(ranks.size()))));
  j.steps = r.steps;
  j.final_step = r.final_step;
  j.skipped_steps = r.skipped_steps;
  j.train_seconds = r.train_seconds;
  j.total_seconds = r.total_seconds;
  j.samples_per_s = r.samples_per_s;
  j.final_loss = r.final_loss;
  j.resumed_from = r.resumed_from;
  j.checkpoint = r.checkpoint;
  if (r.final_eval) {  // else null
    j.final_eval.emplace();
    j.final_eval->test_loss = r.final_eval->test_loss;
    j.final_eval->test_accuracy = r.final_eval->accuracy;
    j.final_eval->perplexity = r.final_eval->perplexity;
  }
  j.ranks.emplace();
  for (size_t i = 0; i < ranks.size(); ++i) {
    const std::vector<double>& c = ranks[i];
    const double steps = std::max(1.0, c[kStepsTaken]);
    auto bytes = [&](RankCounter k) { return static_cast<int64_t>(c[k]); };
    Summary::Rank row;
    row.rank = static_cast<int64_t>(i);
    row.host = i < hosts.size() ? hosts[i] : hardware::hostname();
    row.model_state_bytes = StateBytesRecord{
        bytes(kParameters), bytes(kGradients), bytes(kOptimizerState), bytes(kBuffers),
        bytes(kParameters) + bytes(kGradients) + bytes(kOptimizerState) + bytes(kBuffers)};
    row.peak_rss_bytes = bytes(kPeakRss);
    row.step_ms = step_ms_of(c);
    row.comm_s.emplace();
    row.comm_ms.emplace();  // per step, as step_ms
    for (size_t a = 0; a < comm_axes_.size(); ++a) {
      (*row.comm_s)[comm_axes_[a]] = c[kAxisBusy + a];
      (*row.comm_ms)[comm_axes_[a]] = c[kAxisBusy + a] * 1e3 / steps;
    }
    row.pipeline_bubble = bubble_if_staged(c);
    j.ranks->push_back(row);
  }
  // The run is done and its results are elsewhere: a summary that cannot be written
  // (the disk filled up since job.yaml was) is a warning, not a failed run.
  const std::string path = (fs::path(spec_.log.dir) / "summary.json").string();
  try {
    write_file_atomic(path, to_json(j).dump(2) + "\n");
  } catch (const Error& e) {
    std::fprintf(stderr, "warning: log.dir: the run's summary was not written: %s\n", e.what());
  }
}

}  // namespace tetra::core
