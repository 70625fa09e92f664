#include "pipeline/options.h"

#include <string>
#include <vector>

#include "core/fields.h"
#include "pipeline/schedule.h"

namespace tetra::pipeline {

const std::vector<std::string>& balance_names() {
  static const std::vector<std::string> names = {"uniform", "by_params", "by_time", "explicit"};
  return names;
}
const std::vector<std::string>& recompute_names() {
  static const std::vector<std::string> names = {"never", "except_last", "always"};
  return names;
}
const std::string& to_string(ScheduleKind kind) { return schedule_kinds().at(static_cast<size_t>(kind)); }
const std::string& to_string(Balance balance) { return balance_names().at(static_cast<size_t>(balance)); }
const std::string& to_string(Recompute recompute) { return recompute_names().at(static_cast<size_t>(recompute)); }

namespace {

// The `pipeline` section's keys, declared once (Note [Fields declared once]). The reader
// starts from o.stages = mesh.pipeline; micro_batches 0 reads as 4 x stages.
template <class V>
void pipeline_fields(V& v, Options& o) {
  v.word("schedule", o.schedule, schedule_kinds());
  if constexpr (V::kReads)
    if (o.micro_batches == 0) o.micro_batches = 4 * o.stages;
  v.integer("micro_batches", o.micro_batches, 1, 1 << 20);
  if constexpr (V::kReads)
    if (o.schedule == ScheduleKind::kZBV) o.virtual_stages = 2;  // ZBV's V: two chunks per rank
  v.integer("virtual_stages", o.virtual_stages, 1, 1024);
  // balance: a word, or a list of layer counts.
  bool counts = o.balance == Balance::kExplicit;
  if constexpr (V::kReads) counts = v.section().is_list("balance");
  if (counts) {
    v.integers("balance", o.balance_counts, 1);
    if constexpr (V::kReads) {
      o.balance = Balance::kExplicit;
      const size_t K = static_cast<size_t>(o.stages) * static_cast<size_t>(o.virtual_stages);
      if (o.balance_counts.size() != K)
        v.section().error("balance", "lists " + std::to_string(o.balance_counts.size()) + " layer counts, but there are " +
                                         std::to_string(K) + " stages (pipeline " + std::to_string(o.stages) +
                                         " x virtual_stages " + std::to_string(o.virtual_stages) + ")");
    }
  } else {
    // A word: the three that are not a list.
    const std::vector<std::string> words(balance_names().begin(), balance_names().end() - 1);
    v.word("balance", o.balance, words);
  }
  v.word("checkpoint", o.checkpoint, recompute_names());
  v.number("memory_gb", o.memory_gb, 0);
  v.integer("prefetch", o.prefetch, 0, 64);
}
const auto kFields = [](auto& v, Options& o) { pipeline_fields(v, o); };

}  // namespace

YAML::Node Options::to_yaml() const { return core::fields::write(*this, Options{}, kFields); }

std::vector<core::PlanIssue> Options::issues(const core::JobSpec& job) const {
  std::vector<core::PlanIssue> out;
  const bool split = schedule == ScheduleKind::kZBH1 || schedule == ScheduleKind::kZBV;
  // ZeRO-3 gathers a layer's parameters around its backward and frees them after; a
  // zero-bubble W runs later, when they are gone. (The pipeline links core only: it reads
  // the zero section's stage from its YAML.)
  if (const auto zero = job.plugin<core::StrategyConfig>("zero"); split && zero) {
    const YAML::Node stage = zero->to_yaml()["stage"];
    if (stage && stage.as<int>() == 3)
      out.push_back({"pipeline.schedule",
                     "pipeline.schedule " + to_string(schedule) +
                         " splits each backward into B and W, and zero.stage 3 gathers a layer's parameters only around "
                         "its whole backward; use zero.stage 1 or 2 with a zero-bubble schedule, or schedule 1f1b"});
  }
  return out;
}

core::StrategyRole Options::role(const core::JobSpec& job) const {
  core::StrategyRole r;
  r.axis = "pipeline";
  r.why = "splits the model into " + std::to_string(stages * virtual_stages) + " stages (" + to_string(schedule) + ", " +
          std::to_string(micro_batches) + " micro-batches, balance " + to_string(balance) + ")";
  // Accumulation runs the schedule train.accumulation_steps times: the batch splits into both.
  r.micro_batches = micro_batches * job.train.accumulation_steps;
  r.micro_batches_key = job.train.accumulation_steps > 1 ? "pipeline.micro_batches x train.accumulation_steps"
                                                         : "pipeline.micro_batches";
  return r;
}

void register_pipeline(core::SectionRegistry& registry) {
  core::register_section<Options>(
      registry, "pipeline", kFields, "pipeline",
      [](core::Section& s, const core::JobSpec&, const Options& o, bool given) {
        const int P = o.stages;
        if (!given && P == 1) return false;  // off: no pipeline
        const std::string problem = schedule_problem(to_string(o.schedule), P, o.micro_batches, o.virtual_stages);
        if (!problem.empty())
          s.error(problem.find("virtual") != std::string::npos ? "virtual_stages" : "micro_batches", problem);
        return true;
      },
      [](Options& o, const core::JobSpec& job) { o.stages = job.mesh.size("pipeline"); });
}

}  // namespace tetra::pipeline
