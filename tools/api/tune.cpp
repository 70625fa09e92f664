#include "tetra/tune.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdarg>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <thread>

#include "collectives/build_config.h"
#include "collectives/error.h"
#include "collectives/launch.h"
#include "core/plan.h"
#include "core/preflight.h"
#include "core/strategy_config.h"
#include "core/trainer.h"
#include "core/report.h"
#include "hardware/host.h"
#include "hardware/topology.h"
#include "tetra/run.h"
#include "tetra/tetra.h"

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

namespace tetra {

namespace {

using namespace tetra::core;
using Clock = std::chrono::steady_clock;

void say(std::FILE* out, const char* format, ...) {
  if (!out) return;
  va_list args;
  va_start(args, format);
  std::vfprintf(out, format, args);
  va_end(args);
  std::fflush(out);
}

std::string fmt(const char* format, ...) {
  char line[2048];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  return line;
}

std::string clock_text(double seconds) {
  const int s = static_cast<int>(std::max(0.0, seconds) + 0.5);
  return fmt("%d:%02d", s / 60, s % 60);
}

std::string ms(double seconds) { return seconds < 0 ? "-" : fmt("%.2f", seconds * 1e3); }

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// `node` with the dotted `key` set to `value` (parsed as YAML), or its section removed for "~".
void apply_key(YAML::Node& node, const std::string& key, const std::string& value) {
  const size_t dot = key.find('.');
  if (dot == std::string::npos) {
    if (value == "~") node.remove(key);
    else node[key] = YAML::Load(value);
    return;
  }
  const std::string section = key.substr(0, dot), rest = key.substr(dot + 1);
  if (!node[section] || !node[section].IsMap()) node[section] = YAML::Node(YAML::NodeType::Map);
  YAML::Node child = node[section];
  apply_key(child, rest, value);
}

SectionRegistry& plugins() {
  static SectionRegistry registry = [] {
    SectionRegistry r;
    register_builtin_plugins(r);
    return r;
  }();
  return registry;
}

// The model's shapes, once per tensor degree (a tensor split builds other layers), for
// the rules that need them (Trainer::check_model, which `train --check` asks).
class ModelRules {
 public:
  void check(const JobSpec& spec, const Plan& plan) {
    std::unique_ptr<Trainer>& t = built_[spec.mesh.size("tensor")];
    if (!t) {
      TrainerOptions dry;
      dry.dry_run = true;
      t = std::make_unique<Trainer>(spec, dry);
    }
    PlanInput in{plan, spec, t->model(), t->dataset(), t->probe()};
    if (const std::string problems = model_problems(in); !problems.empty()) throw ConfigError(problems);
  }

 private:
  std::map<int, std::unique_ptr<Trainer>> built_;
};

// Note [Auto axis]: the world a job's auto axis fills is the one it is tuned for.
JobWorld tuning_world(const TuneOptions& o) { return {o.np, "--np " + std::to_string(o.np)}; }

// The candidate's job: the base's resolved YAML with its keys applied, parsed like a file
// and checked as `train --check` checks it: the plan's rules, np, the model's rules.
// Throws ConfigError.
void build(Candidate& c, const YAML::Node& resolved, const TuneOptions& o, ModelRules& rules) {
  YAML::Node node = YAML::Clone(resolved);
  for (const auto& [key, value] : c.keys) apply_key(node, key, value);
  ParsedJob parsed = parse_job_string(resolved_yaml(node), o.job, {}, plugins(), {}, tuning_world(o));
  parsed.spec.source = o.job;
  const Plan plan(parsed.spec);
  plan.check_world(o.np, "--np " + std::to_string(o.np));
  rules.check(parsed.spec, plan);
  c.yaml = resolved_yaml(parsed.resolved);
  c.spec = std::move(parsed.spec);
}

// Two rounds of one trial agree when the slower is within this factor of the faster;
// otherwise the trial gets a third round (Note [Tuner]).
constexpr double kRoundsAgree = 1.10;

// How far a trial's slowest round was from its fastest (0.3: 30% slower); 0 for one round.
double spread_of(const std::vector<double>& rounds) {
  if (rounds.size() < 2) return 0;
  const auto [lo, hi] = std::minmax_element(rounds.begin(), rounds.end());
  return *hi / *lo - 1;
}
bool rounds_agree(const std::vector<double>& rounds) {
  if (rounds.size() < 2) return true;
  const auto [lo, hi] = std::minmax_element(rounds.begin(), rounds.end());
  return *hi <= kRoundsAgree * *lo;
}

// What a candidate's keys say, for the table.
std::string label_of(const std::map<std::string, std::string>& k) {
  auto get = [&](const std::string& key) {
    auto it = k.find(key);
    return it == k.end() ? std::string() : it->second;
  };
  std::string s = "data " + get("mesh.data");
  if (get("mesh.pipeline") != "1") {
    s += " x pipeline " + get("mesh.pipeline") + " (" + get("pipeline.schedule") + ", " + get("pipeline.micro_batches") +
         " micro)";
  }
  if (get("mesh.tensor") != "1") s += " x tensor " + get("mesh.tensor");
  if (!get("replicate.replicas").empty()) s += " x " + get("replicate.replicas") + " replicas";
  const std::string zero = get("zero.stage");
  if (!zero.empty()) {
    s += " | zero " + zero + ", bucket " + get("zero.bucket_mb") + " MB";
    if (zero == "3") s += ", prefetch " + get("zero.prefetch");
  } else if (!get("data_parallel.bucket_mb").empty()) {
    s += " | allreduce, bucket " + get("data_parallel.bucket_mb") + " MB";
    if (get("data_parallel.hierarchical") != "auto") s += ", hierarchical " + get("data_parallel.hierarchical");
  }
  const std::string threads = get("train.threads");
  s += " | threads " + (threads == "0" ? std::string("auto") : threads);
  return s;
}

// The job as the user wrote it, in the table's words.
std::string label_of(const JobSpec& spec) {
  std::map<std::string, std::string> k;
  for (const char* axis : {"data", "pipeline", "tensor"}) k[std::string("mesh.") + axis] = std::to_string(spec.mesh.size(axis));
  const Plan plan(spec);
  if (plan.replicas() > 1) k["replicate.replicas"] = std::to_string(plan.replicas());
  k["train.threads"] = std::to_string(spec.train.threads);
  YAML::Node r = YAML::Load(spec.resolved);
  auto text = [&](const char* section, const char* key) {
    return r[section] && r[section][key] ? r[section][key].as<std::string>() : std::string();
  };
  if (spec.mesh.size("pipeline") > 1) {
    k["pipeline.schedule"] = text("pipeline", "schedule");
    k["pipeline.micro_batches"] = text("pipeline", "micro_batches");
  }
  if (r["zero"]) {
    k["zero.stage"] = text("zero", "stage");
    k["zero.bucket_mb"] = text("zero", "bucket_mb");
    k["zero.prefetch"] = text("zero", "prefetch");
  } else if (spec.mesh.size("data") * plan.replicas() > 1 && r["data_parallel"]) {
    k["data_parallel.bucket_mb"] = text("data_parallel", "bucket_mb");
    k["data_parallel.hierarchical"] = text("data_parallel", "hierarchical");
  }
  return label_of(k) + " (as given)";
}

double median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

std::string to_string(Candidate::Trial t) {
  switch (t) {
    case Candidate::Trial::kNotRun: return "not run";
    case Candidate::Trial::kOk: return "ok";
    case Candidate::Trial::kFailed: return "failed";
    case Candidate::Trial::kOutOfMemory: return "out of memory";
    case Candidate::Trial::kTimedOut: return "out of time";
  }
  return "?";
}

std::vector<Candidate> enumerate_candidates(const TuneOptions& o, int* rejected) {
  const ParsedJob base = parse_job_file(o.job, o.sets, plugins(), tuning_world(o));
  const JobSpec& spec = base.spec;
  // The data it reads, the folders it writes: the same for every candidate. A plan on
  // paper is for another machine: its device is not this one's to check.
  if (o.dry_run) {
    JobSpec here = spec;
    here.train.device = DeviceKind::kCpu;
    check_paths(here);
  } else {
    check_paths(spec);
  }
  ModelRules rules;
  const int N = o.np;
  if (N < 1) throw ConfigError("--np " + std::to_string(N) + ": the tuner needs the processes the job will run on (--np N)");
  const int per_host = o.ranks_per_host > 0 ? std::min(o.ranks_per_host, N) : N;
  const bool cpu = spec.train.device == DeviceKind::kCpu;
  // Replica threads share a process's device; priced by a FLOP rate per device (a plan on
  // paper with a calibration file) they would seem to multiply it.
  const bool paper_rate = o.dry_run && !o.calibration.empty();
  std::vector<int> replica_choices = {1};
  if (cpu && !paper_rate) replica_choices.push_back(2);
  int bad = 0;
  std::vector<Candidate> out;
  std::set<std::string> seen;  // yaml
  auto add = [&](Candidate c) {
    try {
      build(c, base.resolved, o, rules);
    } catch (const ConfigError&) {
      ++bad;
      return;
    } catch (const DataError&) {
      ++bad;
      return;
    }
    if (!seen.insert(c.yaml).second) return;  // the same job by another road (the as-given one)
    out.push_back(std::move(c));
  };
  // The job as given, when it fits np.
  {
    Candidate c;
    c.as_given = true;
    try {
      build(c, base.resolved, o, rules);
      c.label = label_of(c.spec);
      c.structure = "as given";
      seen.insert(c.yaml);
      out.push_back(std::move(c));
    } catch (const ConfigError&) {  // another np than the job's mesh: only the enumeration's layouts
    } catch (const DataError&) {
    }
  }
  const bool has_tensor = base.resolved["tensor"].IsDefined();
  for (int t : divisors(N))
    for (int p : divisors(N / t)) {
      const int d = N / t / p;
      for (int R : replica_choices) {
        std::vector<int> threads = {spec.train.threads};
        if (cpu && !paper_rate) {
          const int share = std::max(1, hardware::usable_cores() / (per_host * R));
          if (share != spec.train.threads) threads.push_back(share);
        }
        const bool data_group = d * R > 1;
        const bool spans_hosts = per_host < N && data_group;
        std::vector<int> stages = {0};
        if (data_group) stages = {0, 1, 2, 3};
        std::vector<std::pair<int, std::string>> pipes = {{0, ""}};
        if (p > 1) {
          pipes.clear();
          for (int m : {p, 2 * p, 4 * p})
            for (const char* s : {"1f1b", "gpipe", "interleaved_1f1b", "zbh1", "zbv"}) pipes.push_back({m, s});
        }
        for (int th : threads)
          for (int stage : stages)
            for (const auto& [m, schedule] : pipes) {
              std::map<std::string, std::string> k;
              k["mesh.data"] = std::to_string(d);
              k["mesh.pipeline"] = std::to_string(p);
              k["mesh.tensor"] = std::to_string(t);
              if (R > 1) k["replicate.replicas"] = std::to_string(R);
              else k["replicate"] = "~";
              if (t == 1 && has_tensor) k["tensor"] = "~";
              if (p > 1) {
                k["pipeline.micro_batches"] = std::to_string(m);
                k["pipeline.schedule"] = schedule;
                k["pipeline.virtual_stages"] = schedule == "interleaved_1f1b" || schedule == "zbv" ? "2" : "1";
              } else {
                k["pipeline"] = "~";
              }
              k["train.threads"] = std::to_string(th);
              // Structures carry the defaults of what refinements vary.
              std::vector<std::map<std::string, std::string>> variants;
              if (stage > 0) {
                k["zero.stage"] = std::to_string(stage);
                for (double b : {25.0, 4.0, 1.0})
                  for (int pf : stage == 3 ? std::vector<int>{1, 2} : std::vector<int>{1}) {
                    auto v = k;
                    v["zero.bucket_mb"] = fmt("%g", b);
                    if (stage == 3) v["zero.prefetch"] = std::to_string(pf);
                    variants.push_back(v);
                  }
              } else {
                k["zero"] = "~";
                if (data_group) {
                  for (const char* h : spans_hosts ? std::vector<const char*>{"auto", "off", "on"}
                                                   : std::vector<const char*>{"auto"})
                    for (double b : {25.0, 4.0, 1.0}) {
                      auto v = k;
                      v["data_parallel.bucket_mb"] = fmt("%g", b);
                      v["data_parallel.hierarchical"] = h;
                      variants.push_back(v);
                    }
                } else {
                  variants.push_back(k);
                }
              }
              const std::string structure = label_of(variants.front());
              for (size_t i = 0; i < variants.size(); ++i) {
                Candidate c;
                c.keys = variants[i];
                c.label = label_of(c.keys);
                c.structure = structure;
                c.refinement = i > 0;
                add(std::move(c));
              }
            }
      }
    }
  if (rejected) *rejected = bad;
  return out;
}

void prune_by_memory(std::vector<Candidate>& candidates, int64_t limit_bytes) {
  for (Candidate& c : candidates)
    if (c.priced && c.invalid.empty() && limit_bytes > 0 && c.predicted_bytes > limit_bytes)
      c.pruned = human_bytes(c.predicted_bytes) + " > " + human_bytes(limit_bytes);
}

double corrected_step(const Candidate& c, const std::map<std::string, double>& ratios) {
  const StepPrediction& p = c.prediction;
  if (ratios.empty() || p.total_s <= 0) return c.predicted_s;
  auto r = [&](const char* phase) {
    auto it = ratios.find(phase);
    return it == ratios.end() ? 1.0 : it->second;
  };
  return p.loading_s * r("loading") + p.compute_s * r("compute") + (p.pipeline_s + p.bubble_s) * r("bubble") +
         p.other_s + p.optimizer_s * r("optimizer");
}

std::vector<int> trial_order(const std::vector<Candidate>& candidates, int count,
                             const std::map<std::string, double>& ratios) {
  std::vector<int> order;
  std::set<std::string> taken;  // structures measured already
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    if (c.trial != Candidate::Trial::kNotRun) {
      taken.insert(c.structure);
      continue;
    }
    if (!c.as_given && c.priced && c.invalid.empty() && c.pruned.empty() && c.predicted_s > 0)
      order.push_back(static_cast<int>(i));
  }
  // By predicted step (corrected by the trials so far), within the model's resolution
  // (0.5%: steps closer than that are a tie) the one that holds less memory first (ZeRO-1
  // before a plain allreduce that sends the same bytes).
  std::vector<double> step(candidates.size(), 0);
  for (int i : order) step[static_cast<size_t>(i)] = corrected_step(candidates[static_cast<size_t>(i)], ratios);
  auto key = [&](int i) {
    return std::make_pair(std::floor(std::log(step[static_cast<size_t>(i)]) / std::log(1.005)),
                          candidates[static_cast<size_t>(i)].predicted_bytes);
  };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key(a) < key(b); });
  // The best of each structure first (a bucket size rarely moves a step by more than a
  // trial's noise; another layout or stage may), then the rest in the same order.
  std::vector<int> first, then;
  for (int i : order) (taken.insert(candidates[static_cast<size_t>(i)].structure).second ? first : then).push_back(i);
  first.insert(first.end(), then.begin(), then.end());
  if (static_cast<int>(first.size()) > count) first.resize(static_cast<size_t>(std::max(0, count)));
  return first;
}

double rank_correlation(const std::vector<double>& a, const std::vector<double>& b) {
  const size_t n = std::min(a.size(), b.size());
  if (n < 3) return std::numeric_limits<double>::quiet_NaN();
  auto ranks = [n](const std::vector<double>& v) {
    std::vector<size_t> idx(n);
    for (size_t i = 0; i < n; ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](size_t x, size_t y) { return v[x] < v[y]; });
    std::vector<double> r(n);
    for (size_t i = 0; i < n;) {
      size_t j = i;
      while (j + 1 < n && v[idx[j + 1]] == v[idx[i]]) ++j;
      for (size_t k = i; k <= j; ++k) r[idx[k]] = (double(i) + double(j)) / 2 + 1;
      i = j + 1;
    }
    return r;
  };
  const std::vector<double> ra = ranks(a), rb = ranks(b);
  double ma = 0, mb = 0;
  for (size_t i = 0; i < n; ++i) ma += ra[i], mb += rb[i];
  ma /= double(n), mb /= double(n);
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < n; ++i) {
    sab += (ra[i] - ma) * (rb[i] - mb);
    saa += (ra[i] - ma) * (ra[i] - ma);
    sbb += (rb[i] - mb) * (rb[i] - mb);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : std::numeric_limits<double>::quiet_NaN();
}

namespace {

// Splits a launcher's words on spaces ("mpirun -np 4 --hostfile h").
std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> w;
  std::istringstream in(s);
  for (std::string x; in >> x;) w.push_back(x);
  return w;
}

std::vector<std::string> launcher_words(const TuneOptions& o) {
  if (!o.launcher.empty()) {
    std::string l = o.launcher;
    for (size_t at; (at = l.find("{np}")) != std::string::npos;) l.replace(at, 4, std::to_string(o.np));
    return words(l);
  }
  if (o.np == 1) return {};
  if (const char* slurm = std::getenv("SLURM_JOB_ID"); slurm && *slurm)
    return {"srun", "--mpi=pmix", "-n", std::to_string(o.np)};
  std::vector<std::string> w = {*TETRA_MPIEXEC ? TETRA_MPIEXEC : "mpirun", "-np", std::to_string(o.np), "--oversubscribe", "--bind-to", "none"};
  if (::geteuid() == 0) w.push_back("--allow-run-as-root");
  return w;
}

struct Exit {
  int status = -1;  // exit status, or 128 + signal
  bool timed_out = false;
};

// Runs argv with stdout and stderr to `log`, in a process group of its own that is ended
// (SIGTERM, then SIGKILL after 5 s) at `deadline`.
Exit run_command(const std::vector<std::string>& argv, const std::string& log, Clock::time_point deadline) {
  Exit e;
  const pid_t pid = ::fork();
  if (pid < 0) return e;
  if (pid == 0) {
    ::setpgid(0, 0);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "tune: cannot start %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  int status = 0;
  bool termed = false;
  Clock::time_point kill_at{};
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return e;
    const auto now = Clock::now();
    if (!termed && now >= deadline) {
      ::kill(-pid, SIGTERM);
      termed = true;
      e.timed_out = true;
      kill_at = now + std::chrono::seconds(5);
    } else if (termed && now >= kill_at) {
      ::kill(-pid, SIGKILL);
      kill_at = now + std::chrono::hours(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(-pid, SIGKILL);  // what the launcher left behind
  e.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return e;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

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

bool looks_out_of_memory(const Exit& e, const std::string& log) {
  return e.status == 128 + SIGKILL || log.find("bad_alloc") != std::string::npos ||
         log.find("out of memory") != std::string::npos || log.find("Cannot allocate memory") != std::string::npos ||
         log.find("DefaultCPUAllocator: can't allocate") != std::string::npos;
}

// What a trial's metrics say: its step past the warm-up and where it went.
void read_metrics(Candidate& c, const std::string& path, int warmup) {
  std::ifstream in(path);
  std::vector<nlohmann::json> recs;
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("samples_per_s") || j.contains("eval")) continue;
    if (!j.contains("step") || j["step"].get<int64_t>() <= warmup) continue;
    recs.push_back(std::move(j));
  }
  if (recs.empty()) return;
  const double batch = static_cast<double>(c.spec.data.batch_size);
  std::vector<double> steps;
  for (const auto& r : recs)
    if (r["samples_per_s"].get<double>() > 0) steps.push_back(batch / r["samples_per_s"].get<double>());
  c.measured_s = median(steps);
  // Memory: the largest rank's, at the last record.
  const nlohmann::json& last = recs.back();
  if (last.contains("ranks")) {
    for (const auto& row : last["ranks"]) {
      c.measured_rss = std::max<int64_t>(c.measured_rss, row.value("peak_rss_bytes", int64_t{0}));
      c.measured_state = std::max<int64_t>(c.measured_state, row.value("model_state_bytes", int64_t{0}));
    }
  } else {
    c.measured_rss = last.value("peak_rss_bytes", int64_t{0});
    if (last.contains("model_state_bytes")) c.measured_state = last["model_state_bytes"].value("total", int64_t{0});
  }
  // The phases of the rank with the most compute (a pipeline's slowest stage).
  auto phases_of = [&](const nlohmann::json& r, size_t rank) -> const nlohmann::json& {
    return r.contains("ranks") ? r["ranks"][rank]["step_ms"] : r["step_ms"];
  };
  const size_t ranks = last.contains("ranks") ? last["ranks"].size() : 1;
  auto phase = [&](size_t rank, std::initializer_list<const char*> keys) {
    std::vector<double> v;
    for (const auto& r : recs) {
      if (r.contains("ranks") && r["ranks"].size() != ranks) continue;
      const nlohmann::json& p = phases_of(r, rank);
      double sum = 0;
      for (const char* k : keys) sum += p.value(k, 0.0);
      v.push_back(sum / 1e3);
    }
    return median(v);
  };
  size_t slow = 0;
  for (size_t k = 1; k < ranks; ++k)
    if (phase(k, {"forward", "backward"}) > phase(slow, {"forward", "backward"})) slow = k;
  c.measured_phases["compute"] = phase(slow, {"forward", "backward"});
  c.measured_phases["optimizer"] = phase(slow, {"optimizer"});
  c.measured_phases["loading"] = phase(slow, {"data"});
  std::map<std::string, std::vector<double>> comm;
  std::vector<double> bubble;
  for (const auto& r : recs) {
    if (r.contains("comm_ms"))
      for (const auto& [axis, v] : r["comm_ms"].items()) comm[axis].push_back(v.get<double>() / 1e3);
    if (r.contains("pipeline_bubble") && r["samples_per_s"].get<double>() > 0)
      bubble.push_back(r["pipeline_bubble"].get<double>() * batch / r["samples_per_s"].get<double>());
  }
  // A pipeline's busy time on its axis is its waits for the other stages: the bubble's.
  for (const auto& [axis, v] : comm)
    if (axis != "pipeline") c.measured_phases["comm " + axis] = median(v);
  if (!bubble.empty()) c.measured_phases["bubble"] = median(bubble);
  c.measured_phases["step"] = c.measured_s;
}

// The prediction's terms under the names read_metrics gives the measured ones.
std::map<std::string, double> predicted_phases(const StepPrediction& p) {
  std::map<std::string, double> m = {{"compute", p.compute_s}, {"optimizer", p.optimizer_s},
                                     {"loading", p.loading_s}, {"step", p.total_s}};
  for (const AxisTime& a : p.axes)
    if (a.axis != "pipeline") m["comm " + a.axis] = a.seconds;
  // What a stage idles: the fill and drain, and the activations' transfers it waits for.
  if (p.bubble_s + p.pipeline_s > 0) m["bubble"] = p.bubble_s + p.pipeline_s;
  return m;
}

std::string self_exe() {
  std::error_code ec;
  const auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("train") : p.string();
}

// A trial: the candidate's job made short and quiet, under the launcher.
void run_trial(Candidate& c, const TuneOptions& o, const std::string& dir, double seconds_left) {
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
  std::vector<std::string> argv = launcher_words(o);
  argv.push_back(o.train_exe.empty() ? self_exe() : o.train_exe);
  argv.push_back(file);
  const Exit e = run_command(argv, dir + "/log.txt",
                             Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds_left * 1000)));
  const std::string log = read_text(dir + "/log.txt");
  if (e.timed_out) {
    c.trial = Candidate::Trial::kTimedOut;
    c.failure = "stopped at the budget";
  } else if (e.status != 0) {
    c.trial = looks_out_of_memory(e, log) ? Candidate::Trial::kOutOfMemory : Candidate::Trial::kFailed;
    c.failure = "exit " + std::to_string(e.status) + ": " + failure_line(log);
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

// measured / predicted per phase, the geometric mean over the trials that measured both.
std::map<std::string, double> phase_ratios(const std::vector<Candidate>& cs) {
  std::map<std::string, std::pair<double, int>> logs;
  for (const Candidate& c : cs) {
    if (c.trial != Candidate::Trial::kOk) continue;
    for (const auto& [name, m] : c.measured_phases) {
      auto p = c.predicted_phases.find(name);
      if (p == c.predicted_phases.end() || !(p->second > 1e-6) || !(m > 1e-6)) continue;
      logs[name].first += std::log(m / p->second);
      logs[name].second += 1;
    }
  }
  std::map<std::string, double> r;
  for (const auto& [name, v] : logs) r[name] = std::exp(v.first / v.second);
  return r;
}

std::string ratios_text(const std::map<std::string, double>& r) {
  std::string s;
  // compute first, step last, the rest by name.
  auto add = [&](const std::string& name, double v) { s += (s.empty() ? "" : ", ") + name + " " + fmt("%.2f", v); };
  if (r.count("compute")) add("compute", r.at("compute"));
  for (const auto& [name, v] : r)
    if (name != "compute" && name != "step") add(name, v);
  if (r.count("step")) add("step", r.at("step"));
  return s;
}

std::string command_line(const TuneOptions& o) {
  std::string s = "train " + o.job;
  for (const auto& x : o.sets) s += " --set " + x;
  s += " --tune --np " + std::to_string(o.np);
  if (o.ranks_per_host > 0) s += " --ranks-per-host " + std::to_string(o.ranks_per_host);
  if (o.memory_gb > 0) s += " --memory-gb " + fmt("%g", o.memory_gb);
  if (o.dry_run) s += " --dry-run";
  return s;
}

std::string written_job(const TuneResult& r, const TuneOptions& o, const std::string& launcher) {
  const Candidate& c = r.candidates[static_cast<size_t>(r.chosen)];
  std::string h;
  char when[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  int priced = 0, fits = 0;
  for (const Candidate& x : r.candidates) {
    priced += x.priced && x.invalid.empty();
    fits += x.priced && x.invalid.empty() && x.pruned.empty();
  }
  h += "# Chosen by `" + command_line(o) + "` (tetra " + TETRA_VERSION +
       (*TETRA_GIT_COMMIT ? std::string(", commit ") + TETRA_GIT_COMMIT : std::string()) + ", " + when + "):\n";
  h += fmt("#   %zu candidates, %d priced valid by the cost model, %d within %s a process; ", r.candidates.size(), priced,
           fits, human_bytes(r.memory_limit).c_str());
  h += o.dry_run ? std::string("on paper (--dry-run): no trial run") :
                   fmt("%d measured in trials of %d steps after %d of warm-up%s", r.trials_run, o.trial_steps,
                       o.warmup_steps, launcher.empty() ? "" : (" under `" + launcher + "`").c_str());
  h += r.out_of_budget ? "; the budget ran out first.\n" : ".\n";
  h += "#   priced with: " + r.calibration + "\n";
  h += "#   this job: " + c.label + "\n";
  if (c.trial == Candidate::Trial::kOk) {
    std::string rounds = std::to_string(std::max<size_t>(1, c.rounds.size())) + " round" + (c.rounds.size() > 1 ? "s" : "");
    if (c.rounds.size() > 1) rounds += fmt(", %.0f%% apart", 100 * spread_of(c.rounds));
    h += "#   measured " + ms(c.measured_s) + " ms a step (the mean of " + rounds + "; predicted " + ms(c.predicted_s) + "), peak RSS " +
         human_bytes(c.measured_rss) + " on its largest rank (model state " + human_bytes(c.measured_state) +
         "; predicted state and activations " + human_bytes(c.predicted_bytes) + ")\n";
    for (const Candidate& x : r.candidates)
      if (x.as_given && x.trial == Candidate::Trial::kOk && &x != &c)
        h += "#   the job as given measured " + ms(x.measured_s) + " ms a step: this one trains " +
             fmt("%.2f", x.measured_s / c.measured_s) + "x as fast\n";
  } else {
    h += "#   not measured (" + std::string(o.dry_run ? "--dry-run: on paper" : "no trial finished") +
         "): predicted " + ms(c.predicted_s) + " ms a step, " + human_bytes(c.predicted_bytes) + " on its largest rank\n";
  }
  if (r.trials_run >= 3)
    h += "#   predicted against measured step over the trials: rank correlation " + fmt("%.2f", r.correlation) + "\n";
  if (!r.phase_ratios.empty())
    h += "#   measured / predicted per phase (geometric mean over the trials): " + ratios_text(r.phase_ratios) + "\n";
  // Its own run: named <name>-tuned, so that running it starts a run folder of its own
  // (runs/<name>-tuned) and never continues the job's (Note [A finished run stays]).
  YAML::Node job = YAML::Load(c.yaml);
  const std::string name = c.spec.name + "-tuned";
  job["name"] = name;
  std::string folder = "runs/" + name + " (log.dir unset: it follows the name)";
  if (job["log"] && job["log"]["dir"] && !job["log"]["dir"].IsNull() && !job["log"]["dir"].as<std::string>().empty()) {
    folder = job["log"]["dir"].as<std::string>() + "-tuned";  // the user's own folder, beside it
    job["log"]["dir"] = folder;
  }
  h += "#   named " + name + ": its run folder is " + folder + ", beside the job's own\n";
  return h + resolved_yaml(job);
}

}  // namespace

std::string TuneResult::table() const {
  std::string out;
  // The measured, in the order they ran, then the best on paper not measured.
  std::vector<int> rows = order;
  if (!candidates.empty() && candidates.front().as_given && candidates.front().trial == Candidate::Trial::kNotRun &&
      candidates.front().priced)
    rows.push_back(0);
  const int on_paper = trials_run ? 5 : 12;
  std::vector<int> paper = trial_order(candidates, on_paper + static_cast<int>(rows.size()));
  int shown = 0;
  for (int i : paper)
    if (candidates[i].trial == Candidate::Trial::kNotRun && shown < on_paper) rows.push_back(i), ++shown;
  int width = 9;
  for (int i : rows) width = std::max(width, static_cast<int>(candidates[static_cast<size_t>(i)].label.size()));
  out += fmt("  %-4s %-*s %9s %9s %6s %-14s %9s %9s %9s  %s\n", "#", width, "candidate", "pred ms", "meas ms", "ratio",
             "rounds", "pred mem", "peak RSS", "state", "trial");
  for (int i : rows) {
    const Candidate& c = candidates[static_cast<size_t>(i)];
    const bool ok = c.trial == Candidate::Trial::kOk;
    // Each trial's spread: its rounds, and how far apart the extremes are.
    std::string spread = "-";
    if (ok && !c.rounds.empty())
      spread = std::to_string(c.rounds.size()) +
               (c.rounds.size() == 1 ? " round" : fmt(" rounds, %.0f%%", 100 * spread_of(c.rounds)));
    out += fmt("  %-4d %-*s %9s %9s %6s %-14s %9s %9s %9s  %s%s\n", i, width, c.label.c_str(), ms(c.predicted_s).c_str(),
               ok ? ms(c.measured_s).c_str() : "-", ok ? fmt("%.2f", c.measured_s / c.predicted_s).c_str() : "-",
               spread.c_str(),
               human_bytes(c.predicted_bytes).c_str(), c.measured_rss ? human_bytes(c.measured_rss).c_str() : "-",
               c.measured_state ? human_bytes(c.measured_state).c_str() : "-",
               c.trial == Candidate::Trial::kNotRun ? "on paper" : to_string(c.trial).c_str(),
               i == chosen ? "  <- chosen" : c.failure.empty() ? "" : ("  (" + c.failure + ")").c_str());
  }
  out += "  (meas ms: the mean of its rounds; rounds: how many, and how far the slowest was from the fastest (a third "
         "when two differ by more than 10%); pred mem: the largest process's model state and activations, the dry "
         "run's estimate; peak RSS: what the kernel counted on the largest rank; state: the model state the run "
         "counted there)\n";
  if (!phase_ratios.empty())
    out += "  (per phase, measured / predicted: compute, optimizer and loading on the rank with the most compute; comm "
           "AXIS the axis's ops' busy time, overlap with compute included, against their predicted time; bubble a "
           "pipeline's idle wait against its fill, drain and transfers)\n";
  if (trials_run >= 3)
    out += "  rank correlation of predicted and measured step: " + fmt("%.2f", correlation) + " over " +
           std::to_string(trials_run) + " trials\n";
  if (!phase_ratios.empty()) out += "  measured / predicted per phase: " + ratios_text(phase_ratios) + "\n";
  return out;
}

TuneResult tune(const TuneOptions& o_in, const TuneHooks& hooks) {
  TuneOptions o = o_in;
  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  auto left = [&] { return o.budget_s - elapsed(); };
  const collectives::LaunchInfo launch = collectives::detect_launch();
  if (launch.multi_process() && launch.world_size > 1)
    throw ConfigError("--tune runs as one process and launches its trials itself (" + launch.launcher + " started " +
                      std::to_string(launch.world_size) + "): run `train JOB --tune --np N` alone");
  if (!o.calibration.empty() && o.calibration != "gpu-cluster" && !std::filesystem::exists(o.calibration))
    throw ConfigError("--calibration " + o.calibration +
                      ": no such file (bench-collectives --calibrate FILE writes one; without --calibration the tuner "
                      "measures its own)");
  TuneResult r;
  int rejected = 0;
  say(o.progress, "[tune %s] enumerating the layouts and knobs of %d process%s...\n", clock_text(elapsed()).c_str(), o.np,
      o.np == 1 ? "" : "es");
  r.candidates = enumerate_candidates(o, &rejected);
  std::vector<Candidate>& cs = r.candidates;
  int structures = 0;
  for (const Candidate& c : cs) structures += !c.refinement;
  say(o.progress, "[tune %s] %zu candidates (%d layouts and schedules, %zu bucket, hierarchy and prefetch variants); %d "
                  "combinations the rules turn down\n",
      clock_text(elapsed()).c_str(), cs.size(), structures, cs.size() - structures, rejected);
  if (cs.empty()) throw ConfigError(o.job + ": no layout of " + std::to_string(o.np) + " processes is valid for this job");
  const JobSpec& base = cs.front().spec;
  r.memory_limit = memory_limit(o, base);
  const std::string launcher_text = [&] {
    std::string s;
    for (const auto& w : launcher_words(o)) s += (s.empty() ? "" : " ") + w;
    return s;
  }();
  const std::string work = !o.work_dir.empty()         ? o.work_dir
                           : !base.log.dir.empty()    ? base.log.dir + "/tune"
                                                      : (std::filesystem::temp_directory_path() / ("tetra-tune-" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(work);

  // The calibration: the given file, else measured on the ranks the trials run on.
  std::string calibration = o.calibration;
  if (!hooks.price && calibration.empty() && !o.dry_run && o.np > 1) {
    std::filesystem::path bench = std::filesystem::path(o.train_exe.empty() ? self_exe() : o.train_exe).parent_path() /
                                  "bench-collectives";
    if (std::filesystem::exists(bench)) {
      say(o.progress, "[tune %s] calibrating the links and compute of %d ranks: %s bench-collectives --calibrate\n",
          clock_text(elapsed()).c_str(), o.np, launcher_text.c_str());
      std::vector<std::string> argv = launcher_words(o);
      argv.push_back(bench.string());
      argv.push_back("--calibrate");
      argv.push_back(work + "/calibration.json");
      const Exit e = run_command(argv, work + "/calibration.log",
                                 Clock::now() + std::chrono::seconds(static_cast<int64_t>(std::min(120.0, left() * 0.2))));
      if (e.status == 0 && std::filesystem::exists(work + "/calibration.json")) calibration = work + "/calibration.json";
      else
        say(o.progress, "[tune %s] the calibration failed (%s); pricing with this machine's own figures\n",
            clock_text(elapsed()).c_str(), failure_line(read_text(work + "/calibration.log")).c_str());
    }
  }
  DryRunOptions how;
  how.np = o.np;
  how.ranks_per_host = o.ranks_per_host;
  how.calibration = calibration;
  how.time_layers = !calibration.empty() && !(o.dry_run && !o.calibration.empty());
  std::unique_ptr<JobPricer> pricer;
  std::function<void(Candidate&)> price = hooks.price;
  if (!price) {
    pricer = std::make_unique<JobPricer>(RunOptions{}, how);
    price = [&](Candidate& c) {
      const PlanReport rep = pricer->price(c.spec);
      c.prediction = rep.prediction;
      c.predicted_s = rep.prediction.total_s;
      int64_t most = 0;
      for (const RankEstimate& e : rep.estimates) most = std::max(most, e.state.total() + e.activations);
      c.predicted_bytes = most * rep.plan.replicas();
    };
  }
  auto price_one = [&](Candidate& c) {
    c.priced = true;
    try {
      price(c);
    } catch (const std::exception& e) {
      c.invalid = e.what();
      if (!c.invalid.empty() && c.invalid.back() == '\n') c.invalid.pop_back();
    }
    c.predicted_phases = predicted_phases(c.prediction);
  };
  // Pricing: the structures, then the refinements of the best few; at most 40% of the
  // budget on paper work when trials follow.
  const double pricing_budget = o.dry_run ? o.budget_s : o.budget_s * 0.4;
  say(o.progress, "[tune %s] pricing %d structures with the cost model%s\n", clock_text(elapsed()).c_str(), structures,
      calibration.empty() ? " (this machine's figures)" : (" (calibration " + calibration + ")").c_str());
  double said = elapsed();
  int done = 0;
  const Candidate* best_so_far = nullptr;
  for (Candidate& c : cs) {
    if (c.refinement) continue;
    if (elapsed() > pricing_budget) {
      r.out_of_budget = true;
      say(o.progress, "[tune %s] pricing stopped at %s of the budget: %d of %d structures priced\n",
          clock_text(elapsed()).c_str(), clock_text(pricing_budget).c_str(), done, structures);
      break;
    }
    price_one(c);
    ++done;
    if (c.invalid.empty() && c.predicted_s > 0 && (!best_so_far || c.predicted_s < best_so_far->predicted_s))
      best_so_far = &c;
    if (elapsed() - said > 15) {
      said = elapsed();
      say(o.progress, "[tune %s] priced %d of %d structures; best so far %s ms: %s\n", clock_text(said).c_str(), done,
          structures, best_so_far ? ms(best_so_far->predicted_s).c_str() : "-",
          best_so_far ? best_so_far->label.c_str() : "none valid yet");
    }
  }
  prune_by_memory(cs, r.memory_limit);
  std::vector<std::string> best;
  for (int i : trial_order(cs, static_cast<int>(cs.size())))
    if (std::find(best.begin(), best.end(), cs[static_cast<size_t>(i)].structure) == best.end() && best.size() < 6)
      best.push_back(cs[static_cast<size_t>(i)].structure);
  int refined = 0;
  for (Candidate& c : cs) {
    if (!c.refinement || std::find(best.begin(), best.end(), c.structure) == best.end()) continue;
    if (elapsed() > pricing_budget) {
      r.out_of_budget = true;
      break;
    }
    price_one(c);
    ++refined;
  }
  prune_by_memory(cs, r.memory_limit);
  int valid = 0, kept = 0;
  for (const Candidate& c : cs) {
    valid += c.priced && c.invalid.empty();
    kept += c.priced && c.invalid.empty() && c.pruned.empty();
  }
  {
    int turned = 0;
    const Candidate* first = nullptr;
    for (const Candidate& c : cs)
      if (c.priced && !c.invalid.empty()) {
        ++turned;
        if (!first) first = &c;
      }
    if (first)
      say(o.progress, "[tune %s] %d turned down by the pricing, the first: %s: %s\n", clock_text(elapsed()).c_str(), turned,
          first->label.c_str(), first->invalid.c_str());
  }
  r.calibration = pricer && pricer->calibration() ? pricer->calibration()->source : calibration.empty() ? "the test's" : calibration;
  say(o.progress, "[tune %s] priced %d (%d refinements of the best %zu); %d valid, %d within %s a process\n",
      clock_text(elapsed()).c_str(), valid + [&] {
        int n = 0;
        for (const Candidate& c : cs) n += c.priced && !c.invalid.empty();
        return n;
      }(), refined, best.size(), valid, kept, human_bytes(r.memory_limit).c_str());

  // Trials: the job as given, then the best predicted, each chosen after the trials
  // before it have corrected the predictions phase by phase (Note [Tuner]).
  std::vector<int> order;  // as they ran
  std::function<void(Candidate&, double)> trial = hooks.trial;
  int trial_no = 0;
  if (!trial)
    trial = [&](Candidate& c, double seconds) { run_trial(c, o, work + "/trial-" + std::to_string(trial_no), seconds); };
  const bool as_given =
      !o.dry_run && cs.front().as_given && cs.front().priced && cs.front().invalid.empty() && cs.front().pruned.empty();
  const size_t planned = o.dry_run ? 0 : (as_given ? 1 : 0) + trial_order(cs, o.trials).size();
  for (size_t k = 0; k < planned; ++k) {
    const std::map<std::string, double> ratios = phase_ratios(cs);
    int next = -1;
    if (k == 0 && as_given) {
      next = 0;
    } else {
      const std::vector<int> best_now = trial_order(cs, 1, ratios);
      if (best_now.empty()) break;
      next = best_now.front();
    }
    Candidate& c = cs[static_cast<size_t>(next)];
    if (left() < 5) {
      r.out_of_budget = true;
      say(o.progress, "[tune %s] the budget (%s) is spent: %zu trial%s not run\n", clock_text(elapsed()).c_str(),
          clock_text(o.budget_s).c_str(), planned - k, planned - k == 1 ? "" : "s");
      break;
    }
    trial_no = static_cast<int>(k);
    const double corrected = corrected_step(c, ratios);
    say(o.progress, "[tune %s] trial %zu/%zu: %s (predicted %s ms%s; %s left)\n", clock_text(elapsed()).c_str(), k + 1,
        planned, c.label.c_str(), ms(c.predicted_s).c_str(),
        std::abs(corrected - c.predicted_s) > 1e-3 * c.predicted_s
            ? (", " + ms(corrected) + " as the trials so far correct it").c_str()
            : "",
        clock_text(left()).c_str());
    order.push_back(next);
    trial(c, left());
    ++r.trials_run;
    if (c.trial == Candidate::Trial::kOk) c.rounds = {c.measured_s};
    if (c.trial == Candidate::Trial::kOk)
      say(o.progress, "[tune %s]   measured %s ms a step, peak RSS %s\n", clock_text(elapsed()).c_str(),
          ms(c.measured_s).c_str(), human_bytes(c.measured_rss).c_str());
    else
      say(o.progress, "[tune %s]   %s: %s\n", clock_text(elapsed()).c_str(), to_string(c.trial).c_str(), c.failure.c_str());
    if (c.trial == Candidate::Trial::kTimedOut) {
      r.out_of_budget = true;
      break;
    }
  }
  // Confirmation: the fastest few again, the other way round.
  std::vector<int> measured;
  for (int i : order)
    if (cs[static_cast<size_t>(i)].trial == Candidate::Trial::kOk) measured.push_back(i);
  std::stable_sort(measured.begin(), measured.end(), [&](int a, int b) {
    return cs[static_cast<size_t>(a)].measured_s < cs[static_cast<size_t>(b)].measured_s;
  });
  if (static_cast<int>(measured.size()) > o.confirm) measured.resize(static_cast<size_t>(std::max(0, o.confirm)));
  // Every finalist twice at least (one round on a shared machine is one draw of its noise:
  // ZeRO-1 was once chosen on 28.0 ms that measured 14.0 ms next), and the job as given too,
  // so that "this one trains Nx as fast" compares two means; a finalist whose two rounds
  // differ by more than kRoundsAgree gets a third.
  if (o.confirm > 0 && as_given && cs.front().trial == Candidate::Trial::kOk &&
      std::find(measured.begin(), measured.end(), 0) == measured.end())
    measured.push_back(0);
  if (!measured.empty()) {
    std::reverse(measured.begin(), measured.end());
    for (size_t k = 0; k < measured.size() && !r.out_of_budget; ++k) {
      Candidate& c = cs[static_cast<size_t>(measured[k])];
      if (c.rounds.size() >= 2) {
        if (c.rounds.size() >= 3 || rounds_agree(c.rounds)) continue;  // two that agree, or three
        say(o.progress, "[tune %s]   its rounds differ by %.0f%%: a third\n", clock_text(elapsed()).c_str(),
            100 * spread_of(c.rounds));
      }
      if (left() < 5) {
        r.out_of_budget = true;
        break;
      }
      say(o.progress, "[tune %s] again %zu/%zu: %s (%s left)\n", clock_text(elapsed()).c_str(), k + 1, measured.size(),
          c.label.c_str(), clock_text(left()).c_str());
      Candidate again = c;
      trial_no = static_cast<int>(order.size() + k);
      trial(again, left());
      if (again.trial != Candidate::Trial::kOk) {
        say(o.progress, "[tune %s]   %s: %s\n", clock_text(elapsed()).c_str(), to_string(again.trial).c_str(),
            again.failure.c_str());
        continue;  // the first round stands
      }
      again.rounds = c.rounds;
      again.rounds.push_back(again.measured_s);
      double sum = 0;
      for (double x : again.rounds) sum += x;
      again.measured_s = sum / double(again.rounds.size());
      say(o.progress, "[tune %s]   measured %s ms a step; %s over %zu rounds\n", clock_text(elapsed()).c_str(),
          ms(again.rounds.back()).c_str(), ms(again.measured_s).c_str(), again.rounds.size());
      c = std::move(again);
      // Two rounds that disagree: this finalist once more (the loop comes back to it).
      if (c.rounds.size() == 2 && !rounds_agree(c.rounds)) measured.insert(measured.begin() + static_cast<long>(k) + 1, measured[k]);
    }
  }
  r.order = order;
  // The answer: the fastest measured, else (on paper, or no trial finished) the best predicted.
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
  r.seconds = elapsed();
  if (r.chosen < 0)
    throw ConfigError(o.job + ": no candidate fits " + human_bytes(r.memory_limit) +
                      " a process (--memory-gb) or passes the model's rules; the first turned down: " +
                      [&] {
                        for (const Candidate& c : cs)
                          if (!c.invalid.empty()) return c.invalid;
                          else if (!c.pruned.empty()) return c.label + ": " + c.pruned;
                        return std::string("none");
                      }());
  std::string out = o.output;
  if (out.empty()) {
    std::filesystem::path p(o.job);
    out = (p.parent_path() / (p.stem().string() + "-tuned.yaml")).string();
  }
  {
    std::ofstream f(out);
    f << written_job(r, o, launcher_text);
    f.close();
    if (!f) throw ConfigError("-o " + out + ": cannot write the chosen job there (" + std::strerror(errno) + ")");
  }
  r.written = out;
  return r;
}

}  // namespace tetra
