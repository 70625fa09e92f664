// A trial of the tuner (Note [Tuner]): the candidate's job made short and quiet, started
// by the caller's TrialLauncher, and what its run folder says of its steps.
#include "tools/planner/tune_steps.h"

#include <signal.h>

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/job_spec.h"
#include "core/run_folder.h"
#include "hardware/host.h"
#include "hardware/topology.h"

namespace tetra::planner::tuning {

using namespace tetra::core;

namespace {

bool looks_out_of_memory(const Launched& e, const std::string& log) {
  return e.status == 128 + SIGKILL || log.find("bad_alloc") != std::string::npos ||
         log.find("out of memory") != std::string::npos || log.find("Cannot allocate memory") != std::string::npos ||
         log.find("DefaultCPUAllocator: can't allocate") != std::string::npos;
}

// What a trial's metrics say: its step past the warm-up and where it went. A trial stopped
// at the budget may have left half a line, or no file: what is whole is read.
void read_metrics(Candidate& c, const std::string& path, int warmup) {
  std::vector<TrainRecord> recs;
  for (auto& [step, r] : core::read_metrics(path, BadLines::kSkip).train)
    if (r.samples_per_s && step > warmup) recs.push_back(std::move(r));
  if (recs.empty()) return;
  const double batch = static_cast<double>(c.spec.data.batch_size);
  std::vector<double> steps;
  for (const auto& r : recs)
    if (*r.samples_per_s > 0) steps.push_back(batch / *r.samples_per_s);
  c.measured_s = median(steps);
  // Memory: the largest rank's, at the last record.
  const TrainRecord& last = recs.back();
  if (last.ranks) {
    for (const auto& row : *last.ranks) {
      c.measured_rss = std::max<int64_t>(c.measured_rss, row.peak_rss_bytes.value_or(0));
      c.measured_state = std::max<int64_t>(c.measured_state, row.model_state_bytes.value_or(0));
    }
  } else {
    c.measured_rss = last.peak_rss_bytes.value_or(0);
    if (last.model_state_bytes) c.measured_state = last.model_state_bytes->total.value_or(0);
  }
  // The phases of the rank with the most compute (a pipeline's slowest stage).
  using Ms = std::optional<double> StepMsRecord::*;
  auto phases_of = [&](const TrainRecord& r, size_t rank) -> const std::optional<StepMsRecord>& {
    return r.ranks ? (*r.ranks)[rank].step_ms : r.step_ms;
  };
  const size_t ranks = last.ranks ? last.ranks->size() : 1;
  auto phase = [&](size_t rank, std::initializer_list<Ms> parts) {
    std::vector<double> v;
    for (const auto& r : recs) {
      if (r.ranks && r.ranks->size() != ranks) continue;
      const std::optional<StepMsRecord>& p = phases_of(r, rank);
      double sum = 0;
      for (Ms k : parts) sum += p ? ((*p).*k).value_or(0.0) : 0.0;
      v.push_back(sum / 1e3);
    }
    return median(v);
  };
  const std::initializer_list<Ms> compute = {&StepMsRecord::forward, &StepMsRecord::backward};
  size_t slow = 0;
  for (size_t k = 1; k < ranks; ++k)
    if (phase(k, compute) > phase(slow, compute)) slow = k;
  c.measured_phases["compute"] = phase(slow, compute);
  c.measured_phases["optimizer"] = phase(slow, {&StepMsRecord::optimizer});
  c.measured_phases["loading"] = phase(slow, {&StepMsRecord::data});
  std::map<std::string, std::vector<double>> comm;
  std::vector<double> bubble;
  for (const auto& r : recs) {
    if (r.comm_ms)
      for (const auto& [axis, v] : *r.comm_ms) comm[axis].push_back(v / 1e3);
    if (r.pipeline_bubble && *r.samples_per_s > 0)
      bubble.push_back(*r.pipeline_bubble * batch / *r.samples_per_s);
  }
  // A pipeline's busy time on its axis is its waits for the other stages: the bubble's.
  for (const auto& [axis, v] : comm)
    if (axis != "pipeline") c.measured_phases["comm " + axis] = median(v);
  if (!bubble.empty()) c.measured_phases["bubble"] = median(bubble);
  c.measured_phases["step"] = c.measured_s;
}

}  // namespace

// The log's line that says what went wrong: the last "error" line, else the last line.
std::string failure_line(const std::string& log) {
  std::istringstream in(log);
  std::string line, last, error;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    last = line;
    if (line.find("error") != std::string::npos || line.find("Error") != std::string::npos) error = line;
  }
  std::string s = error.empty() ? last : error;
  if (s.size() > 200) s = s.substr(0, 197) + "...";
  return s;
}

// A trial: the candidate's job made short and quiet, under the launcher.
void run_trial(Candidate& c, const TuneOptions& o, TrialLauncher& launcher, const std::string& dir,
               double seconds_left) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  c.dir = dir;
  YAML::Node job = YAML::Load(c.yaml);
  job["train"]["max_steps"] = o.warmup_steps + o.trial_steps;
  job["train"]["eval_every"] = 0;
  job["checkpoint"]["dir"] = "";
  job["checkpoint"]["safetensors"] = "";
  job["log"]["dir"] = dir;
  job["log"]["metrics"] = "metrics.jsonl";
  job["log"]["every"] = 5;
  job["log"]["progress"] = "off";
  job["log"]["trace"] = "";
  job["log"]["tensorboard"] = "";
  const std::string file = dir + "/trial.yaml";
  std::ofstream(file) << resolved_yaml(job);
  const Launched e = launcher.train(file, dir + "/log.txt", seconds_left);
  if (e.timed_out) {
    c.trial = Candidate::Trial::kTimedOut;
    c.failure = "stopped at the budget";
  } else if (e.status != 0) {
    c.trial = looks_out_of_memory(e, e.log) ? Candidate::Trial::kOutOfMemory : Candidate::Trial::kFailed;
    c.failure = "exit " + std::to_string(e.status) + ": " + failure_line(e.log);
    return;
  }
  read_metrics(c, dir + "/metrics.jsonl", o.warmup_steps);
  if (e.timed_out) return;
  if (c.measured_s > 0) {
    c.trial = Candidate::Trial::kOk;
  } else {
    c.trial = Candidate::Trial::kFailed;
    c.failure = "no step measured after the warm-up (" + dir + "/metrics.jsonl)";
  }
}

// The memory one process may hold: --memory-gb, else the host's shared by its processes
// (a job on cuda: its device's, where this host has one).
int64_t memory_limit(const TuneOptions& o, const JobSpec& spec) {
  if (o.memory_gb > 0) return static_cast<int64_t>(o.memory_gb * double(int64_t{1} << 30));
  if (spec.train.device == DeviceKind::kCuda) {
    const hardware::HostTopology host = hardware::discover_host();
    if (!host.gpus.empty()) return host.gpus.front().memory_bytes;
    return 0;  // a plan on paper for GPUs this host lacks: --memory-gb says their size
  }
  const int per_host = o.ranks_per_host > 0 ? std::min(o.ranks_per_host, o.np) : o.np;
  return hardware::total_memory_bytes() / std::max(1, per_host);
}

}  // namespace tetra::planner::tuning
