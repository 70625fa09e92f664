#include "pipeline/pipeline.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <sstream>

#include "collectives/error.h"
#include "core/data.h"
#include "core/random.h"
#include "core/report.h"
#include "core/safetensors.h"
#include "core/torch_compat.h"
#include "pipeline/split_backward.h"

namespace tetra::pipeline {

namespace {

using collectives::CommunicatorPtr;
using collectives::WorkPtr;
using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

// ---- links between neighbouring ranks -------------------------------------------------

// One direction of one kind between two ranks: a two-rank communicator whose rank 0
// sends and rank 1 receives. Its own progress thread keeps its transfers in order.
struct Link {
  CommunicatorPtr comm;
  int peer() const { return 1 - comm->rank(); }
};

// ---- the strategy ---------------------------------------------------------------------

// It runs the step (core::StepRunner) and sends its stages' tensors to the checkpoint
// writer (core::StateGatherer).
class Pipeline final : public PipelineStrategy, public core::StepRunner, public core::StateGatherer {
 public:
  explicit Pipeline(Options o) : opt_(std::move(o)) {}
  std::string name() const override { return "pipeline"; }
  const PipelineStats& stats() const override { return stats_; }
  Idle idle() const override { return {stats_.wait_s, stats_.wall_s}; }
  const Partition& partition() const override { return partition_; }
  const Schedule& schedule() const override { return sched_; }

  void attach(core::TrainState& state) override {
    spec_ = &state.spec;
    trace_ = &state.trace;
    data_ = state.data;
    TETRA_CHECK(data_, "pipeline: attach needs the job's dataset in TrainState::data");
    const int P = opt_.stages, v = opt_.virtual_stages;
    if (!state.mesh && P > 1)
      throw ConfigError("mesh.pipeline is " + std::to_string(P) + " but this trainer has no world of " +
                        std::to_string(P) + " ranks (run it under mpirun -np " + std::to_string(P) + ")");
    rank_ = state.mesh ? state.mesh->coord("pipeline") : 0;
    data_size_ = state.mesh ? state.mesh->size("data") : 1;
    data_coord_ = state.mesh ? state.mesh->coord("data") : 0;
    bf16_ = state.spec.train.precision == core::Precision::kBf16;
    device_ = state.device;
    timeout_ = std::chrono::milliseconds(static_cast<int64_t>(state.spec.collectives.timeout_s * 1000));
    sched_ = make_schedule(to_string(opt_.schedule), P, opt_.micro_batches, v);
    micro_size_ = state.spec.data.batch_size / data_size_ / opt_.micro_batches / state.spec.train.accumulation_steps;

    // Everything that can be wrong with the job is found here, on every rank alike,
    // before any rank sends a byte.
    torch::nn::Sequential& model = state.model;
    const int L = static_cast<int>(model->size());
    const int K = P * v;
    if (L < K)
      throw ConfigError("the model has " + std::to_string(L) + " layers, fewer than the " + std::to_string(K) +
                        " stages (pipeline " + std::to_string(P) + " x virtual_stages " + std::to_string(v) +
                        ") that must each hold one");
    boundaries_ = probe_boundaries(model, *data_, bf16_);
    std::vector<LayerCost> costs;
    if (opt_.balance == Balance::kByTime) {
      partition_ = by_time_partition(model, state, costs);
    } else {
      partition_ = partition_for(opt_, model, {}, state.spec);
    }
    if (opt_.memory_gb > 0) {  // the rule `train --check` applies (model_issues), met here too
      if (costs.empty()) costs = measure_layers(model, *data_, micro_size_, bf16_, false);
      std::string msg;
      for (const core::PlanIssue& p : memory_issues(opt_, partition_, costs, state.spec))
        msg += "error: " + p.key + ": " + p.message + "\n";
      if (!msg.empty()) throw ConfigError(msg);
    }
    if (state.mesh && P > 1) make_links(*state.mesh);

    // Keep this rank's stages; name every layer as the whole model names it.
    torch::nn::Sequential kept;
    for (int c = 0; c < v; ++c) {
      const int s = sched_.stage_of(rank_, c);
      chunk_ranges_.push_back({static_cast<int>(kept->size()), partition_.end(s) - partition_.first(s)});
      for (int i = partition_.first(s); i < partition_.end(s); ++i) kept->push_back(std::to_string(i), layer(model, i));
    }
    model = kept;
    // The chunks are cut from the model when the first step runs, not now: a strategy
    // that attaches after this one may wrap the layers (ZeRO-3 gathers each layer's
    // parameters around its forward), and the chunks must run the wrapped layers.
    model_ = &state.model;
    loss_ = &state.loss;  // read when it runs: a strategy attached after this one may set it
    state.params.clear();
    for (const auto& p : model->named_parameters()) state.params.push_back({p.key(), p.value()});
  }

  core::StepOutput run(const core::StepInput& step) override;
  core::EvalSums evaluate(const core::Batch& batch, bool bf16) override;

  double reduce_grad_norm_sq(double local) override {
    if (!pp_ || pp_->size() == 1) return local;
    at::Tensor t = at::full({1}, local, at::kDouble);
    collectives::AllreduceOptions o;
    o.timeout = timeout_;
    pp_host_->allreduce(t, o)->wait();
    return t.item<double>();
  }

  void gather_state(core::TensorMap& tensors) override;

 private:
  Partition by_time_partition(torch::nn::Sequential& model, core::TrainState& state, std::vector<LayerCost>& costs);
  void make_links(const core::Mesh& mesh);
  int stage(int chunk) const { return sched_.stage_of(rank_, chunk); }
  bool first(int chunk) const { return stage(chunk) == 0; }
  bool last(int chunk) const { return stage(chunk) == sched_.total_stages() - 1; }
  // The input boundary of a stage (the previous stage's output).
  const Boundary& input_of(int chunk) const { return boundaries_[partition_.first(stage(chunk)) - 1]; }
  const Boundary& output_of(int chunk) const { return boundaries_[partition_.end(stage(chunk)) - 1]; }
  bool checkpointed(int micro) const {
    return opt_.checkpoint == Recompute::kAlways ||
           (opt_.checkpoint == Recompute::kExceptLast && micro != opt_.micro_batches - 1);
  }
  // Neighbouring stages' ranks (this rank itself when they hand over locally).
  int prev_rank(int chunk) const { return sched_.rank_of(stage(chunk) - 1); }
  int next_rank(int chunk) const { return sched_.rank_of(stage(chunk) + 1); }
  int prev_chunk(int chunk) const { return sched_.chunk_of(stage(chunk) - 1); }
  int next_chunk(int chunk) const { return sched_.chunk_of(stage(chunk) + 1); }
  void broadcast_from_last(at::Tensor t) {
    if (!pp_ || pp_->size() == 1) return;
    collectives::BroadcastOptions o;
    o.root = sched_.rank_of(sched_.total_stages() - 1);  // rank 0 under ZBV's V
    o.timeout = timeout_;
    pp_host_->broadcast(t, o)->wait();
  }

  Options opt_;
  const core::JobSpec* spec_ = nullptr;
  core::Trace* trace_ = nullptr;
  const core::Dataset* data_ = nullptr;
  int rank_ = 0, data_size_ = 1, data_coord_ = 0;
  bool bf16_ = false;
  at::Device device_ = at::kCPU;  // Note [One device]
  int64_t micro_size_ = 1;
  collectives::Duration timeout_ = collectives::kDefaultTimeout;
  Schedule sched_;
  Partition partition_;
  std::vector<Boundary> boundaries_;  // boundaries_[i]: layer i's output
  std::vector<torch::nn::Sequential> chunks_;      // cut from *model_ by chunk_ranges_ on first use
  std::vector<std::pair<int, int>> chunk_ranges_;  // (first layer in the kept model, layers)
  torch::nn::Sequential* model_ = nullptr;         // the trainer's model (this rank's layers)
  const core::ModelLoss* loss_ = nullptr;          // the trainer's (TrainState::loss)
  void cut_chunks() {
    if (!chunks_.empty()) return;
    for (const auto& [first, count] : chunk_ranges_) {
      torch::nn::Sequential chunk;
      auto names = (*model_)->named_children();
      for (int i = first; i < first + count; ++i) chunk->push_back(names[i].key(), layer(*model_, i));
      chunks_.push_back(chunk);
    }
  }
  CommunicatorPtr pp_;
  CommunicatorPtr pp_host_;  // the same ranks' host plane: the loss, norms, state (Note [Two planes])
  // This rank's links, by (from, to) pipeline rank: activations flow from stage s to s+1,
  // gradients back. Under ZBV's V both kinds flow both ways between neighbours.
  std::map<std::pair<int, int>, Link> act_links_, grad_links_;
  const Link& act_link(int from, int to) const { return act_links_.at({from, to}); }
  const Link& grad_link(int from, int to) const { return grad_links_.at({from, to}); }
  PipelineStats stats_;
};

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
    o.timeout = timeout_;
    state.mesh->host_world()->broadcast(t, o)->wait();
  }
  for (int i = 0; i < L; ++i) {
    costs[i].forward_s = t[2 * i].item<double>();
    costs[i].backward_s = t[2 * i + 1].item<double>();
  }
  return partition_for(opt_, model, costs, state.spec);
}

void Pipeline::make_links(const core::Mesh& mesh) {
  pp_ = mesh.axis("pipeline");
  pp_host_ = mesh.host("pipeline");
  const int me = pp_->rank();
  // The rank pairs activations cross, in stage order: r -> r+1, P-1 -> 0 when chunks wrap
  // around the ranks (interleaving), r -> r-1 on the way back up a V. Every pipeline rank
  // takes part in every split, in the same order.
  std::vector<std::pair<int, int>> pairs;
  for (int st = 0; st + 1 < sched_.total_stages(); ++st) {
    const std::pair<int, int> ab{sched_.rank_of(st), sched_.rank_of(st + 1)};
    if (ab.first != ab.second && std::find(pairs.begin(), pairs.end(), ab) == pairs.end()) pairs.push_back(ab);
  }
  for (const auto& [a, b] : pairs) {
    const bool in = me == a || me == b;
    const std::string edge = std::to_string(a) + "->" + std::to_string(b);
    CommunicatorPtr act = pp_->split(in ? 0 : -1, me == a ? 0 : 1, "pipeline activations " + edge, timeout_);
    CommunicatorPtr grad = pp_->split(in ? 0 : -1, me == b ? 0 : 1,
                                      "pipeline gradients " + std::to_string(b) + "->" + std::to_string(a), timeout_);
    if (in) {
      act_links_[{a, b}].comm = act;
      grad_links_[{b, a}].comm = grad;
    }
  }
}

// ---- the executor ---------------------------------------------------------------------

// Receives posted ahead on one link, in the order the schedule consumes them.
class Inbox {
 public:
  Inbox(const Link& link, int ahead, collectives::Duration timeout, at::Device device)
      : ahead_(ahead), link_(link), timeout_(timeout), device_(device) {}
  void expect(std::vector<int64_t> shape, at::ScalarType dtype) { pending_.push_back({std::move(shape), dtype}); }
  void start() {
    for (int k = 0; k < ahead_; ++k) post();
  }
  // The next message; posts the one after.
  at::Tensor take(double* wait_s) {
    if (posted_.empty()) post();
    TETRA_CHECK(!posted_.empty(), "pipeline: a receive the schedule did not announce");
    auto [buf, work] = posted_.front();
    posted_.erase(posted_.begin());
    auto t0 = Clock::now();
    work->wait();
    *wait_s += seconds(t0, Clock::now());
    if (ahead_ > 0) post();
    return buf;
  }

 private:
  const int ahead_;  // receives posted before they are needed (pipeline.prefetch)
  void post() {
    if (next_ >= pending_.size()) return;
    const auto& [shape, dtype] = pending_[next_++];
    at::Tensor buf = at::empty(shape, at::TensorOptions().dtype(dtype).device(device_));
    collectives::RecvOptions o;
    o.timeout = timeout_;
    posted_.push_back({buf, link_.comm->recv(buf, link_.peer(), o)});
  }
  const Link& link_;
  collectives::Duration timeout_;
  at::Device device_;
  std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> pending_;
  size_t next_ = 0;
  std::vector<std::pair<at::Tensor, WorkPtr>> posted_;
};

// What one (micro-batch, chunk) holds between its forward and its backward.
struct Slot {
  at::Tensor input;   // received (requires grad) or the data's inputs
  at::Tensor output;  // with its graph (none under checkpointing)
  at::Tensor loss;    // last stage: the micro-batch's weighted loss
  at::Tensor targets;
  at::Tensor out_grad;
  at::Tensor input_grad;  // what the backward (or B) computed for the previous stage
  SplitBackward split;    // between a B and its W: what the W needs
};

}  // namespace

core::StepOutput Pipeline::run(const core::StepInput& step) {
  cut_chunks();
  const int m = opt_.micro_batches, v = opt_.virtual_stages;
  const auto& prog = sched_.ranks[rank_];
  // Each micro-batch's rows, dropout key and loss weight, the step's loss and its times
  // (Note [One step runner]).
  // With train.accumulation_steps A the schedule runs A times, each round on the next m of
  // the step's A x m micro-batches; the gradients accumulate over the rounds and the other
  // strategies' hooks send them after the last round's last backward.
  const int rounds = spec_->train.accumulation_steps;
  core::MicroBatches micro(step, m * rounds);
  core::StepOutput& out = micro.out();
  std::vector<WorkPtr> sends;
  double wait_s = 0;
  const auto t_begin = Clock::now();
  for (int round = 0; round < rounds; ++round) {
    const int base = round * m;  // the round's first micro-batch in the step
    std::vector<std::vector<Slot>> slots(v, std::vector<Slot>(m));

    // One inbox per link this rank receives on, told in order what the schedule takes from it.
    std::map<std::pair<int, int>, Inbox> acts, grads;
    for (const auto& [key, link] : act_links_)
      if (key.second == rank_) acts.emplace(key, Inbox(link, opt_.prefetch, timeout_, device_));
    for (const auto& [key, link] : grad_links_)
      if (key.second == rank_) grads.emplace(key, Inbox(link, opt_.prefetch, timeout_, device_));
    // The instruction after which the step's gradients are complete: the last fused backward
    // or W (the data-parallel and ZeRO hooks then send what they have).
    int last_backward = -1;
    for (size_t k = 0; k < prog.size(); ++k) {
      const Instr& in = prog[k];
      if (in.op == Op::kRecvAct)
        acts.at({prev_rank(in.chunk), rank_}).expect(input_of(in.chunk).shape(micro.rows(base + in.micro)), input_of(in.chunk).dtype);
      if (in.op == Op::kRecvGrad)
        grads.at({next_rank(in.chunk), rank_}).expect(output_of(in.chunk).shape(micro.rows(base + in.micro)), output_of(in.chunk).dtype);
      if ((in.op == Op::kBackward || in.op == Op::kBackwardWeight) && round == rounds - 1) last_backward = static_cast<int>(k);
    }
    for (auto& [key, inbox] : acts) inbox.start();
    for (auto& [key, inbox] : grads) inbox.start();

    const bool tracing = trace_->enabled();
    auto span = [&](int chunk, const std::string& what, Clock::time_point a, Clock::time_point b) {
      if (tracing) trace_->span("stage " + std::to_string(stage(chunk)), what, trace_->us_at(a), trace_->us_at(b));
    };
    auto load = [&](int i, Slot& s, int chunk) {
      core::Batch b = micro.load(base + i);
      if (first(chunk)) s.input = b.inputs;
      s.targets = b.targets;
    };
    // A micro-batch's dropout draws by its rows' places in the global batch: its forward and
    // its recompute under checkpointing draw the same masks (Note [Layout-invariant dropout]).
    // The last stage's forward returns the micro-batch's mean loss (s.loss is it weighted).
    auto run_forward = [&](int i, int chunk, Slot& s) {
      core::RandomContext::Scope random(micro.random(base + i));
      core::compat::Autocast autocast(step.bf16, step.device.type());
      s.output = chunks_[chunk]->forward(s.input);
      if (!last(chunk)) return at::Tensor();
      at::Tensor l = loss_->loss(s.output, s.targets);
      s.loss = micro.weighted(base + i, l);
      return l;
    };
    auto send = [&](const Link& link, const at::Tensor& t) {
      collectives::SendOptions o;
      o.timeout = timeout_;
      // A finished send lets go of its tensor now rather than at the step's end (a
      // gradient a stage sent is memory it no longer needs).
      sends.erase(std::remove_if(sends.begin(), sends.end(), [](const WorkPtr& w) { return w->done() && !w->exception(); }),
                  sends.end());
      sends.push_back(link.comm->send(t.detach().contiguous(), link.peer(), o));
    };
    // A backward (fused or B) begins with its output's gradient: received, or handed over by
    // the next stage when it is on this rank; under checkpointing it recomputes the forward.
    auto begin_backward = [&](const Instr& in, Slot& s) {
      if (!last(in.chunk) && !s.out_grad.defined()) {
        Slot& next = slots[next_chunk(in.chunk)][in.micro];
        s.out_grad = next.input_grad;
        next.input = next.input_grad = at::Tensor();
      }
      if (checkpointed(in.micro)) run_forward(in.micro, in.chunk, s);  // again, now with its graph (GPipe)
    };
    // What a backward leaves: its input's gradient, until it is sent or handed over, and
    // (after a B) what its W needs, which the slot's SplitBackward holds.
    auto end_backward = [&](Slot& s, int chunk) {
      s.output = s.loss = s.out_grad = s.targets = at::Tensor();
      if (first(chunk)) s.input = at::Tensor();
    };
    // Runs an instruction's compute, adds its time to `total` and traces it.
    auto timed = [&](const Instr& in, double& total, auto&& work) {
      const auto t0 = Clock::now();
      work();
      const auto t1 = Clock::now();
      total += seconds(t0, t1);
      span(in.chunk, to_string(in), t0, t1);
    };

    for (size_t k = 0; k < prog.size(); ++k) {
      const Instr& in = prog[k];
      Slot& s = slots[in.chunk][in.micro];
      switch (in.op) {
        case Op::kRecvAct: {
          auto t0 = Clock::now();
          s.input = acts.at({prev_rank(in.chunk), rank_}).take(&wait_s);
          if (s.input.is_floating_point()) s.input.requires_grad_(true);
          span(in.chunk, "wait " + to_string(in), t0, Clock::now());
          break;
        }
        case Op::kRecvGrad: {
          auto t0 = Clock::now();
          s.out_grad = grads.at({next_rank(in.chunk), rank_}).take(&wait_s);
          span(in.chunk, "wait " + to_string(in), t0, Clock::now());
          break;
        }
        case Op::kForward: {
          if (first(in.chunk) || last(in.chunk)) load(in.micro, s, in.chunk);
          if (!first(in.chunk) && !s.input.defined()) {
            // The previous stage is on this rank (one rank with several chunks, the V's
            // turn): hand over.
            Slot& prev = slots[prev_chunk(in.chunk)][in.micro];
            s.input = prev.output.detach();
            if (s.input.is_floating_point()) s.input.requires_grad_(true);
          }
          timed(in, out.forward_s, [&] {
            at::Tensor loss;
            if (checkpointed(in.micro)) {
              torch::NoGradGuard no_grad;
              loss = run_forward(in.micro, in.chunk, s);
            } else {
              loss = run_forward(in.micro, in.chunk, s);
            }
            if (loss.defined()) micro.add_loss(base + in.micro, loss.item<double>());
          });
          break;
        }
        case Op::kSendAct:
          send(act_link(rank_, next_rank(in.chunk)), s.output);
          break;
        case Op::kBackward: {
          if (step.before_backward) step.before_backward(static_cast<int>(k) == last_backward);
          begin_backward(in, s);
          timed(in, out.backward_s, [&] {
            // A stage with nothing to differentiate (a lone Flatten on the data) has no graph.
            if (last(in.chunk)) {
              if (s.loss.requires_grad()) s.loss.backward();
            } else if (s.output.requires_grad()) {
              torch::autograd::backward({s.output}, {s.out_grad});
            }
            if (!first(in.chunk) && s.input.requires_grad()) s.input_grad = s.input.grad();
          });
          end_backward(s, in.chunk);
          break;
        }
        case Op::kBackwardInput: {
          begin_backward(in, s);
          timed(in, out.backward_s, [&] {
            const at::Tensor& root = last(in.chunk) ? s.loss : s.output;
            s.input_grad = s.split.input_pass(root, last(in.chunk) ? at::Tensor() : s.out_grad,
                                              first(in.chunk) ? at::Tensor() : s.input);
          });
          end_backward(s, in.chunk);
          break;
        }
        case Op::kBackwardWeight: {
          if (step.before_backward) step.before_backward(static_cast<int>(k) == last_backward);
          timed(in, out.backward_s, [&] { s.split.weight_pass(); });
          break;
        }
        case Op::kSendGrad: {
          at::Tensor g = s.input_grad;
          if (!g.defined()) g = at::zeros_like(s.input);
          send(grad_link(rank_, prev_rank(in.chunk)), g);
          s.input = s.input_grad = at::Tensor();
          break;
        }
      }
    }
  }  // rounds
  for (auto& w : sends) {
    auto t0 = Clock::now();
    w->wait();
    wait_s += seconds(t0, Clock::now());
  }
  const auto t_end = Clock::now();
  stats_.steps += 1;
  stats_.busy_s += out.forward_s + out.backward_s;
  stats_.wait_s += wait_s;
  stats_.wall_s += seconds(t_begin, t_end);
  // The loss lives on the last stage; every pipeline rank reports it.
  at::Tensor loss = at::full({1}, out.loss, at::kDouble);
  broadcast_from_last(loss);
  out.loss = loss.item<double>();
  return out;
}

core::EvalSums Pipeline::evaluate(const core::Batch& batch, bool bf16) {
  cut_chunks();
  // Forward only, through every stage in order; the batch goes in pieces so the stages
  // overlap (and no piece is larger than a training micro-batch needs to be).
  const int v = opt_.virtual_stages;
  const int64_t n = batch.size();
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(n, opt_.micro_batches));
  torch::NoGradGuard no_grad;
  double loss_sum = 0;
  int64_t correct = 0, predictions = 0;
  std::vector<WorkPtr> sends;
  std::vector<std::vector<at::Tensor>> outputs(v, std::vector<at::Tensor>(pieces));
  for (int c = 0; c < v; ++c) {
    for (int64_t j = 0; j < pieces; ++j) {
      const int64_t b = n * j / pieces, e = n * (j + 1) / pieces;
      at::Tensor x;
      if (first(c)) {
        x = batch.inputs.slice(0, b, e);
      } else if (prev_rank(c) != rank_) {
        x = at::empty(input_of(c).shape(e - b), at::TensorOptions().dtype(input_of(c).dtype).device(device_));
        collectives::RecvOptions o;
        o.timeout = timeout_;
        const Link& link = act_link(prev_rank(c), rank_);
        link.comm->recv(x, link.peer(), o)->wait();
      } else {
        x = std::move(outputs[prev_chunk(c)][j]);  // the previous stage is on this rank
      }
      at::Tensor y;
      {
        core::compat::Autocast autocast(bf16, x.device().type());
        y = chunks_[c]->forward(x);
      }
      if (last(c)) {
        y = y.to(at::kFloat);
        at::Tensor t = batch.targets.slice(0, b, e);
        loss_sum += loss_->loss(y, t).item<double>() * static_cast<double>(e - b);
        correct += loss_->correct(y, t);
        predictions += t.numel();
      } else if (next_rank(c) != rank_) {
        collectives::SendOptions o;
        o.timeout = timeout_;
        const Link& link = act_link(rank_, next_rank(c));
        sends.push_back(link.comm->send(y.contiguous(), link.peer(), o));
      } else {
        outputs[c][j] = y;
      }
    }
  }
  for (auto& w : sends) w->wait();
  at::Tensor sums = at::tensor({loss_sum, static_cast<double>(correct), static_cast<double>(predictions)}, at::kDouble);
  broadcast_from_last(sums);
  core::EvalSums r;
  r.loss_sum = sums[0].item<double>();
  r.correct = static_cast<int64_t>(sums[1].item<double>());
  r.predictions = static_cast<int64_t>(sums[2].item<double>());
  return r;
}

void Pipeline::gather_state(core::TensorMap& tensors) {
  // Only the writer's pipeline group gathers: the other data replicas hold the same. The
  // stages' tensors travel as safetensors bytes, host memory: over the host plane.
  if (!pp_ || pp_->size() == 1 || data_coord_ != 0) return;
  collectives::SendOptions so;
  so.timeout = timeout_;
  collectives::RecvOptions ro;
  ro.timeout = timeout_;
  if (pp_host_->rank() != 0) {
    const std::string bytes = core::safetensors_bytes(tensors);
    at::Tensor len = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
    at::Tensor buf = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
    pp_host_->send(len, 0, so)->wait();
    pp_host_->send(buf, 0, so)->wait();
    return;
  }
  for (int r = 1; r < pp_host_->size(); ++r) {
    at::Tensor len = at::empty({1}, at::kLong);
    pp_host_->recv(len, r, ro)->wait();
    at::Tensor buf = at::empty({len.item<int64_t>()}, at::kByte);
    pp_host_->recv(buf, r, ro)->wait();
    std::string bytes(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(buf.numel()));
    for (auto& [k, t] : core::parse_safetensors(bytes, "pipeline stage state from rank " + std::to_string(r)))
      tensors.emplace(k, t);  // names are global; shared entries (the step count) agree
  }
}

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
                  core::human_bytes(sc[k].activation_bytes).c_str(), in_flight, core::human_bytes(act).c_str(),
                  core::human_bytes(bytes.total()).c_str(), over ? "  over the cap" : "");
    os << line;
  }
  if (memory_gb > 0)
    os << "  pipeline.memory_gb " << memory_gb << " per rank"
       << (v > 1 ? " (" + core::human_bytes(static_cast<int64_t>(mem.cap())) + " per chunk)" : "")
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
