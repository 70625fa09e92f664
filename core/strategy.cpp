#include "core/strategy.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>

#include "collectives/error.h"
#include "core/models.h"
#include "hardware/topology.h"

namespace tetra::core {

using hardware::ByteDigits;
using hardware::format_bytes;

namespace {

int64_t mix(int64_t h, int64_t v) {
  uint64_t x = static_cast<uint64_t>(h) ^ (static_cast<uint64_t>(v) + 0x9E3779B97F4A7C15ULL + (static_cast<uint64_t>(h) << 6));
  return static_cast<int64_t>(x >> 1);
}
int64_t mix(int64_t h, const std::string& s) { return mix(h, static_cast<int64_t>(std::hash<std::string>{}(s) >> 1)); }

}  // namespace

void check_same_job(collectives::Communicator& group, const TrainState& state, const std::string& who) {
  int64_t shapes = 17, job = 31;
  for (const auto& p : state.params) {
    shapes = mix(shapes, p.name);
    for (int64_t d : p.tensor.sizes()) shapes = mix(shapes, d);
  }
  const auto& s = state.spec;
  job = mix(job, s.model.type);
  job = mix(job, s.data.batch_size);
  job = mix(job, s.train.seed);
  job = mix(job, s.train.accumulation_steps);
  job = mix(job, s.optimizer.type);
  job = mix(job, static_cast<int64_t>(s.optimizer.lr * 1e12));
  at::Tensor mine = at::tensor({shapes, job}, at::kLong), all = at::empty({2 * group.size()}, at::kLong);
  group.allgather(mine, all)->wait();
  auto a = all.accessor<int64_t, 1>();
  for (int r = 1; r < group.size(); ++r) {
    if (a[2 * r] != a[0])
      throw ConfigError(who + ": data rank " + std::to_string(r) + " built a model of other shapes than data rank 0 "
                        "(every rank must run the same job file)");
    if (a[2 * r + 1] != a[1])
      throw ConfigError(who + ": data rank " + std::to_string(r) + " runs other settings (model, batch, seed, "
                        "accumulation or optimizer) than data rank 0 (every rank must run the same job and --set)");
  }
}

void broadcast_from_first(collectives::Communicator& group, TrainState& state) {
  if (state.weights && !state.weights->given()) return;  // the same draws on every rank
  at::NoGradGuard no_grad;
  std::vector<collectives::WorkPtr> works;
  for (auto& p : state.params) works.push_back(group.broadcast(p.tensor.detach()));
  for (auto b : state.model->buffers()) works.push_back(group.broadcast(b));
  for (auto& w : works) w->wait();
}

// ---- the per-rank estimate (Note [Per-rank estimate]) ----------------------------------

namespace {

// What autograd keeps of one micro-batch at the peak of its backward: every layer's kept
// bytes, and the largest recomputation under train.recompute (Note [Kept bytes]), per
// sample of the micro-batch, as training runs it (bf16 autocast included). A probe without
// them (a program's own) counts the layers' outputs.
int64_t kept_activations(const PlanInput& in) {
  const int64_t micro = std::max<int64_t>(1, in.plan.micro_batch_size());
  int64_t kept = 0, recompute = 0;
  if (in.probe.kept.size() == in.probe.layers.size()) {
    for (size_t i = 0; i < in.probe.kept.size(); ++i) {
      kept += in.probe.kept[i];
      recompute = std::max(recompute, in.probe.recompute[i]);
    }
  } else {
    for (const LayerShapes& s : in.probe.layers) kept += static_cast<int64_t>(double(s.output.nbytes()) * in.probe.scale);
  }
  return (kept + recompute) * micro;
}

}  // namespace

std::vector<NamedParam> RankEstimate::params() const {
  std::vector<NamedParam> out;
  for (int l : layers) {
    const auto& mine = layer_params.at(static_cast<size_t>(l));
    out.insert(out.end(), mine.begin(), mine.end());
  }
  return out;
}

void RankEstimate::replicated_state(const JobSpec& spec) {
  const int64_t slots = optimizer_slots(spec.optimizer);
  state.parameters = state.gradients = state.optimizer = 0;
  updated_elements = 0;
  for (const auto& p : params()) {
    const auto bytes = static_cast<int64_t>(p.tensor.nbytes());
    state.parameters += bytes;
    if (p.tensor.requires_grad()) {
      state.gradients += bytes;
      state.optimizer += slots * bytes;
      updated_elements += p.tensor.numel();
    }
  }
}

std::string model_problems(const PlanInput& in) {
  std::string msg;
  for (const auto& cfg : in.plan.strategies())
    for (const PlanIssue& p : cfg->model_issues(in))
      msg += (in.spec.source.empty() ? std::string() : in.spec.source + ": ") + "error: " + p.key + ": " + p.message + "\n";
  return msg;
}

std::vector<RankEstimate> estimate_ranks(const PlanInput& in) {
  const Plan& plan = in.plan;
  const MeshLayout layout(plan.processes());
  const int64_t activations = kept_activations(in);
  std::vector<RankEstimate> ranks;
  for (int p = 0; p < plan.process_count(); ++p) {
    RankEstimate r;
    r.rank = p;
    const std::vector<int> coords = layout.coords(p);
    for (size_t a = 0; a < coords.size(); ++a) r.coord[plan.processes().axes[a].name] = coords[a];
    // The ranks of one data group hold and send alike (the data axis replicates or
    // shards evenly): work out the first of them, copy it for the others.
    auto same_group = std::find_if(ranks.begin(), ranks.end(), [&](const RankEstimate& o) {
      for (const auto& [axis, c] : r.coord)
        if (axis != "data" && o.coord.at(axis) != c) return false;
      return true;
    });
    if (same_group != ranks.end()) {
      RankEstimate copy = *same_group;
      copy.rank = r.rank;
      copy.coord = r.coord;
      ranks.push_back(std::move(copy));
      continue;
    }
    for (auto& layer : *in.model) {
      const int i = static_cast<int>(r.layers.size());
      r.layers.push_back(i);
      r.layer_params.emplace_back();
      for (const auto& p : layer.ptr()->named_parameters())
        r.layer_params.back().push_back({std::to_string(i) + "." + p.key(), p.value()});
    }
    r.replicated_state(in.spec);
    r.activations = activations;
    // The trainer's own traffic: each step's loss averaged over the data group (a double).
    if (plan.data_ranks() > 1) r.traffic["data"].record(collectives::Traffic::kAllreduce, 8, plan.data_ranks());
    for (const auto& cfg : plan.strategies()) cfg->estimate(in, r);
    ranks.push_back(std::move(r));
  }
  return ranks;
}

namespace {

const char* kTrafficConvention =
    "sent/<axis>: bytes the rank sends on that axis per step: ring allreduce 2(n-1)/n x B, reduce-scatter, allgather "
    "and broadcast (n-1)/n x B of the whole buffer, send B (n = the group, B = the payload)";

}  // namespace

std::string estimate_table(const Plan& plan, const std::vector<RankEstimate>& ranks) {
  std::vector<std::string> axes;  // the axes anything travels on, outermost first
  for (const std::string& axis : kCompositionOrder)
    for (const auto& r : ranks) {
      auto it = r.traffic.find(axis);
      if (it != r.traffic.end() && it->second.ops > 0) {
        axes.push_back(axis);
        break;
      }
    }
  std::string out = "estimate   per rank" + std::string(plan.replicas() > 1 ? " (per process: each of its replica threads alike)" : "") +
                    ": model state (fp32) and activations at the peak of a step\n  " + kTrafficConvention + "\n";
  char line[512];
  std::string head;
  // The tensor axis' column only where the plan has one (the innermost: adjacent ranks).
  const bool tensor = plan.spec().mesh.size("tensor") > 1;
  std::snprintf(line, sizeof line, "  %-7s %-8s %-5s", plan.replicas() > 1 ? "process" : "rank", "pipeline", "data");
  head = line;
  if (tensor) head += " tensor";
  std::snprintf(line, sizeof line, " %10s %10s %10s %10s %11s %10s", "params", "grads", "optimizer", "buffers", "activations",
                "total");
  head += line;
  for (const auto& a : axes) {
    std::snprintf(line, sizeof line, " %14s", ("sent/" + a).c_str());
    head += line;
  }
  out += head + "\n";
  for (const auto& r : ranks) {
    auto coord = [&](const char* axis) {
      auto it = r.coord.find(axis);
      return it == r.coord.end() ? 0 : it->second;
    };
    std::snprintf(line, sizeof line, "  %-7d %-8d %-5d", r.rank, coord("pipeline"), coord("data"));
    out += line;
    if (tensor) {
      std::snprintf(line, sizeof line, " %-6d", coord("tensor"));
      out += line;
    }
    std::snprintf(line, sizeof line, " %10s %10s %10s %10s %11s %10s",
                  format_bytes(r.state.parameters, ByteDigits::kThree).c_str(),
                  format_bytes(r.state.gradients, ByteDigits::kThree).c_str(),
                  format_bytes(r.state.optimizer, ByteDigits::kThree).c_str(),
                  format_bytes(r.state.buffers, ByteDigits::kThree).c_str(),
                  format_bytes(r.activations, ByteDigits::kThree).c_str(),
                  format_bytes(r.state.total() + r.activations, ByteDigits::kThree).c_str());
    out += line;
    for (const auto& a : axes) {
      auto it = r.traffic.find(a);
      const int64_t sent = it == r.traffic.end() ? 0 : it->second.sent;
      std::snprintf(line, sizeof line, " %14s", format_bytes(sent, ByteDigits::kThree).c_str());
      out += line;
    }
    out += "\n";
  }
  std::vector<std::string> notes;
  for (const auto& r : ranks)
    for (const auto& n : r.notes)
      if (std::find(notes.begin(), notes.end(), n) == notes.end()) notes.push_back(n);
  for (const auto& n : notes) out += "  note: " + n + "\n";
  return out;
}

nlohmann::json estimate_json(const std::vector<RankEstimate>& ranks) {
  nlohmann::json all = nlohmann::json::array();
  for (const auto& r : ranks) {
    nlohmann::json j;
    j["rank"] = r.rank;
    for (const auto& [axis, c] : r.coord) j[axis] = c;
    j["layers"] = r.layers;
    j["bytes"] = {{"parameters", r.state.parameters}, {"gradients", r.state.gradients},
                  {"optimizer", r.state.optimizer}, {"buffers", r.state.buffers},
                  {"activations", r.activations}, {"total", r.state.total() + r.activations}};
    nlohmann::json t = nlohmann::json::object();
    for (const auto& [axis, tr] : r.traffic) {
      nlohmann::json a = {{"sent", tr.sent}, {"ops", tr.ops}};
      for (int k = 0; k < collectives::Traffic::kKinds; ++k)
        if (tr.payload[k]) a["payload"][collectives::Traffic::name(static_cast<collectives::Traffic::Kind>(k))] = tr.payload[k];
      t[axis] = a;
    }
    j["bytes_per_step"] = t;
    j["notes"] = r.notes;
    all.push_back(j);
  }
  return all;
}

}  // namespace tetra::core
