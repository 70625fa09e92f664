// The tuner's first step (Note [Tuner]): every candidate the job's processes allow,
// each a job `train --check` accepts.
#include "tools/planner/tune.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "collectives/error.h"
#include "core/job_file.h"
#include "core/plan.h"
#include "core/preflight.h"
#include "core/strategy_config.h"
#include "core/text.h"
#include "core/model_plan.h"
#include "hardware/host.h"
#include "tools/planner/plugins.h"
#include "tools/planner/pricing.h"

namespace tetra::planner {

using namespace tetra::core;

namespace {

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

const SectionRegistry& plugins() { return builtin_plugins(); }

// The model's shapes, once per tensor degree (a tensor split builds other layers), for
// the rules that need them (ModelPlan::check, which `train --check` asks).
class ModelRules {
 public:
  void check(const JobSpec& spec, const Plan& plan) {
    std::unique_ptr<ModelPlan>& t = built_[spec.mesh.size("tensor")];
    if (!t) t = std::make_unique<ModelPlan>(spec);
    const PlanInput in = t->input(plan);
    if (const std::string problems = model_problems(in); !problems.empty()) throw ConfigError(problems);
  }

 private:
  std::map<int, std::unique_ptr<ModelPlan>> built_;
};

// The processes a host of the tuned launch holds (--ranks-per-host; all np on one without).
int tuned_ranks_per_host(const TuneOptions& o) {
  return o.ranks_per_host > 0 ? std::min(o.ranks_per_host, o.np) : o.np;
}

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
  // "on" where a data group does not fit its hosts stops the run at attach.
  const auto h = c.keys.find("data_parallel.hierarchical");
  if (h != c.keys.end() && h->second == "on") {
    const DataGroupFit fit =
        data_group_fit(plan, collectives::consecutive_hosts(plan.process_count(), tuned_ranks_per_host(o)));
    if (!fit.first_unfit.empty())
      throw ConfigError("data_parallel.hierarchical: on needs the same number (> 1) of data ranks on each of more "
                        "than one host; a data group runs " + fit.first_unfit);
  }
  c.yaml = resolved_yaml(parsed.resolved);
  c.spec = std::move(parsed.spec);
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

// The keys of one structure: the layout (data x pipeline x tensor, replicas), the
// pipeline's micro-batches and schedule, the threads; the sections it does not use removed.
std::map<std::string, std::string> layout_keys(int d, int p, int t, int R, int th, int m, const std::string& schedule,
                                               bool has_tensor) {
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
  return k;
}

// The structure `k` under ZeRO `stage` (0: none) and its refinements: the gradient
// buckets, the hierarchical allreduce where the data group spans hosts, ZeRO-3's
// prefetch. The first is the structure itself (it carries the defaults of what the
// refinements vary).
std::vector<std::map<std::string, std::string>> refinements_of(std::map<std::string, std::string> k, int stage,
                                                               bool data_group, bool spans_hosts) {
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
      for (const char* h : spans_hosts ? std::vector<const char*>{"auto", "off", "on"} : std::vector<const char*>{"auto"})
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
  return variants;
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
  const int per_host = tuned_ranks_per_host(o);
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
              const std::map<std::string, std::string> k = layout_keys(d, p, t, R, th, m, schedule, has_tensor);
              const std::vector<std::map<std::string, std::string>> variants = refinements_of(k, stage, data_group, spans_hosts);
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

}  // namespace tetra::planner
