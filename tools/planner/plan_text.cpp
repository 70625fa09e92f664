#include "tools/planner/pricing.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <string>

#include "core/telemetry.h"
#include "hardware/host.h"

namespace tetra::planner {

using namespace tetra::core;

namespace {

// printf into a string.
void appendf(std::string& out, const char* format, ...) {
  char line[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  out += line;
}

}  // namespace

int PlanReport::hosts() const { return ranks.empty() ? 1 : ranks.back().host + 1; }

std::string PlanReport::hierarchy_warning() const {
  if (hosts() < 2 || estimates.empty() || !estimates.front().hierarchical_data_required) return "";
  const DataGroupFit fit = data_group_fit(plan, host_map);
  if (fit.first_unfit.empty()) return "";
  return "warning: data_parallel.hierarchical on needs the same number (> 1) of data ranks on each of more than one "
         "host, and a data group runs " + fit.first_unfit + ": the run stops at attach; set it to auto";
}

nlohmann::json PlanReport::json() const {
  nlohmann::json j;
  j["job"] = plan.spec().name;
  j["processes"] = plan.process_count();
  j["replicas_per_process"] = plan.replicas();
  j["mesh"] = nlohmann::json::object();
  for (const std::string& axis : kAxisOrder) j["mesh"][axis] = plan.processes().size(axis);
  j["mesh"]["replica"] = plan.replicas();
  j["batch"] = {{"global", plan.spec().data.batch_size}, {"data_ranks", plan.data_ranks()},
                {"micro_batches", plan.micro_batches()}, {"micro_batch_size", plan.micro_batch_size()}};
  j["steps"] = steps;
  j["parameters"] = parameters;
  j["composition"] = nlohmann::json::array();
  for (const PlanStep& s : plan.composition())
    j["composition"].push_back({{"section", s.section}, {"axis", s.role.axis}, {"active", s.active},
                                {"what", s.active ? s.role.why : s.note}});
  j["estimate"] = estimate_json(estimates);  // per rank: memory, and bytes per axis per step
  j["hosts"] = {{"count", hosts()}, {"processes_per_host", per_host},
                {"placement", MeshLayout(plan.processes()).host_placement(host_map)}};
  if (const std::string w = hierarchy_warning(); !w.empty()) j["hosts"]["warning"] = w;
  j["cost"] = prediction_json(prediction, calibration);
  if (!rounds_samples_per_s.empty()) j["cost"]["rounds_samples_per_s"] = rounds_samples_per_s;
  if (!rounds_samples_per_s.empty())
    j["machine"] = {{"load", machine.load}, {"cores", machine.cores}, {"others_running", machine.others_running},
                    {"busy", machine.busy}};
  j["ranks"] = nlohmann::json::array();
  const auto& axes = plan.processes().axes;
  for (const RankPlace& r : ranks) {
    nlohmann::json row = {{"rank", r.rank},         {"process", r.process}, {"host", r.host},
                          {"replica", r.replica},   {"threads", r.threads}};
    for (size_t i = 0; i < axes.size(); ++i) row[axes[i].name] = r.coords[i];
    if (!r.cpus.empty()) row["cpus"] = r.cpus;
    if (r.cpus.empty()) row["not_pinned"] = r.why;
    j["ranks"].push_back(row);
  }
  return j;
}

std::string PlanReport::text() const {
  const JobSpec& spec = plan.spec();
  std::string out;
  appendf(out, "job        %s (%s)\n", spec.name.c_str(), spec.source.empty() ? "built in C++" : spec.source.c_str());
  const int world = plan.process_count(), R = plan.replicas();
  const std::string per_rank = std::to_string(threads) + " intra-op thread" + (threads == 1 ? "" : "s");
  if (world == 1 && R == 1)
    appendf(out, "world      1 process, %s\n", per_rank.c_str());
  else if (world == 1)
    appendf(out, "world      1 process x %d replica threads, %s each\n", R, per_rank.c_str());
  else
    appendf(out, "world      mesh %s = %d processes (launch with mpirun -np %d)%s, %s each\n", spec.mesh.str().c_str(),
            world, world, R > 1 ? (" x " + std::to_string(R) + " replica threads").c_str() : "", per_rank.c_str());
  appendf(out, "data       %s\n", data.c_str());
  appendf(out, "batch      %s\n", plan.batch_equation().c_str());
  appendf(out, "steps      %lld (%s)\n", static_cast<long long>(steps),
          spec.train.max_steps ? "train.max_steps" : "train.epochs x steps per epoch");
  appendf(out, "model      %s, %lld parameters\n", model.c_str(), static_cast<long long>(parameters));
  out += model_text;
  out += plan.describe_composition();
  out += strategies_text;
  out += estimate_table(plan, estimates);  // per rank: memory, and bytes per axis per step
  const int hosts = this->hosts();
  if (hosts > 1) {
    out += "hosts      " + std::to_string(hosts) + " x " + std::to_string(per_host) +
          " processes (consecutive ranks share a host, as mpirun --map-by slot and srun place them)\n";
    for (const std::string& line : MeshLayout(plan.processes()).host_placement(host_map))
      out += "  " + line + "\n";
    if (const std::string w = hierarchy_warning(); !w.empty()) out += "  " + w + "\n";
  }
  out += "ranks      " + std::to_string(ranks.size()) + " (" + std::to_string(plan.process_count()) + " process" +
         (plan.process_count() == 1 ? "" : "es") +
         (plan.replicas() > 1 ? " x " + std::to_string(plan.replicas()) + " replicas" : std::string()) + ")" +
         (hosts == 1 ? " on " + hardware::hostname() : std::string()) + "\n";
  const bool tensor = spec.mesh.size("tensor") > 1;  // its column only where the plan has the axis
  appendf(out, "  %-5s %-8s %-5s %-9s %-5s %s%-8s %-8s %s\n", "rank", "process", "host", "pipeline", "data",
          tensor ? "tensor " : "", "replica", "threads", "cpus");
  const auto& axes = plan.processes().axes;
  for (const RankPlace& r : ranks) {
    auto coord = [&](const std::string& axis) {
      for (size_t i = 0; i < axes.size(); ++i)
        if (axes[i].name == axis) return r.coords[i];
      return 0;
    };
    char t[16] = "";
    if (tensor) std::snprintf(t, sizeof t, "%-6d ", coord("tensor"));
    appendf(out, "  %-5d %-8d %-5d %-9d %-5d %s%-8d %-8d %s\n", r.rank, r.process, r.host, coord("pipeline"), coord("data"),
            t, r.replica, r.threads, r.cpus.empty() ? ("not pinned: " + r.why).c_str() : r.cpus.c_str());
  }
  out += prediction_text(prediction, calibration);
  if (!rounds_samples_per_s.empty()) {
    const auto [lo, hi] = std::minmax_element(rounds_samples_per_s.begin(), rounds_samples_per_s.end());
    appendf(out, "  spread       this machine's compute timed %zu times: %.0f to %.0f samples/s (%.0f%%); the median above\n",
            rounds_samples_per_s.size(), *lo, *hi, *lo > 0 ? 100 * (*hi - *lo) / *lo : 0.0);
  }
  // The machine's load says what the timings here are worth: said where compute was timed
  // here (a priced calibration times nothing, and its text stays the same run to run).
  if (!rounds_samples_per_s.empty())
    appendf(out, "  machine      %s: load %.2f on %d core%s, %d other process%s running%s\n", machine.busy ? "busy" : "quiet",
            machine.load, machine.cores, machine.cores == 1 ? "" : "s", machine.others_running,
            machine.others_running == 1 ? "" : "es",
            machine.busy ? "; figures timed here are pessimistic for a quiet machine (run the dry run again when it is)" : "");
  return out;
}

}  // namespace tetra::planner
