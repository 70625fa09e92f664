#include "core/plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "core/config.h"
#include "core/strategy_config.h"

namespace tetra::core {

namespace {

std::string plural(int64_t n, const std::string& word, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? word : many);
}

int composition_index(const std::string& axis) {
  auto it = std::find(kCompositionOrder.begin(), kCompositionOrder.end(), axis);
  return static_cast<int>(it - kCompositionOrder.begin());
}

// The plugin sections that build strategies, each with its role, in composition order.
std::vector<PlanStep> roles_of(const JobSpec& spec) {
  std::vector<PlanStep> steps;
  for (const auto& [section, cfg] : spec.plugins)
    if (auto sc = std::dynamic_pointer_cast<const StrategyConfig>(cfg))
      steps.push_back(PlanStep{section, sc->role(spec), sc, true, ""});
  std::stable_sort(steps.begin(), steps.end(), [](const PlanStep& a, const PlanStep& b) {
    return composition_index(a.role.axis) < composition_index(b.role.axis);
  });
  return steps;
}

struct Widths {
  int replicas = 1;
  std::string replicas_key;
  int64_t micro = 1;
  std::string micro_key = "train.accumulation_steps";
};

Widths widths_of(const JobSpec& spec, const std::vector<PlanStep>& steps) {
  Widths w;
  w.micro = spec.train.accumulation_steps;
  for (const PlanStep& s : steps) {
    w.replicas *= std::max(1, s.role.replicas);
    if (s.role.replicas > 1) w.replicas_key = s.role.replicas_key;
    if (s.role.micro_batches > 0) {
      w.micro = s.role.micro_batches;
      w.micro_key = s.role.micro_batches_key;
    }
  }
  return w;
}

// "(mesh.data 1 x replicate.replicas 2)": the data group's width as its settings.
std::string data_width_text(const JobSpec& spec, const Widths& w) {
  return "(mesh.data " + std::to_string(spec.mesh.size("data")) +
         (w.replicas > 1 ? " x " + w.replicas_key + " " + std::to_string(w.replicas) : std::string()) + ")";
}

// "2 data-parallel ranks (mesh.data 1 x replicate.replicas 2)"; the parenthesis only
// when replicas widen the group.
std::string data_ranks_text(const JobSpec& spec, const Widths& w) {
  const int d = spec.mesh.size("data");
  std::string s = plural(static_cast<int64_t>(d) * w.replicas, "data-parallel rank", "data-parallel ranks");
  if (w.replicas > 1) s += " " + data_width_text(spec, w);
  return s;
}

int axis_width(const JobSpec& spec, const std::string& axis, int replicas) {
  if (axis == "replica") return replicas;
  if (axis == "data") return spec.mesh.size("data") * replicas;
  return spec.mesh.size(axis);
}

std::string fixed2(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

}  // namespace

std::vector<PlanIssue> Plan::issues(const JobSpec& spec) {
  std::vector<PlanIssue> out;
  const std::vector<PlanStep> steps = roles_of(spec);
  const Widths w = widths_of(spec, steps);
  const int64_t ranks = static_cast<int64_t>(spec.mesh.size("data")) * w.replicas;

  // The global batch splits evenly over data ranks x micro-batches: each rank's share is
  // a contiguous slice, and every rank runs the same number of equal micro-batches.
  const int64_t split = ranks * w.micro;
  if (spec.data.batch_size % split != 0) {
    const std::string key = w.micro_key != "train.accumulation_steps" ? w.micro_key
                            : w.micro > 1                             ? w.micro_key
                                                                      : std::string("data.batch_size");
    out.push_back({key, "data.batch_size " + std::to_string(spec.data.batch_size) + " does not split into " +
                            data_ranks_text(spec, w) + " x " +
                            plural(w.micro, "micro-batch", "micro-batches") +
                            (w.micro > 1 ? " (" + w.micro_key + ")" : "") + ": " +
                            std::to_string(spec.data.batch_size) + " / " + std::to_string(split) + " = " +
                            fixed2(static_cast<double>(spec.data.batch_size) / static_cast<double>(split)) +
                            " samples each; make the global batch a multiple of " + std::to_string(split)});
  }
  // A strategy that works over a group needs one wider than a rank.
  for (const PlanStep& s : steps) {
    if (!s.role.needs_group) continue;
    const int width = axis_width(spec, s.role.axis, w.replicas);
    if (width > 1) continue;
    std::string msg = s.section + " " + s.role.why + ", so it needs more than one rank on the " + s.role.axis +
                      " axis, but there is 1";
    if (s.role.axis == "data") msg += " " + data_width_text(spec, w);
    msg += "; widen the group or remove the " + s.section + " section";
    out.push_back({s.role.needs_group_key.empty() ? s.section : s.role.needs_group_key, msg});
  }
  // What each strategy cannot do with the rest of the job.
  for (const PlanStep& s : steps)
    for (PlanIssue& issue : s.config->issues(spec)) out.push_back(std::move(issue));
  // Two strategies that both keep the model state, or both run the forward, on one axis.
  for (const std::string& axis : kCompositionOrder) {
    std::vector<const PlanStep*> owners, syncers;
    for (const PlanStep& s : steps) {
      if (s.role.axis != axis) continue;
      if (s.role.owns_model_state) owners.push_back(&s);
      else if (s.role.syncs_gradients) syncers.push_back(&s);
    }
    if (owners.size() > 1)
      out.push_back({owners[1]->section, owners[0]->section + " and " + owners[1]->section +
                                             " both keep the model state of the " + axis +
                                             " axis; a job can have one of them"});
    else if (owners.empty() && syncers.size() > 1)
      out.push_back({syncers[1]->section, syncers[0]->section + " and " + syncers[1]->section +
                                              " both synchronise the gradients of the " + axis +
                                              " axis; a job can have one of them"});
  }
  return out;
}

Plan::Plan(JobSpec spec) : spec_(std::move(spec)) {
  const std::vector<PlanIssue> problems = issues(spec_);
  if (!problems.empty()) {
    std::string msg;
    for (const PlanIssue& p : problems)
      msg += (spec_.source.empty() ? std::string() : spec_.source + ": ") + "error: " + p.key + ": " + p.message + "\n";
    throw ConfigError(msg);
  }
  steps_ = roles_of(spec_);
  const Widths w = widths_of(spec_, steps_);
  replicas_ = w.replicas;
  micro_batches_ = w.micro;
  micro_batches_key_ = w.micro_key;
  // One synchroniser per axis: the strategy that owns the model state there (it
  // reduce-scatters into its shards) takes the axis over a plain allreduce; and a
  // synchroniser over a group of one has nothing to do.
  for (PlanStep& s : steps_) {
    if (s.role.syncs_gradients && !s.role.owns_model_state) {
      for (const PlanStep& o : steps_)
        if (&o != &s && o.role.axis == s.role.axis && o.role.owns_model_state) {
          s.active = false;
          s.note = o.section + " synchronises the " + s.role.axis + " axis's gradients instead";
        }
      if (s.active && axis_width(spec_, s.role.axis, replicas_) == 1) {
        s.active = false;
        s.note = "one rank on the " + s.role.axis + " axis: nothing to synchronise";
      }
    }
  }
}

std::vector<std::shared_ptr<const StrategyConfig>> Plan::strategies() const {
  std::vector<std::shared_ptr<const StrategyConfig>> out;
  for (const PlanStep& s : steps_)
    if (s.active) out.push_back(s.config);
  return out;
}

std::string Plan::batch_equation() const {
  std::ostringstream os;
  os << spec_.data.batch_size << " global = " << data_ranks_text(spec_, widths_of(spec_, steps_)) << " x "
     << plural(micro_batches_, "micro-batch", "micro-batches");
  if (micro_batches_ > 1) os << " (" << micro_batches_key_ << ")";
  os << " x " << micro_batch_size();
  return os.str();
}

std::string Plan::describe_composition() const {
  std::ostringstream os;
  if (steps_.empty()) return "composition none: one process trains the whole model\n";
  os << "composition (outermost first)\n";
  int n = 0;
  for (const PlanStep& s : steps_) {
    char head[96];
    std::snprintf(head, sizeof head, "  %d. %-14s %-9s x%-3d ", ++n, s.section.c_str(), s.role.axis.c_str(),
                  axis_width(spec_, s.role.axis, replicas_));
    os << head << (s.active ? s.role.why : "off: " + s.note) << "\n";
  }
  return os.str();
}

void Plan::check_world(int world_size, const std::string& origin) const {
  check_mesh_fits(spec_.mesh, world_size, origin);
}

}  // namespace tetra::core
