#include "core/run_folder.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "collectives/error.h"
#include "core/trace_merge.h"

namespace tetra::core {

namespace fs = std::filesystem;

// Note [Record fields]
// Each record's keys are declared once, as a function template over a visitor (as the job
// spec's are, Note [Fields declared once] in fields.h):
//
//   template <class V> void fields(V& v, EvalRecord& r) {
//     v.field(kStep, r.step);
//     v.constant(kEval, true);
//     ...
//   }
//
// and the one declaration is run by both visitors: Out writes the JSON object (an absent
// optional is no key; `flag` is a key only when true; `nullable` is null when absent) and
// In reads it back (an absent, null or mistyped key stays absent, so that a reader can
// tell "not written" from any value). A sub-object (step_ms, model_state_bytes, a rank's
// row) is a struct with its own fields(), run by the same visitor one level down. Keys
// that more than one record carries are the constants below; a key any other file spells
// is one too many. nlohmann::json objects keep their keys sorted, so the order of the
// declarations is not the order of the file.
namespace {

constexpr const char* kStep = "step";
constexpr const char* kEpoch = "epoch";
constexpr const char* kEval = "eval";
constexpr const char* kLoss = "loss";
constexpr const char* kTimeS = "time_s";
constexpr const char* kSamplesPerS = "samples_per_s";
constexpr const char* kSkippedSteps = "skipped_steps";
constexpr const char* kCheckpointFailures = "checkpoint_failures";
// A total in a train record's per-rank row; by kind in the record itself and the summary.
constexpr const char* kModelStateBytes = "model_state_bytes";

template <class V>
void fields(V& v, StateBytesRecord& s) {
  v.field("parameters", s.parameters);
  v.field("gradients", s.gradients);
  v.field("optimizer", s.optimizer);
  v.field("buffers", s.buffers);
  v.field("total", s.total);
}

template <class V>
void fields(V& v, StepMsRecord& s) {
  v.field("data", s.data);
  v.field("forward", s.forward);
  v.field("backward", s.backward);
  v.field("gradients", s.gradients);
  v.field("optimizer", s.optimizer);
}

template <class V>
void fields(V& v, RankFigures& r) {
  v.field("peak_rss_bytes", r.peak_rss_bytes);
  v.field("pipeline_bubble", r.pipeline_bubble);
  v.field("step_ms", r.step_ms);
  v.field("comm_ms", r.comm_ms);
}

template <class V>
void fields(V& v, TrainRecord::Rank& r) {
  fields(v, static_cast<RankFigures&>(r));
  v.field(kModelStateBytes, r.model_state_bytes);
}

template <class V>
void fields(V& v, TrainRecord& r) {
  fields(v, static_cast<RankFigures&>(r));
  v.field(kStep, r.step);
  v.field(kEpoch, r.epoch);
  v.field(kLoss, r.loss);  // a skipped step's is NaN: JSON null
  v.field("lr", r.lr);
  v.field(kSamplesPerS, r.samples_per_s);
  v.field(kTimeS, r.time_s);
  v.field(kSkippedSteps, r.skipped_steps);
  v.flag("skipped", r.skipped);
  v.field("grad_norm", r.grad_norm);
  v.field(kModelStateBytes, r.model_state_bytes);
  v.field("ranks", r.ranks);
}

template <class V>
void fields(V& v, EvalFigures& e) {
  v.field("test_loss", e.test_loss);
  v.field("perplexity", e.perplexity);
  v.field("test_accuracy", e.test_accuracy);
}

template <class V>
void fields(V& v, EvalRecord& r) {
  v.field(kStep, r.step);
  v.field(kEpoch, r.epoch);
  v.constant(kEval, true);
  v.field(kTimeS, r.time_s);
  fields(v, static_cast<EvalFigures&>(r));
}

template <class V>
void fields(V& v, CheckpointFailureRecord& r) {
  v.field(kStep, r.step);
  v.field(kCheckpointFailures, r.checkpoint_failures);
  v.field("checkpoint_error", r.checkpoint_error);
}

template <class V>
void fields(V& v, Summary::Rank& r) {
  fields(v, static_cast<RankFigures&>(r));
  v.field("rank", r.rank);
  v.field("host", r.host);
  v.field(kModelStateBytes, r.model_state_bytes);
  v.field("comm_s", r.comm_s);
}

template <class V>
void fields(V& v, Summary& s) {
  v.field("job", s.job);
  v.field("tetra", s.tetra);
  v.field("commit", s.commit);
  v.field("started", s.started);
  v.field("finished", s.finished);
  v.field("world", s.world);
  v.field("processes", s.processes);
  v.field("replicas", s.replicas);
  v.field("mesh", s.mesh);
  v.field("metrics", s.metrics);
  v.field("job_yaml", s.job_yaml);
  v.field("identity", s.identity);
  v.field("traces", s.traces);
  v.field("steps", s.steps);
  v.field("final_step", s.final_step);
  v.field(kSkippedSteps, s.skipped_steps);
  v.field("train_seconds", s.train_seconds);
  v.field("total_seconds", s.total_seconds);
  v.field(kSamplesPerS, s.samples_per_s);
  v.field("final_loss", s.final_loss);
  v.field("resumed_from", s.resumed_from);
  v.field("checkpoint", s.checkpoint);
  v.nullable("final_eval", s.final_eval);
  v.field("ranks", s.ranks);
}

// Writes a record's fields into `j`.
class Out {
 public:
  nlohmann::json j = nlohmann::json::object();

  template <class T>
  void field(const char* key, std::optional<T>& v) {
    if (v) j[key] = value(*v);
  }
  void field(const char* key, int64_t& v) { j[key] = v; }
  void field(const char* key, std::string& v) { j[key] = v; }
  void field(const char* key, nlohmann::json& v) { j[key] = v; }
  void flag(const char* key, bool& v) {
    if (v) j[key] = true;
  }
  void constant(const char* key, bool v) { j[key] = v; }
  template <class T>
  void nullable(const char* key, std::optional<T>& v) {
    j[key] = v ? value(*v) : nlohmann::json(nullptr);
  }

 private:
  static nlohmann::json value(double v) { return v; }
  static nlohmann::json value(int64_t v) { return v; }
  // Non-const, as the template below: else it would be the better match.
  static nlohmann::json value(AxisTimes& v) { return v; }
  static nlohmann::json value(std::map<std::string, int64_t>& v) { return v; }
  static nlohmann::json value(std::vector<std::string>& v) { return v; }
  template <class T>
  static nlohmann::json value(T& record) {
    Out o;
    fields(o, record);
    return o.j;
  }
  template <class T>
  static nlohmann::json value(std::vector<T>& rows) {
    nlohmann::json a = nlohmann::json::array();
    for (T& r : rows) a.push_back(value(r));
    return a;
  }
};

// Reads a record's fields from `j`: what is absent, null or of another type stays as it was.
class In {
 public:
  explicit In(const nlohmann::json& j) : j_(j) {}

  template <class T>
  void field(const char* key, std::optional<T>& v) {
    const nlohmann::json* x = find(key);
    if (!x) return;
    T read{};
    if (get(*x, read)) v = std::move(read);
  }
  void field(const char* key, int64_t& v) {
    if (const nlohmann::json* x = find(key); x && x->is_number()) v = x->get<int64_t>();
  }
  void field(const char* key, std::string& v) {
    if (const nlohmann::json* x = find(key); x && x->is_string()) v = x->get<std::string>();
  }
  void field(const char* key, nlohmann::json& v) {
    if (const nlohmann::json* x = find(key)) v = *x;
  }
  void flag(const char* key, bool& v) {
    const nlohmann::json* x = find(key);
    v = x && x->is_boolean() && x->get<bool>();
  }
  void constant(const char*, bool) {}
  template <class T>
  void nullable(const char* key, std::optional<T>& v) {
    field(key, v);
  }

 private:
  const nlohmann::json* find(const char* key) const {
    if (!j_.is_object()) return nullptr;
    const auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  static bool get(const nlohmann::json& x, double& v) {
    if (x.is_number()) v = x.get<double>();
    return x.is_number();
  }
  static bool get(const nlohmann::json& x, int64_t& v) {
    if (x.is_number()) v = x.get<int64_t>();
    return x.is_number();
  }
  static bool get(const nlohmann::json& x, AxisTimes& v) {
    if (!x.is_object()) return false;
    for (const auto& [k, t] : x.items())
      v[k] = t.is_number() ? t.get<double>() : std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  static bool get(const nlohmann::json& x, std::map<std::string, int64_t>& v) {
    if (!x.is_object()) return false;
    for (const auto& [k, n] : x.items())
      if (n.is_number()) v[k] = n.get<int64_t>();
    return true;
  }
  static bool get(const nlohmann::json& x, std::vector<std::string>& v) {
    if (!x.is_array()) return false;
    for (const auto& s : x)
      if (s.is_string()) v.push_back(s.get<std::string>());
    return true;
  }
  template <class T>
  static bool get(const nlohmann::json& x, T& record) {
    if (!x.is_object()) return false;
    In in(x);
    fields(in, record);
    return true;
  }
  template <class T>
  static bool get(const nlohmann::json& x, std::vector<T>& rows) {
    if (!x.is_array()) return false;
    for (const auto& e : x) {
      T r{};
      get(e, r);  // a row that is not an object: every figure absent
      rows.push_back(std::move(r));
    }
    return true;
  }

  const nlohmann::json& j_;
};

template <class T>
nlohmann::json write(const T& record) {
  Out o;
  fields(o, const_cast<T&>(record));  // Out only reads the fields
  return o.j;
}

template <class T>
T read(const nlohmann::json& j) {
  T r{};
  In in(j);
  fields(in, r);
  return r;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

nlohmann::json to_json(const TrainRecord& r) { return write(r); }
nlohmann::json to_json(const EvalRecord& r) { return write(r); }
nlohmann::json to_json(const CheckpointFailureRecord& r) { return write(r); }
nlohmann::json to_json(const Summary& s) { return write(s); }
Summary summary_from_json(const nlohmann::json& j) { return read<Summary>(j); }

// ---- metrics.jsonl --------------------------------------------------------------------

// Note [Resumed runs]: a resumed run appends to the metrics file of the run it resumes,
// from the step after its checkpoint, so steps can go back. As TensorBoard does at a
// SessionLog START, the later run wins: a train record whose step is not past the last
// train step kept (or an eval record before the last eval step) drops every record of
// every kind from that step on, and the report marks the step where the run resumed.
// The interrupted run's records between its checkpoint and that step are dropped too
// whenever the resumed run logs the step after its checkpoint (log.every divides
// checkpoint.every_steps, or is 1).
MetricsFile read_metrics(const std::string& path, BadLines bad) {
  std::ifstream in(path);
  MetricsFile m;
  m.path = path;
  if (!in) {
    if (bad == BadLines::kSkip) return m;
    throw ConfigError(path + ": cannot read");
  }
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json rec;
    try {
      rec = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      if (bad == BadLines::kSkip) continue;
      throw ConfigError(path + ":" + std::to_string(n) + ": not JSON (" + e.what() + ")");
    }
    if (bad == BadLines::kSkip && !rec.is_object()) continue;
    if (!rec.is_object()) throw ConfigError(path + ":" + std::to_string(n) + ": not a JSON object");
    ++m.records;
    // Kinds this reader does not know (a later trainer's) are counted and left out.
    const auto eval_it = rec.find(kEval);
    const bool eval = eval_it != rec.end() && *eval_it == true, failure = rec.contains(kCheckpointFailures),
               train = !eval && !failure && rec.contains(kLoss);
    const auto step_it = rec.find(kStep);
    if (step_it == rec.end() || !step_it->is_number_integer() || (!eval && !failure && !train)) {
      ++m.other;
      continue;
    }
    const int64_t step = step_it->get<int64_t>();
    // A run writes one train record per step; an eval twice at one step replaces.
    auto last = [](const auto& kind) { return kind.rbegin()->first; };
    const bool back = eval     ? !m.eval.empty() && step < last(m.eval)
                      : train  ? !m.train.empty() && step <= last(m.train)
                               : false;
    if (back) {
      m.train.erase(m.train.lower_bound(step), m.train.end());
      m.eval.erase(m.eval.lower_bound(step), m.eval.end());
      m.failures.erase(m.failures.lower_bound(step), m.failures.end());
      m.resumed_at.push_back(step);
    }
    if (eval)
      m.eval[step] = read<EvalRecord>(rec);
    else if (failure)
      m.failures[step] = read<CheckpointFailureRecord>(rec);
    else
      m.train[step] = read<TrainRecord>(rec);
  }
  return m;
}

// ---- the folder -----------------------------------------------------------------------

namespace {

// A path summary.json names: as written, else in DIR by its name (a run folder that was
// copied or moved elsewhere).
fs::path locate(const fs::path& dir, const std::string& named) {
  std::error_code ec;
  const fs::path p(named);
  if (fs::exists(p, ec)) return p;
  if (p.is_relative() && fs::exists(dir / p, ec)) return dir / p;
  if (fs::exists(dir / p.filename(), ec)) return dir / p.filename();
  return p;
}

// Without summary.json: DIR/trace*.json, and only the per-rank files when there are some
// (a trace.json beside them is trace-merge's output).
std::vector<std::string> default_traces(const fs::path& dir) {
  for (const char* pattern : {"trace*rank*.json", "trace*.json"}) {
    try {
      return find_trace_files({(dir / pattern).string()});
    } catch (const ConfigError&) {  // nothing matches
    }
  }
  return {};
}

}  // namespace

RunFolder read_run_folder(const std::string& dir_name) {
  const fs::path dir(dir_name);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw ConfigError(dir.string() + ": no such folder (the run's log.dir)");
  RunFolder run;
  run.dir = dir_name;
  const fs::path summary = dir / "summary.json";
  if (fs::exists(summary, ec)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(slurp(summary));
    } catch (const nlohmann::json::exception& e) {
      throw ConfigError(summary.string() + ": not JSON (" + e.what() + ")");
    }
    if (!j.is_object()) throw ConfigError(summary.string() + ": not a JSON object");
    run.summary = summary_from_json(j);
  }
  fs::path metrics = dir / "metrics.jsonl";
  const std::string named = run.summary ? run.summary->metrics : "";
  if (!named.empty()) {
    metrics = locate(dir, named);
    if (metrics != fs::path(named)) run.notes.push_back("summary.json names " + named + "; read " + metrics.string());
  }
  if (!fs::exists(metrics, ec))
    throw ConfigError(dir.string() + ": no metrics (" + metrics.string() + " does not exist; set log.metrics)");
  run.metrics = read_metrics(metrics.string());
  if (run.metrics.train.empty() && run.metrics.eval.empty())
    throw ConfigError(metrics.string() + ": no train or eval records (" + std::to_string(run.metrics.records) +
                      " records, none with an integer \"" + kStep + "\" and a \"" + kLoss + "\" or \"" + kEval +
                      "\": true)");
  if (run.metrics.other)
    run.notes.push_back(std::to_string(run.metrics.other) + " of the " + std::to_string(run.metrics.records) +
                        " records in " + metrics.string() +
                        " are of no kind this report knows (no integer step, or neither train, eval nor checkpoint "
                        "failure): left out");

  fs::path job_path = dir / "job.yaml";
  const std::string job = run.summary ? run.summary->job_yaml : "";
  if (!job.empty()) job_path = locate(dir, job);
  run.job_path = job_path.string();
  if (fs::exists(job_path, ec)) {
    run.job_yaml = slurp(job_path);
    run.has_job = true;
  }

  if (run.summary && run.summary->traces && !run.summary->traces->empty()) {
    for (const std::string& t : *run.summary->traces) {
      const fs::path p = locate(dir, t);
      if (fs::exists(p, ec))
        run.traces.push_back(p.string());
      else
        run.notes.push_back("summary.json names the trace " + t + ", which is not there");
    }
  } else {
    run.traces = default_traces(dir);
  }
  return run;
}

}  // namespace tetra::core
