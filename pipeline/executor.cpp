#include "pipeline/executor.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "collectives/error.h"
#include "core/random.h"
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

}  // namespace

// ---- this rank's stages ---------------------------------------------------------------

void RankStages::make_links(const core::Mesh& mesh) {
  pp = mesh.axis("pipeline");
  pp_host = mesh.host("pipeline");
  const int me = pp->rank();
  // The rank pairs activations cross, in stage order: r -> r+1, P-1 -> 0 when chunks wrap
  // around the ranks (interleaving), r -> r-1 on the way back up a V. Every pipeline rank
  // takes part in every split, in the same order.
  std::vector<std::pair<int, int>> pairs;
  for (int st = 0; st + 1 < sched.total_stages(); ++st) {
    const std::pair<int, int> ab{sched.rank_of(st), sched.rank_of(st + 1)};
    if (ab.first != ab.second && std::find(pairs.begin(), pairs.end(), ab) == pairs.end()) pairs.push_back(ab);
  }
  for (const auto& [a, b] : pairs) {
    const bool in = me == a || me == b;
    const std::string edge = std::to_string(a) + "->" + std::to_string(b);
    CommunicatorPtr act = pp->split(in ? 0 : -1, me == a ? 0 : 1, "pipeline activations " + edge, timeout);
    CommunicatorPtr grad = pp->split(in ? 0 : -1, me == b ? 0 : 1,
                                     "pipeline gradients " + std::to_string(b) + "->" + std::to_string(a), timeout);
    if (in) {
      act_links[{a, b}].comm = act;
      grad_links[{b, a}].comm = grad;
    }
  }
}

void RankStages::cut_chunks() {
  if (!chunks.empty()) return;
  for (const auto& [first, count] : chunk_ranges) {
    torch::nn::Sequential chunk;
    auto names = (*model)->named_children();
    for (int i = first; i < first + count; ++i) chunk->push_back(names[i].key(), layer(*model, i));
    chunks.push_back(chunk);
  }
}

void RankStages::broadcast_from_last(at::Tensor t) const {
  if (!pp || pp->size() == 1) return;
  collectives::BroadcastOptions o;
  o.root = sched.rank_of(sched.total_stages() - 1);  // rank 0 under ZBV's V
  o.timeout = timeout;
  pp_host->broadcast(t, o)->wait();
}

// ---- the executor ---------------------------------------------------------------------

namespace {

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

// What a step's rounds share: each micro-batch's rows, dropout key and loss weight, the
// step's loss and its times (Note [One step runner]), the sends still in flight and the
// time spent waiting on the neighbours.
struct StepState {
  StepState(const core::StepInput& in, int64_t count) : step(in), micro(in, count), out(micro.out()) {}
  StepState(const StepState&) = delete;
  StepState& operator=(const StepState&) = delete;
  const core::StepInput& step;
  core::MicroBatches micro;
  core::StepOutput& out;
  std::vector<WorkPtr> sends;
  double wait_s = 0;
};

// One round of a step: the schedule's instructions for this rank, in order, each run by
// the handler of its kind. The handlers share the round's state: its slots, the inboxes
// of its links and the step's (StepState).
class Round {
 public:
  Round(RankStages& st, StepState& state, int round, bool last_round);
  Round(const Round&) = delete;
  Round& operator=(const Round&) = delete;
  void run();

 private:
  // One handler per kind of instruction (Op); `k`: the instruction's place in the list.
  void recv_act(const Instr& in, Slot& s);
  void recv_grad(const Instr& in, Slot& s);
  void forward(const Instr& in, Slot& s);
  void send_act(const Instr& in, Slot& s);
  void backward(size_t k, const Instr& in, Slot& s);
  void backward_input(const Instr& in, Slot& s);
  void backward_weight(size_t k, const Instr& in, Slot& s);
  void send_grad(const Instr& in, Slot& s);

  // What they share.
  void span(int chunk, const std::string& what, Clock::time_point a, Clock::time_point b);
  void load(int i, Slot& s, int chunk);
  at::Tensor run_forward(int i, int chunk, Slot& s);
  void send(const Link& link, const at::Tensor& t);
  void begin_backward(const Instr& in, Slot& s);
  void end_backward(Slot& s, int chunk);
  // Runs an instruction's compute, adds its time to `total` and traces it.
  template <class Work>
  void timed(const Instr& in, double& total, Work&& work) {
    const auto t0 = Clock::now();
    work();
    const auto t1 = Clock::now();
    total += seconds(t0, t1);
    span(in.chunk, to_string(in), t0, t1);
  }
  // Before a fused backward or a W: the other strategies' hooks (Note [How a pipeline step
  // runs]), told whether it completes the step's gradients.
  void before_backward(size_t k) {
    if (s_.step.before_backward) s_.step.before_backward(static_cast<int>(k) == last_backward_);
  }

  RankStages& st_;
  StepState& s_;
  const std::vector<Instr>& prog_;
  const int base_;  // the round's first micro-batch in the step
  std::vector<std::vector<Slot>> slots_;
  // One inbox per link this rank receives on, told in order what the schedule takes from it.
  std::map<std::pair<int, int>, Inbox> acts_, grads_;
  // The instruction after which the step's gradients are complete: the last fused backward
  // or W (the data-parallel and ZeRO hooks then send what they have).
  int last_backward_ = -1;
  bool tracing_ = false;
};

Round::Round(RankStages& st, StepState& state, int round, bool last_round)
    : st_(st), s_(state), prog_(st.sched.ranks[st.rank]), base_(round * st.opt.micro_batches),
      slots_(st.opt.virtual_stages, std::vector<Slot>(st.opt.micro_batches)) {
  const int me = st_.rank;
  for (const auto& [key, link] : st_.act_links)
    if (key.second == me) acts_.emplace(key, Inbox(link, st_.opt.prefetch, st_.timeout, st_.device));
  for (const auto& [key, link] : st_.grad_links)
    if (key.second == me) grads_.emplace(key, Inbox(link, st_.opt.prefetch, st_.timeout, st_.device));
  for (size_t k = 0; k < prog_.size(); ++k) {
    const Instr& in = prog_[k];
    if (in.op == Op::kRecvAct) {
      const Boundary& b = st_.input_of(in.chunk);
      acts_.at({st_.prev_rank(in.chunk), me}).expect(b.shape(s_.micro.rows(base_ + in.micro)), b.dtype);
    }
    if (in.op == Op::kRecvGrad) {
      const Boundary& b = st_.output_of(in.chunk);
      grads_.at({st_.next_rank(in.chunk), me}).expect(b.shape(s_.micro.rows(base_ + in.micro)), b.dtype);
    }
    if ((in.op == Op::kBackward || in.op == Op::kBackwardWeight) && last_round) last_backward_ = static_cast<int>(k);
  }
  for (auto& [key, inbox] : acts_) inbox.start();
  for (auto& [key, inbox] : grads_) inbox.start();
  tracing_ = st_.trace->enabled();
}

void Round::run() {
  for (size_t k = 0; k < prog_.size(); ++k) {
    const Instr& in = prog_[k];
    Slot& s = slots_[in.chunk][in.micro];
    switch (in.op) {
      case Op::kRecvAct: recv_act(in, s); break;
      case Op::kRecvGrad: recv_grad(in, s); break;
      case Op::kForward: forward(in, s); break;
      case Op::kSendAct: send_act(in, s); break;
      case Op::kBackward: backward(k, in, s); break;
      case Op::kBackwardInput: backward_input(in, s); break;
      case Op::kBackwardWeight: backward_weight(k, in, s); break;
      case Op::kSendGrad: send_grad(in, s); break;
    }
  }
}

void Round::span(int chunk, const std::string& what, Clock::time_point a, Clock::time_point b) {
  if (tracing_) st_.trace->span("stage " + std::to_string(st_.stage(chunk)), what, st_.trace->us_at(a), st_.trace->us_at(b));
}

void Round::load(int i, Slot& s, int chunk) {
  core::Batch b = s_.micro.load(base_ + i);
  if (st_.first(chunk)) s.input = b.inputs;
  s.targets = b.targets;
}

// A micro-batch's dropout draws by its rows' places in the global batch: its forward and
// its recompute under checkpointing draw the same masks (Note [Layout-invariant dropout]).
// The last stage's forward returns the micro-batch's mean loss (s.loss is it weighted).
at::Tensor Round::run_forward(int i, int chunk, Slot& s) {
  core::RandomContext::Scope random(s_.micro.random(base_ + i));
  core::compat::Autocast autocast(s_.step.bf16, s_.step.device.type());
  s.output = st_.chunks[chunk]->forward(s.input);
  if (!st_.last(chunk)) return at::Tensor();
  at::Tensor l = st_.loss->loss(s.output, s.targets);
  s.loss = s_.micro.weighted(base_ + i, l);
  return l;
}

void Round::send(const Link& link, const at::Tensor& t) {
  collectives::SendOptions o;
  o.timeout = st_.timeout;
  // A finished send lets go of its tensor now rather than at the step's end (a
  // gradient a stage sent is memory it no longer needs).
  std::vector<WorkPtr>& sends = s_.sends;
  sends.erase(std::remove_if(sends.begin(), sends.end(), [](const WorkPtr& w) { return w->done() && !w->exception(); }),
              sends.end());
  sends.push_back(link.comm->send(t.detach().contiguous(), link.peer(), o));
}

// A backward (fused or B) begins with its output's gradient: received, or handed over by
// the next stage when it is on this rank; under checkpointing it recomputes the forward.
void Round::begin_backward(const Instr& in, Slot& s) {
  if (!st_.last(in.chunk) && !s.out_grad.defined()) {
    Slot& next = slots_[st_.next_chunk(in.chunk)][in.micro];
    s.out_grad = next.input_grad;
    next.input = next.input_grad = at::Tensor();
  }
  if (st_.checkpointed(in.micro)) run_forward(in.micro, in.chunk, s);  // again, now with its graph (GPipe)
}

// What a backward leaves: its input's gradient, until it is sent or handed over, and
// (after a B) what its W needs, which the slot's SplitBackward holds.
void Round::end_backward(Slot& s, int chunk) {
  s.output = s.loss = s.out_grad = s.targets = at::Tensor();
  if (st_.first(chunk)) s.input = at::Tensor();
}

void Round::recv_act(const Instr& in, Slot& s) {
  auto t0 = Clock::now();
  s.input = acts_.at({st_.prev_rank(in.chunk), st_.rank}).take(&s_.wait_s);
  if (s.input.is_floating_point()) s.input.requires_grad_(true);
  span(in.chunk, "wait " + to_string(in), t0, Clock::now());
}

void Round::recv_grad(const Instr& in, Slot& s) {
  auto t0 = Clock::now();
  s.out_grad = grads_.at({st_.next_rank(in.chunk), st_.rank}).take(&s_.wait_s);
  span(in.chunk, "wait " + to_string(in), t0, Clock::now());
}

void Round::forward(const Instr& in, Slot& s) {
  if (st_.first(in.chunk) || st_.last(in.chunk)) load(in.micro, s, in.chunk);
  if (!st_.first(in.chunk) && !s.input.defined()) {
    // The previous stage is on this rank (one rank with several chunks, the V's
    // turn): hand over.
    Slot& prev = slots_[st_.prev_chunk(in.chunk)][in.micro];
    s.input = prev.output.detach();
    if (s.input.is_floating_point()) s.input.requires_grad_(true);
  }
  timed(in, s_.out.forward_s, [&] {
    at::Tensor loss;
    if (st_.checkpointed(in.micro)) {
      torch::NoGradGuard no_grad;
      loss = run_forward(in.micro, in.chunk, s);
    } else {
      loss = run_forward(in.micro, in.chunk, s);
    }
    if (loss.defined()) s_.micro.add_loss(base_ + in.micro, loss.item<double>());
  });
}

void Round::send_act(const Instr& in, Slot& s) { send(st_.act_link(st_.rank, st_.next_rank(in.chunk)), s.output); }

void Round::backward(size_t k, const Instr& in, Slot& s) {
  before_backward(k);
  begin_backward(in, s);
  timed(in, s_.out.backward_s, [&] {
    // A stage with nothing to differentiate (a lone Flatten on the data) has no graph.
    if (st_.last(in.chunk)) {
      if (s.loss.requires_grad()) s.loss.backward();
    } else if (s.output.requires_grad()) {
      torch::autograd::backward({s.output}, {s.out_grad});
    }
    if (!st_.first(in.chunk) && s.input.requires_grad()) s.input_grad = s.input.grad();
  });
  end_backward(s, in.chunk);
}

void Round::backward_input(const Instr& in, Slot& s) {
  begin_backward(in, s);
  timed(in, s_.out.backward_s, [&] {
    const bool last = st_.last(in.chunk);
    const at::Tensor& root = last ? s.loss : s.output;
    s.input_grad = s.split.input_pass(root, last ? at::Tensor() : s.out_grad,
                                      st_.first(in.chunk) ? at::Tensor() : s.input);
  });
  end_backward(s, in.chunk);
}

void Round::backward_weight(size_t k, const Instr& in, Slot& s) {
  before_backward(k);
  timed(in, s_.out.backward_s, [&] { s.split.weight_pass(); });
}

void Round::send_grad(const Instr& in, Slot& s) {
  at::Tensor g = s.input_grad;
  if (!g.defined()) g = at::zeros_like(s.input);
  send(st_.grad_link(st_.rank, st_.prev_rank(in.chunk)), g);
  s.input = s.input_grad = at::Tensor();
}

}  // namespace

core::StepOutput run_step(RankStages& st, const core::StepInput& step, PipelineStats& stats) {
  st.cut_chunks();
  // With train.accumulation_steps A the schedule runs A times, each round on the next m of
  // the step's A x m micro-batches; the gradients accumulate over the rounds and the other
  // strategies' hooks send them after the last round's last backward.
  const int rounds = st.spec->train.accumulation_steps;
  StepState state(step, st.opt.micro_batches * rounds);
  core::StepOutput& out = state.out;
  const auto t_begin = Clock::now();
  for (int round = 0; round < rounds; ++round) {
    Round r(st, state, round, round == rounds - 1);
    r.run();
  }
  for (auto& w : state.sends) {
    auto t0 = Clock::now();
    w->wait();
    state.wait_s += seconds(t0, Clock::now());
  }
  const auto t_end = Clock::now();
  stats.steps += 1;
  stats.busy_s += out.forward_s + out.backward_s;
  stats.wait_s += state.wait_s;
  stats.wall_s += seconds(t_begin, t_end);
  // The loss lives on the last stage; every pipeline rank reports it.
  at::Tensor loss = at::full({1}, out.loss, at::kDouble);
  st.broadcast_from_last(loss);
  out.loss = loss.item<double>();
  return out;
}

core::EvalSums run_evaluation(RankStages& st, const core::Batch& batch, bool bf16) {
  st.cut_chunks();
  // Forward only, through every stage in order; the batch goes in pieces so the stages
  // overlap (and no piece is larger than a training micro-batch needs to be).
  const int v = st.opt.virtual_stages;
  const int64_t n = batch.size();
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(n, st.opt.micro_batches));
  torch::NoGradGuard no_grad;
  double loss_sum = 0;
  int64_t correct = 0, predictions = 0;
  std::vector<WorkPtr> sends;
  std::vector<std::vector<at::Tensor>> outputs(v, std::vector<at::Tensor>(pieces));
  for (int c = 0; c < v; ++c) {
    for (int64_t j = 0; j < pieces; ++j) {
      const int64_t b = n * j / pieces, e = n * (j + 1) / pieces;
      at::Tensor x;
      if (st.first(c)) {
        x = batch.inputs.slice(0, b, e);
      } else if (st.prev_rank(c) != st.rank) {
        x = at::empty(st.input_of(c).shape(e - b), at::TensorOptions().dtype(st.input_of(c).dtype).device(st.device));
        collectives::RecvOptions o;
        o.timeout = st.timeout;
        const Link& link = st.act_link(st.prev_rank(c), st.rank);
        link.comm->recv(x, link.peer(), o)->wait();
      } else {
        x = std::move(outputs[st.prev_chunk(c)][j]);  // the previous stage is on this rank
      }
      at::Tensor y;
      {
        core::compat::Autocast autocast(bf16, x.device().type());
        y = st.chunks[c]->forward(x);
      }
      if (st.last(c)) {
        y = y.to(at::kFloat);
        at::Tensor t = batch.targets.slice(0, b, e);
        loss_sum += st.loss->loss(y, t).item<double>() * static_cast<double>(e - b);
        correct += st.loss->correct(y, t);
        predictions += t.numel();
      } else if (st.next_rank(c) != st.rank) {
        collectives::SendOptions o;
        o.timeout = st.timeout;
        const Link& link = st.act_link(st.rank, st.next_rank(c));
        sends.push_back(link.comm->send(y.contiguous(), link.peer(), o));
      } else {
        outputs[c][j] = y;
      }
    }
  }
  for (auto& w : sends) w->wait();
  at::Tensor sums = at::tensor({loss_sum, static_cast<double>(correct), static_cast<double>(predictions)}, at::kDouble);
  st.broadcast_from_last(sums);
  core::EvalSums r;
  r.loss_sum = sums[0].item<double>();
  r.correct = static_cast<int64_t>(sums[1].item<double>());
  r.predictions = static_cast<int64_t>(sums[2].item<double>());
  return r;
}

}  // namespace tetra::pipeline
