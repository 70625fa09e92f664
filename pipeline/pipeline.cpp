#include "pipeline/pipeline.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "collectives/error.h"
#include "core/safetensors.h"
#include "hardware/topology.h"
#include "pipeline/executor.h"

namespace tetra::pipeline {

using hardware::ByteDigits;
using hardware::format_bytes;

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

// ---- the strategy ---------------------------------------------------------------------

// It runs the step (core::StepRunner) and sends its stages' tensors to the checkpoint
// writer (core::StateGatherer). What it runs with is the executor's (RankStages), which
// attach sets up; the step and the evaluation are the executor's (executor.h).
class Pipeline final : public PipelineStrategy, public core::StepRunner, public core::StateGatherer {
 public:
  explicit Pipeline(Options o) { st_.opt = std::move(o); }
  std::string name() const override { return "pipeline"; }
  const PipelineStats& stats() const override { return stats_; }
  Idle idle() const override { return {stats_.wait_s, stats_.wall_s}; }
  const Partition& partition() const override { return st_.partition; }
  const Schedule& schedule() const override { return st_.sched; }

  void attach(core::TrainState& state) override;

  core::StepOutput run(const core::StepInput& step) override { return run_step(st_, step, stats_); }
  core::EvalSums evaluate(const core::Batch& batch, bool bf16) override { return run_evaluation(st_, batch, bf16); }

  double reduce_grad_norm_sq(double local) override {
    if (!st_.pp || st_.pp->size() == 1) return local;
    at::Tensor t = at::full({1}, local, at::kDouble);
    collectives::AllreduceOptions o;
    o.timeout = st_.timeout;
    st_.pp_host->allreduce(t, o)->wait();
    return t.item<double>();
  }

  void gather_state(core::TensorMap& tensors) override;

 private:
  Partition by_time_partition(torch::nn::Sequential& model, core::TrainState& state, std::vector<LayerCost>& costs);

  RankStages st_;  // the options (st_.opt), the schedule, the cut, this rank's layers and links
  const core::Dataset* data_ = nullptr;
  int data_size_ = 1, data_coord_ = 0;
  bool bf16_ = false;
  int64_t micro_size_ = 1;
  PipelineStats stats_;
};

void Pipeline::attach(core::TrainState& state) {
  st_.spec = &state.spec;
  st_.trace = &state.trace;
  data_ = state.data;
  TETRA_CHECK(data_, "pipeline: attach needs the job's dataset in TrainState::data");
  const int P = st_.opt.stages, v = st_.opt.virtual_stages;
  if (!state.mesh && P > 1)
    throw ConfigError("mesh.pipeline is " + std::to_string(P) + " but this trainer has no world of " +
                      std::to_string(P) + " ranks (run it under mpirun -np " + std::to_string(P) + ")");
  st_.rank = state.mesh ? state.mesh->coord("pipeline") : 0;
  data_size_ = state.mesh ? state.mesh->size("data") : 1;
  data_coord_ = state.mesh ? state.mesh->coord("data") : 0;
  bf16_ = state.spec.train.precision == core::Precision::kBf16;
  st_.device = state.device;
  st_.timeout = std::chrono::milliseconds(static_cast<int64_t>(state.spec.collectives.timeout_s * 1000));
  st_.sched = make_schedule(to_string(st_.opt.schedule), P, st_.opt.micro_batches, v);
  micro_size_ = state.spec.data.batch_size / data_size_ / st_.opt.micro_batches / state.spec.train.accumulation_steps;

  // Everything that can be wrong with the job is found here, on every rank alike,
  // before any rank sends a byte.
  torch::nn::Sequential& model = state.model;
  const int L = static_cast<int>(model->size());
  const int K = P * v;
  if (L < K)
    throw ConfigError("the model has " + std::to_string(L) + " layers, fewer than the " + std::to_string(K) +
                      " stages (pipeline " + std::to_string(P) + " x virtual_stages " + std::to_string(v) +
                      ") that must each hold one");
  st_.boundaries = probe_boundaries(model, *data_, bf16_);
  std::vector<LayerCost> costs;
  if (st_.opt.balance == Balance::kByTime) {
    st_.partition = by_time_partition(model, state, costs);
  } else {
    st_.partition = partition_for(st_.opt, model, {}, state.spec);
  }
  if (st_.opt.memory_gb > 0) {  // the rule `train --check` applies (model_issues), met here too
    if (costs.empty()) costs = measure_layers(model, *data_, micro_size_, bf16_, false);
    std::string msg;
    for (const core::PlanIssue& p : memory_issues(st_.opt, st_.partition, costs, state.spec))
      msg += "error: " + p.key + ": " + p.message + "\n";
    if (!msg.empty()) throw ConfigError(msg);
  }
  if (state.mesh && P > 1) st_.make_links(*state.mesh);

  // Keep this rank's stages; name every layer as the whole model names it.
  torch::nn::Sequential kept;
  for (int c = 0; c < v; ++c) {
    const int s = st_.sched.stage_of(st_.rank, c);
    st_.chunk_ranges.push_back({static_cast<int>(kept->size()), st_.partition.end(s) - st_.partition.first(s)});
    for (int i = st_.partition.first(s); i < st_.partition.end(s); ++i) kept->push_back(std::to_string(i), layer(model, i));
  }
  model = kept;
  // The chunks are cut from the model when the first step runs, not now: a strategy
  // that attaches after this one may wrap the layers (ZeRO-3 gathers each layer's
  // parameters around its forward), and the chunks must run the wrapped layers.
  st_.model = &state.model;
  st_.loss = &state.loss;  // read when it runs: a strategy attached after this one may set it
  state.params.clear();
  for (const auto& p : model->named_parameters()) state.params.push_back({p.key(), p.value()});
}

Partition Pipeline::by_time_partition(torch::nn::Sequential& model, core::TrainState& state,
                                       std::vector<LayerCost>& costs) {
  // Ranks time the layers differently; world rank 0 measures and everyone takes its
  // numbers, so every rank cuts the model at the same places. The sizes (parameters,
  // outputs) every rank counts alike.
  const int L = static_cast<int>(model->size());
  at::Tensor t = at::zeros({2 * L}, at::kDouble);
  const bool measure = !state.mesh || state.mesh->rank() == 0;
  costs = measure_layers(model, *data_, micro_size_, bf16_, measure);
  if (measure)
    for (int i = 0; i < L; ++i) {
      t[2 * i] = costs[i].forward_s;
      t[2 * i + 1] = costs[i].backward_s;
    }
  if (state.mesh && state.mesh->world()->size() > 1) {
    collectives::BroadcastOptions o;
    o.timeout = st_.timeout;
    state.mesh->host_world()->broadcast(t, o)->wait();
  }
  for (int i = 0; i < L; ++i) {
    costs[i].forward_s = t[2 * i].item<double>();
    costs[i].backward_s = t[2 * i + 1].item<double>();
  }
  return partition_for(st_.opt, model, costs, state.spec);
}

void Pipeline::gather_state(core::TensorMap& tensors) {
  // Only the writer's pipeline group gathers: the other data replicas hold the same. The
  // stages' tensors travel as safetensors bytes, host memory: over the host plane.
  if (!st_.pp || st_.pp->size() == 1 || data_coord_ != 0) return;
  collectives::SendOptions so;
  so.timeout = st_.timeout;
  collectives::RecvOptions ro;
  ro.timeout = st_.timeout;
  if (st_.pp_host->rank() != 0) {
    const std::string bytes = core::safetensors_bytes(tensors);
    at::Tensor len = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
    at::Tensor buf = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
    st_.pp_host->send(len, 0, so)->wait();
    st_.pp_host->send(buf, 0, so)->wait();
    return;
  }
  for (int r = 1; r < st_.pp_host->size(); ++r) {
    at::Tensor len = at::empty({1}, at::kLong);
    st_.pp_host->recv(len, r, ro)->wait();
    at::Tensor buf = at::empty({len.item<int64_t>()}, at::kByte);
    st_.pp_host->recv(buf, r, ro)->wait();
    std::string bytes(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(buf.numel()));
    for (auto& [k, t] : core::parse_safetensors(bytes, "pipeline stage state from rank " + std::to_string(r)))
      tensors.emplace(k, t);  // names are global; shared entries (the step count) agree
  }
}

}  // namespace

// ---- the job spec ---------------------------------------------------------------------

std::unique_ptr<core::Strategy> Options::build() const { return std::make_unique<Pipeline>(*this); }

std::string Options::plan(const core::PlanInput& input) const {
  const int P = stages, v = virtual_stages, K = P * v;
  const int D = input.plan.data_ranks();  // data processes x replicas
  const int64_t micro = input.plan.micro_batch_size();
  const bool bf16 = input.spec.train.precision == core::Precision::kBf16;
  std::ostringstream os;
  const int L = static_cast<int>(input.model->size());
  if (L < K)
    throw ConfigError("the model has " + std::to_string(L) + " layers, fewer than the " + std::to_string(K) +
                      " stages (pipeline " + std::to_string(P) + " x virtual_stages " + std::to_string(v) +
                      ") that must each hold one");
  std::vector<LayerCost> costs = measure_layers(input.model, input.data, micro, bf16, true, kDryRunTimedFlops, &input.probe);
  Partition part = partition_for(*this, input.model, costs, input.spec);
  std::vector<StageCost> sc = stage_costs(part, costs);
  const StageMemoryModel mem(*this, costs, input.spec);
  const Schedule& s = mem.schedule();
  const Simulation& sim = mem.simulation();
  os << "pipeline: " << P << " rank" << (P == 1 ? "" : "s");
  if (v > 1) os << " x " << v << " virtual stages = " << K << " stages";
  os << ", schedule " << to_string(schedule) << ", " << micro_batches << " micro-batches of " << micro << " (batch "
     << input.spec.data.batch_size << (D > 1 ? " / " + std::to_string(D) + " data ranks" : "") << ")"
     << ", balance " << to_string(balance) << " " << part.str()
     << ", checkpoint " << to_string(checkpoint) << "\n";
  // The activations of the micro-batches in flight (under checkpointing: their inputs, and
  // one at a time); the rank's whole memory is the estimate's (core::RankEstimate).
  char line[512];
  std::snprintf(line, sizeof(line), "  %-5s %-4s %-32s %10s %8s %8s %11s %9s %11s %11s\n", "stage", "rank", "layers",
                "params", "fwd ms", "bwd ms", "act/micro", "in flight", "activations", "memory");
  // "in flight": the most micro-batches whose backward is still to come, on the rank;
  // "memory": Note [Stage memory] (state and activations), against pipeline.memory_gb.
  os << line;
  for (int k = 0; k < K; ++k) {
    const int r = s.rank_of(k);
    const StageMemoryModel::Bytes bytes = mem(k, part.first(k), part.end(k));
    const int in_flight = bytes.in_flight;
    const int64_t act = bytes.activations;
    // "Flatten 3xLinear 3xReLU": the kinds of layer, in order of first appearance.
    std::vector<std::pair<std::string, int>> kinds;
    for (int i = part.first(k); i < part.end(k); ++i) {
      std::string nm = costs[i].name.substr(0, costs[i].name.find('('));
      auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& e) { return e.first == nm; });
      if (it == kinds.end()) kinds.push_back({nm, 1}); else ++it->second;
    }
    std::string names;
    for (const auto& [nm, count] : kinds)
      names += (names.empty() ? "" : " ") + (count > 1 ? std::to_string(count) + "x" : std::string()) + nm;
    std::string range = std::to_string(part.first(k)) + (part.size(k) > 1 ? "-" + std::to_string(part.end(k) - 1) : "");
    std::string label = range + ": " + names;
    if (label.size() > 32) label = label.substr(0, 29) + "...";
    const bool over = memory_gb > 0 && static_cast<double>(bytes.total()) > mem.cap();
    std::snprintf(line, sizeof(line), "  %-5d %-4d %-32s %10lld %8.3f %8.3f %11s %9d %11s %11s%s\n", k, r, label.c_str(),
                  static_cast<long long>(sc[k].params), sc[k].forward_s * 1e3, sc[k].backward_s * 1e3,
                  format_bytes(sc[k].activation_bytes, ByteDigits::kWhole).c_str(), in_flight,
                  format_bytes(act, ByteDigits::kWhole).c_str(),
                  format_bytes(bytes.total(), ByteDigits::kWhole).c_str(), over ? "  over the cap" : "");
    os << line;
  }
  if (memory_gb > 0)
    os << "  pipeline.memory_gb " << memory_gb << " per rank"
       << (v > 1 ? " (" + format_bytes(static_cast<int64_t>(mem.cap()), ByteDigits::kWhole) + " per chunk)" : "")
       << ": memory = parameters, gradients and optimizer state (fp32, replicated) + activations"
       << (s.split_backward() ? " + the inputs W keeps for the micro-batches between their B and W" : "") << "\n";
  if (!costs.empty() && costs.front().scaled)
    os << "  fwd/bwd ms: each layer timed on one sample (at most 64 tokens) and scaled by its FLOPs on the "
          "micro-batch, which is too big to time here (Note [Layer costs])\n";
  os << "  activations = act/micro x the micro-batches in flight"
     << (checkpoint == Recompute::kNever ? "" : " (their inputs, under checkpointing, + one micro-batch recomputed)")
     << "; each rank's whole memory is in the estimate below\n";
  if (sim.ok) {
    const std::string kind = to_string(schedule);
    os << "  bubble " << fmt("%.1f%%", 100 * sim.bubble_fraction) << " (ideal " << bubble_formula(kind) << " = "
       << fmt("%.1f%%", 100 * ideal_bubble(kind, P, micro_batches, v)) << "), forward = 1 slot, "
       << (s.split_backward() ? "B (input gradient) = 1, W (weight gradient) = 1" : "backward = 2") << ":\n";
    std::istringstream d(draw(s, sim));
    for (std::string l; std::getline(d, l);) os << "  " << l << "\n";
  } else {
    os << "  the schedule does not run: " << sim.error << "\n";
  }
  return os.str();
}

// This rank's stages (attach's cut), their activations by schedule and checkpointing (as
// plan() prints them), and what the executor sends per step: each micro-batch's output
// to the next stage and its input's gradient to the previous one, then the loss
// broadcast from the last stage (and the gradient norm's part, when clipping).
void Options::estimate(const core::PlanInput& input, core::RankEstimate& rank) const {
  const int P = stages, v = virtual_stages;
  rank.virtual_stages = v;
  const int64_t micro = input.plan.micro_batch_size();
  const bool bf16 = input.spec.train.precision == core::Precision::kBf16;
  const auto it = rank.coord.find("pipeline");
  const int r = it == rank.coord.end() ? 0 : it->second;
  std::vector<LayerCost> costs =
      measure_layers(input.model, input.data, micro, bf16, balance == Balance::kByTime, kDryRunTimedFlops, &input.probe);
  const Partition part = partition_for(*this, input.model, costs, input.spec);
  const StageMemoryModel mem(*this, costs, input.spec);
  const Schedule& sched = mem.schedule();
  if (P > 1 && mem.simulation().ok) rank.pipeline_bubble = mem.simulation().bubble_fraction;
  if (P > 1) rank.pipeline_schedule = to_string(schedule);
  if (balance == Balance::kByTime)
    rank.notes.push_back("pipeline.balance by_time: the cut is timed here; a run times it again and may cut elsewhere");

  // Keep this rank's layers, in chunk order (and so their parameters).
  rank.layers.clear();
  for (int c = 0; c < v; ++c)
    for (int i = part.first(sched.stage_of(r, c)); i < part.end(sched.stage_of(r, c)); ++i) rank.layers.push_back(i);
  rank.replicated_state(input.spec);

  rank.activations = 0;
  for (int c = 0; c < v; ++c) {
    const int k = sched.stage_of(r, c);
    rank.activations += mem(k, part.first(k), part.end(k)).activations;
  }
  if (P == 1) return;  // one rank: the stages hand over in memory

  // A layer's output for one micro-batch is what crosses a cut after it, both ways.
  collectives::Traffic& t = rank.traffic["pipeline"];
  for (const Instr& in : sched.ranks[r]) {
    const int k = sched.stage_of(r, in.chunk);
    switch (in.op) {
      case Op::kSendAct: t.record(collectives::Traffic::kSend, costs[part.end(k) - 1].activation_bytes, 2); break;
      case Op::kRecvAct: t.record(collectives::Traffic::kRecv, costs[part.first(k) - 1].activation_bytes, 2); break;
      case Op::kSendGrad: t.record(collectives::Traffic::kSend, costs[part.first(k) - 1].activation_bytes, 2); break;
      case Op::kRecvGrad: t.record(collectives::Traffic::kRecv, costs[part.end(k) - 1].activation_bytes, 2); break;
      default: break;
    }
  }
  t.record(collectives::Traffic::kBroadcast, 8, P);  // the step's loss, a double
  if (input.spec.optimizer.clip_grad_norm > 0) t.record(collectives::Traffic::kAllreduce, 8, P);
}

std::vector<core::PlanIssue> Options::model_issues(const core::PlanInput& input) const {
  // Every stage holds a layer: what the run and the dry run find, `train --check` finds.
  const int K = stages * virtual_stages, L = static_cast<int>(input.model->size());
  if (L < K)
    return {{virtual_stages > 1 ? "pipeline.virtual_stages" : "mesh.pipeline",
             "the model has " + std::to_string(L) + " layers, fewer than the " + std::to_string(K) +
                 " stages (pipeline " + std::to_string(stages) + " x virtual_stages " + std::to_string(virtual_stages) +
                 ") that must each hold one"}};
  if (memory_gb <= 0) return {};
  // Whether a cut fits does not depend on the layers' times: the sizes are enough here
  // (by_time then finds a cut that fits when any does).
  const std::vector<LayerCost> costs = measure_layers(input.model, input.data, input.plan.micro_batch_size(),
                                                      input.spec.train.precision == core::Precision::kBf16, false,
                                                      kDryRunTimedFlops, &input.probe);
  return memory_issues(*this, partition_for(*this, input.model, costs, input.spec), costs, input.spec);
}

}  // namespace tetra::pipeline
