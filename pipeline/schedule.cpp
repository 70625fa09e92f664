#include "pipeline/schedule.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>
#include <tuple>

#include "collectives/error.h"

namespace tetra::pipeline {

const char* to_string(Op op) {
  switch (op) {
    case Op::kForward:
      return "forward";
    case Op::kBackward:
      return "backward";
    case Op::kBackwardInput:
      return "backward_input";
    case Op::kBackwardWeight:
      return "backward_weight";
    case Op::kSendAct:
      return "send_act";
    case Op::kRecvAct:
      return "recv_act";
    case Op::kSendGrad:
      return "send_grad";
    case Op::kRecvGrad:
      return "recv_grad";
  }
  return "?";
}

std::string to_string(const Instr& in) {
  const char* prefix = "?";
  switch (in.op) {
    case Op::kForward:
      prefix = "F";
      break;
    case Op::kBackward:
    case Op::kBackwardInput:
      prefix = "B";
      break;
    case Op::kBackwardWeight:
      prefix = "W";
      break;
    case Op::kSendAct:
      prefix = "sendA";
      break;
    case Op::kRecvAct:
      prefix = "recvA";
      break;
    case Op::kSendGrad:
      prefix = "sendG";
      break;
    case Op::kRecvGrad:
      prefix = "recvG";
      break;
  }
  std::string s = prefix + std::to_string(in.micro);
  // Chunk 0 goes unsuffixed: to_string does not know v, and with v = 1 every chunk is 0.
  if (in.chunk != 0) s += "." + std::to_string(in.chunk);
  return s;
}

const std::vector<std::string>& schedule_kinds() {
  static const std::vector<std::string> kinds = {"gpipe", "1f1b", "interleaved_1f1b", "zbh1",
                                                 "zbv"};
  return kinds;
}

bool Schedule::split_backward() const { return kind == "zbh1" || kind == "zbv"; }

namespace {

std::string plural(int n, const std::string& one, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

// The transfers around each compute instruction. A receive goes right before the
// compute that consumes it and a send right after the compute that produces it: sends
// never block, so the latest receive is the one that waits least, and the lists are
// then deadlock-free exactly when the compute order is.
void emit_forward(const Schedule& s, int rank, int micro, int chunk, std::vector<Instr>& out) {
  const int stage = s.stage_of(rank, chunk);
  // A neighbour on the same rank (P = 1 with v > 1, the V's turn) is handed over locally.
  if (stage > 0 && s.rank_of(stage - 1) != rank) out.push_back({Op::kRecvAct, micro, chunk});
  out.push_back({Op::kForward, micro, chunk});
  if (stage < s.total_stages() - 1 && s.rank_of(stage + 1) != rank)
    out.push_back({Op::kSendAct, micro, chunk});
}

// `op` is kBackward or kBackwardInput: both produce the input's gradient. The W that
// completes a B has no transfers: it is pushed on its own.
void emit_backward(const Schedule& s, int rank, int micro, int chunk, std::vector<Instr>& out,
                   Op op = Op::kBackward) {
  const int stage = s.stage_of(rank, chunk);
  if (stage < s.total_stages() - 1 && s.rank_of(stage + 1) != rank)
    out.push_back({Op::kRecvGrad, micro, chunk});
  out.push_back({op, micro, chunk});
  if (stage > 0 && s.rank_of(stage - 1) != rank) out.push_back({Op::kSendGrad, micro, chunk});
}

void make_gpipe(Schedule& s) {
  for (int r = 0; r < s.stages; ++r) {
    for (int i = 0; i < s.micro_batches; ++i) emit_forward(s, r, i, 0, s.ranks[r]);
    for (int i = 0; i < s.micro_batches; ++i) emit_backward(s, r, i, 0, s.ranks[r]);
  }
}

void make_1f1b(Schedule& s) {
  const int P = s.stages, m = s.micro_batches;
  for (int r = 0; r < P; ++r) {
    auto& out = s.ranks[r];
    // Rank r warms up with as many forwards as there are stages after it, so its first
    // backward's gradient is on its way by the time its last warmup forward is done.
    const int warmup = std::min(P - r - 1, m);
    int f = 0, b = 0;
    for (; f < warmup; ++f) emit_forward(s, r, f, 0, out);
    for (; f < m; ++f, ++b) {
      emit_forward(s, r, f, 0, out);
      emit_backward(s, r, b, 0, out);
    }
    for (; b < m; ++b) emit_backward(s, r, b, 0, out);
  }
}

// Megatron-LM's interleaved schedule (forward_backward_pipelining_with_interleaving):
// units go round the chunks in groups of P micro-batches, forwards through chunks
// 0..v-1, backwards through v-1..0.
void make_interleaved(Schedule& s) {
  const int P = s.stages, m = s.micro_batches, v = s.virtual_stages;
  const int total = m * v;
  auto micro_of = [&](int k) { return (k / (P * v)) * P + k % P; };
  auto fwd_chunk = [&](int k) { return (k % (P * v)) / P; };
  auto bwd_chunk = [&](int k) { return v - 1 - (k % (P * v)) / P; };
  for (int r = 0; r < P; ++r) {
    auto& out = s.ranks[r];
    // Megatron runs everything as warmup when m == P (the steady state would be empty
    // of useful overlap and its formula would overrun the group of P).
    int warmup = (m == P) ? total : std::min((P - r - 1) * 2 + (v - 1) * P, total);
    int f = 0, b = 0;
    for (; f < warmup; ++f) emit_forward(s, r, micro_of(f), fwd_chunk(f), out);
    for (; f < total; ++f, ++b) {
      emit_forward(s, r, micro_of(f), fwd_chunk(f), out);
      emit_backward(s, r, micro_of(b), bwd_chunk(b), out);
    }
    for (; b < total; ++b) emit_backward(s, r, micro_of(b), bwd_chunk(b), out);
  }
}

// Note [ZB-H1]
// ZB-H1 (Qi et al. 2024, section 2.1) is 1F1B with each backward split into B and W
// (Note [Split backward]): the same warmup of min(P-r-1, m) forwards and the same order
// of forwards and B's, so the same activations in flight on every rank. Only the B's
// carry a micro-batch's gradient up the pipeline, so with forward = B = W = T it climbs
// one T per stage instead of 1F1B's 2T, and rank 0's first B starts at (2P-1)T instead
// of (3P-2)T. Rank r holds back its first r W's (after its k-th B it runs the W of the
// (k-r)-th) and so still has r+1 W's to run after its last B, the time the B's of that
// micro-batch take to go up to rank 0; rank 0 runs every W right after its B. Each rank
// then idles (P-1)T per step, r before its first forward and P-1-r waiting for its first
// gradient, instead of 1F1B's 3(P-1)T; for m >= P the step takes (3m + P-1)T (with
// m < P the warmup has no steady state to hide in and it takes longer, still less than
// 1F1B). The W's held back keep at most min(r+1, m) B's weight-gradient inputs on rank
// r (Simulation::peak_weight_pending). When r+1 are held a B has just run, so at most
// P-r-1 activations are: no rank holds more at once than rank 0 does in 1F1B (P
// activations), a W's inputs being a part of a forward's activations.
void make_zbh1(Schedule& s) {
  const int P = s.stages, m = s.micro_batches;
  for (int r = 0; r < P; ++r) {
    auto& out = s.ranks[r];
    const int warmup = std::min(P - r - 1, m);
    int f = 0, b = 0, w = 0;
    auto backward = [&] {
      emit_backward(s, r, b++, 0, out, Op::kBackwardInput);
      if (b - w > r) out.push_back({Op::kBackwardWeight, w++, 0});
    };
    for (; f < warmup; ++f) emit_forward(s, r, f, 0, out);
    for (; f < m; ++f) {
      emit_forward(s, r, f, 0, out);
      backward();
    }
    while (b < m) backward();
    while (w < m) out.push_back({Op::kBackwardWeight, w++, 0});
  }
}

// Note [ZB-V]
// ZB-V (Qi et al. 2024, section 6) cuts the model into 2P stages placed in a V
// (Placement::kV): a micro-batch goes down the ranks through chunk 0 and back up through
// chunk 1, so rank 0 computes the loss, and its gradient goes down through chunk 1 and
// back up through chunk 0. Rank r's list, c0 and c1 being its chunks:
//   warmup:   2(P-r)-1 forwards of c0, then r pairs (F c1, F c0): what rank r can run
//             before the first gradient reaches its c1; every rank holds 2P-1
//             micro-batches' activations by then;
//   P-r times (F c1, B c1, W c1): no c0 gradient has come back yet, so the W's run at
//             once;
//   steady:   (F c0, B c0, W c0, F c1, B c1, W c1) until the forwards are done: one
//             forward per B, so at most 2P (micro, chunk) activations in flight, on every
//             rank: 1F1B's memory, each chunk being half a stage;
//   cooldown: r pairs (B c0, B c1) and P-r pairs (B c0, W c0), B's first as they are
//             on the critical path, then the W's left over (up to 2r+1 held on rank r).
// With forward = B = W = T and m >= 2P-1, rank r runs without a gap from its first
// forward, r T after the step starts (the first micro-batch's way down), to its last W,
// P-1-r T before the step ends: (6m + P-1)T, a bubble of (P-1)/(6m+P-1). The paper
// gives ZB-V a bubble of 0 for T_F = T_B = T_W (bubble rate, idle over work: 0, against
// 1F1B's (P-1)/m and ZB-H1's (P-1)/(3m)): it counts each rank from its own first
// instruction, as with its optimizer post-validation no all-rank sync ends the step and
// a rank starts the next step as it ends this one. A step on its own still pays for the
// fill. With m < 2P-1 the warmup asks for more micro-batches than there are: the
// list is the one for 2P-1 with the missing micro-batches left out, which keeps every
// dependency (a micro-batch only waits for itself) and the order of the rest (as
// PyTorch's ScheduleZBVZeroBubble does); the fill then costs more.
void make_zbv(Schedule& s) {
  const int P = s.stages, m = s.micro_batches;
  const int n = std::max(m, 2 * P - 1);
  for (int r = 0; r < P; ++r) {
    auto& out = s.ranks[r];
    int f[2] = {0, 0}, b[2] = {0, 0}, w[2] = {0, 0};  // next micro-batch per chunk
    auto forward = [&](int c) {
      if (f[c] < m) emit_forward(s, r, f[c], c, out);
      ++f[c];
    };
    auto input = [&](int c) {
      if (b[c] < m) emit_backward(s, r, b[c], c, out, Op::kBackwardInput);
      ++b[c];
    };
    auto weight = [&](int c) {
      if (w[c] < m) out.push_back({Op::kBackwardWeight, w[c], c});
      ++w[c];
    };
    for (int i = 0; i < 2 * (P - r) - 1; ++i) forward(0);
    for (int i = 0; i < r; ++i) forward(1), forward(0);
    for (int i = 0; i < P - r; ++i) forward(1), input(1), weight(1);
    while (f[1] < f[0] || f[0] < n) {
      if (f[0] < n) forward(0);
      input(0), weight(0), forward(1), input(1), weight(1);
    }
    for (int i = 0; i < r; ++i) input(0), input(1);
    for (int i = 0; i < P - r; ++i) input(0), weight(0);
    while (w[1] < b[1]) weight(1);
    while (w[0] < b[0]) weight(0);
  }
}

}  // namespace

std::string schedule_problem(const std::string& kind, int stages, int micro_batches,
                             int virtual_stages) {
  const auto& kinds = schedule_kinds();
  if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) {
    std::string known;
    for (const auto& k : kinds) known += (known.empty() ? "" : ", ") + k;
    return "schedule \"" + kind + "\" is not known (schedules: " + known + ")";
  }
  if (stages < 1) return "the pipeline needs at least 1 stage, got " + std::to_string(stages);
  if (micro_batches < 1)
    return "the pipeline needs at least 1 micro-batch, got " + std::to_string(micro_batches);
  if (virtual_stages < 1)
    return "the pipeline needs at least 1 virtual stage per rank, got " +
           std::to_string(virtual_stages);
  if (kind == "zbv" && virtual_stages != 2)
    return "zbv runs two virtual stages per rank (a V), got virtual_stages " +
           std::to_string(virtual_stages);
  if (kind != "interleaved_1f1b" && kind != "zbv" && virtual_stages != 1)
    return "schedule " + kind + " runs one virtual stage per rank, got virtual_stages " +
           std::to_string(virtual_stages) + "; set schedule: " +
           (kind == "zbh1" ? "zbv for two virtual stages" : "interleaved_1f1b for virtual stages");
  if (kind == "interleaved_1f1b" && virtual_stages > 1 && micro_batches % stages != 0)
    return "interleaved_1f1b needs micro_batches to be a multiple of the " +
           std::to_string(stages) + " pipeline stages, got " + std::to_string(micro_batches);
  return "";
}

Schedule make_schedule(const std::string& kind, int stages, int micro_batches, int virtual_stages) {
  std::string problem = schedule_problem(kind, stages, micro_batches, virtual_stages);
  if (!problem.empty()) throw ConfigError(problem);
  Schedule s;
  s.kind = kind;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.virtual_stages = virtual_stages;
  s.placement = kind == "zbv" ? Placement::kV : Placement::kLoop;
  s.ranks.assign(stages, {});
  if (kind == "gpipe")
    make_gpipe(s);
  else if (kind == "zbh1")
    make_zbh1(s);
  else if (kind == "zbv")
    make_zbv(s);
  else if (kind == "1f1b" || virtual_stages == 1)
    // Megatron's interleaved warmup with one chunk would be (P-r-1)*2, more than 1F1B
    // needs; with v = 1 interleaving is 1F1B, so it gets 1F1B's lists exactly.
    make_1f1b(s);
  else
    make_interleaved(s);
  return s;
}

namespace {

// One message in a channel: the sending stage and micro-batch, and when it is there.
struct Message {
  int micro = 0;
  int stage = 0;
  double time = 0;
};

struct Channel {
  std::vector<Message> sent;
  size_t received = 0;  // how many of `sent` the receiver has taken, in order
};

// What a channel carries; part of its key, and the order check_complete reports in.
enum Carries { kActivations = 0, kGradients = 1 };
// (from rank, what, to rank).
using ChannelKey = std::tuple<int, int, int>;

// The state of one rank while simulating.
struct RankState {
  size_t pc = 0;
  double time = 0;
  int in_flight = 0;       // forwards whose B (or fused backward) is still to run
  int weight_pending = 0;  // B's whose W is still to run
  // Indexed by micro * v + chunk. backward_done: the fused kBackward; input_done: B;
  // weight_done: W.
  std::vector<char> forward_done, backward_done, input_done, weight_done, act_received,
      grad_received, act_sent, grad_sent;
  // Whether the unit's input gradient is computed (by either kind of backward).
  bool grad_done(size_t idx) const { return backward_done[idx] || input_done[idx]; }
  // Sends posted but not yet left (Costs::progress_when_waiting), in order.
  std::vector<std::pair<ChannelKey, Message>> unsent;
};

enum class Step { kRan, kBlocked, kFailed };

class Simulator {
 public:
  Simulator(const Schedule& s, const Costs& costs) : s_(s), costs_(costs) {}

  Simulation run() {
    const int P = s_.stages;
    if (P < 1 || s_.virtual_stages < 1 || s_.micro_batches < 0 ||
        static_cast<int>(s_.ranks.size()) != P) {
      sim_.error = "the schedule has " + std::to_string(s_.ranks.size()) +
                   " instruction lists for " + plural(P, "stage", "stages");
      return sim_;
    }
    if (s_.placement == Placement::kV && s_.virtual_stages != 2) {
      sim_.error = "a V placement takes 2 virtual stages, the schedule has " +
                   std::to_string(s_.virtual_stages);
      return sim_;
    }
    const size_t units = static_cast<size_t>(s_.micro_batches) * s_.virtual_stages;
    state_.assign(P, {});
    for (auto& st : state_)
      for (auto* v : {&st.forward_done, &st.backward_done, &st.input_done, &st.weight_done,
                      &st.act_received, &st.grad_received, &st.act_sent, &st.grad_sent})
        v->assign(units, 0);
    channels_.clear();
    sim_.busy.assign(P, 0);
    sim_.bubble.assign(P, 0);
    sim_.peak_in_flight.assign(P, 0);
    sim_.peak_weight_pending.assign(P, 0);
    sim_.timeline.assign(P, {});

    // Each pass runs every rank until it blocks. The result does not depend on the order
    // ranks are visited: a message's time is fixed by its sender, a rank's clock only by
    // its own instructions and the messages it waits for.
    for (;;) {
      bool progress = false, unfinished = false;
      for (int r = 0; r < P; ++r) {
        for (;;) {
          if (state_[r].pc >= s_.ranks[r].size()) break;
          Step st = step(r);
          if (st == Step::kFailed) return fail();
          if (st == Step::kBlocked) break;
          progress = true;
        }
        if (state_[r].pc < s_.ranks[r].size()) unfinished = true;
      }
      if (!unfinished) break;
      if (!progress) {
        std::string e = "deadlock:";
        bool first = true;
        for (int r = 0; r < P; ++r) {
          if (state_[r].pc >= s_.ranks[r].size()) continue;
          e += std::string(first ? " " : ", ") + "rank " + std::to_string(r) + " waits at " +
               to_string(s_.ranks[r][state_[r].pc]);
          first = false;
        }
        error_ = e;
        return fail();
      }
    }
    if (!check_complete()) return fail();

    for (int r = 0; r < P; ++r) sim_.makespan = std::max(sim_.makespan, state_[r].time);
    double total_busy = 0;
    for (int r = 0; r < P; ++r) {
      total_busy += sim_.busy[r];
      sim_.bubble[r] = sim_.makespan > 0 ? 1.0 - sim_.busy[r] / sim_.makespan : 0.0;
    }
    sim_.bubble_fraction = sim_.makespan > 0 ? 1.0 - total_busy / (P * sim_.makespan) : 0.0;
    sim_.ok = true;
    return sim_;
  }

 private:
  Simulation fail() {
    Simulation out;
    out.ok = false;
    out.error = error_;
    return out;
  }

  Step failed(int r, const std::string& what) {
    error_ = "rank " + std::to_string(r) + ": " + what;
    return Step::kFailed;
  }

  std::string name(Op op, int micro, int chunk) const { return to_string(Instr{op, micro, chunk}); }

  size_t index(int micro, int chunk) const {
    return static_cast<size_t>(micro) * s_.virtual_stages + chunk;
  }

  // Created on first use: a channel that no one sends on is empty, and never checked.
  Channel& channel(int from, Carries what, int to) { return channels_[{from, what, to}]; }

  // A backward (fused or B) of `in` needs its forward and its output's gradient: from
  // the next stage's message, or, when that stage is on this rank, its backward done.
  Step check_backward_inputs(int r, const Instr& in, const std::string& label) {
    const RankState& st = state_[r];
    const int stage = s_.stage_of(r, in.chunk);
    if (!st.forward_done[index(in.micro, in.chunk)])
      return failed(r,
                    label + " runs before its forward " + name(Op::kForward, in.micro, in.chunk));
    if (stage == s_.total_stages() - 1) return Step::kRan;
    if (s_.rank_of(stage + 1) == r) {
      const int next = s_.chunk_of(stage + 1);
      if (!st.grad_done(index(in.micro, next)))
        return failed(r, label + " runs before " + name(Op::kBackward, in.micro, next) +
                             ", whose gradient it takes");
    } else if (!st.grad_received[index(in.micro, in.chunk)]) {
      return failed(r, label + " runs before its output's gradient arrives (no " +
                           name(Op::kRecvGrad, in.micro, in.chunk) + " before it)");
    }
    return Step::kRan;
  }

  Step mixed(int r, const Instr& in) {
    return failed(r, "micro-batch " + std::to_string(in.micro) + " of chunk " +
                         std::to_string(in.chunk) +
                         " runs both a fused backward and a split B/W (one or the other)");
  }

  // Where rank r's next instruction runs: what each kind's handler below checks against.
  struct At {
    int r;
    const Instr& in;
    const std::string& label;  // to_string(in), for the messages
    size_t idx;                // index(in.micro, in.chunk)
    int stage;
    bool first, last;          // the first or the last of the P*v stages
    int prev_rank, next_rank;  // the neighbouring stages' ranks (-1: none)
  };

  // Runs rank r's next instruction, or says why it cannot: the checks every kind shares,
  // then the kind's own (one handler each, Note [Schedules as data] lists what they check).
  Step step(int r) {
    RankState& st = state_[r];
    const Instr& in = s_.ranks[r][st.pc];
    const std::string label = to_string(in);
    if (in.micro < 0 || in.micro >= s_.micro_batches || in.chunk < 0 ||
        in.chunk >= s_.virtual_stages)
      return failed(r, label + " is outside " +
                           plural(s_.micro_batches, "micro-batch", "micro-batches") + " x " +
                           plural(s_.virtual_stages, "chunk", "chunks"));
    const int stage = s_.stage_of(r, in.chunk);
    const bool first = stage == 0, last = stage == s_.total_stages() - 1;
    const At at{r, in, label, index(in.micro, in.chunk), stage, first, last,
                first ? -1 : s_.rank_of(stage - 1), last ? -1 : s_.rank_of(stage + 1)};

    Step done = Step::kRan;
    switch (in.op) {
      case Op::kForward: done = forward(at); break;
      case Op::kBackward:
      case Op::kBackwardInput: done = backward(at); break;
      case Op::kBackwardWeight: done = backward_weight(at); break;
      case Op::kSendAct: done = send_act(at); break;
      case Op::kSendGrad: done = send_grad(at); break;
      case Op::kRecvAct: done = recv_act(at); break;
      case Op::kRecvGrad: done = recv_grad(at); break;
    }
    if (done != Step::kRan) return done;
    ++st.pc;
    if (st.pc == s_.ranks[r].size()) leave(r);  // the step's end
    return Step::kRan;
  }

  Step forward(const At& at) {
    RankState& st = state_[at.r];
    const Instr& in = at.in;
    if (st.forward_done[at.idx]) return failed(at.r, "runs " + at.label + " twice");
    if (!at.first) {
      if (at.prev_rank == at.r) {
        const int prev = s_.chunk_of(at.stage - 1);
        if (!st.forward_done[index(in.micro, prev)])
          return failed(at.r, at.label + " runs before " + name(Op::kForward, in.micro, prev) +
                                  ", whose output it takes");
      } else if (!st.act_received[at.idx]) {
        return failed(at.r, at.label + " runs before its input arrives (no " +
                                name(Op::kRecvAct, in.micro, in.chunk) + " before it)");
      }
    }
    compute(at.r, in, costs_.forward);
    st.forward_done[at.idx] = 1;
    sim_.peak_in_flight[at.r] = std::max(sim_.peak_in_flight[at.r], ++st.in_flight);
    return Step::kRan;
  }

  // A fused backward (kBackward) or a B (kBackwardInput).
  Step backward(const At& at) {
    RankState& st = state_[at.r];
    const Instr& in = at.in;
    const bool fused = in.op == Op::kBackward;
    if (fused ? st.backward_done[at.idx] : st.input_done[at.idx])
      return failed(at.r, "runs " + at.label + " twice");
    if (fused ? st.input_done[at.idx] : st.backward_done[at.idx]) return mixed(at.r, in);
    if (check_backward_inputs(at.r, in, at.label) == Step::kFailed) return Step::kFailed;
    if (fused) {
      compute(at.r, in, costs_.input + costs_.weight);
      st.backward_done[at.idx] = 1;
    } else {
      compute(at.r, in, costs_.input);
      st.input_done[at.idx] = 1;
      sim_.peak_weight_pending[at.r] =
          std::max(sim_.peak_weight_pending[at.r], ++st.weight_pending);
    }
    --st.in_flight;
    return Step::kRan;
  }

  Step backward_weight(const At& at) {
    RankState& st = state_[at.r];
    const Instr& in = at.in;
    if (st.weight_done[at.idx]) return failed(at.r, "runs " + at.label + " twice");
    if (st.backward_done[at.idx]) return mixed(at.r, in);
    if (!st.input_done[at.idx])
      return failed(at.r,
                    at.label + " runs before its " + name(Op::kBackwardInput, in.micro, in.chunk));
    compute(at.r, in, costs_.weight);
    st.weight_done[at.idx] = 1;
    --st.weight_pending;
    return Step::kRan;
  }

  Step send_act(const At& at) {
    RankState& st = state_[at.r];
    const Instr& in = at.in;
    if (at.last) return failed(at.r, at.label + " sends from the last stage");
    if (at.next_rank == at.r)
      return failed(at.r, at.label + " sends to a stage on the same rank (handed over locally)");
    if (st.act_sent[at.idx]) return failed(at.r, "sends " + at.label + " twice");
    if (!st.forward_done[at.idx])
      return failed(at.r, at.label + " sends before " + name(Op::kForward, in.micro, in.chunk) +
                              " computes it");
    st.act_sent[at.idx] = 1;
    post(at.r, {at.r, kActivations, at.next_rank}, {in.micro, at.stage, 0});
    return Step::kRan;
  }

  Step send_grad(const At& at) {
    RankState& st = state_[at.r];
    const Instr& in = at.in;
    if (at.first) return failed(at.r, at.label + " sends from the first stage");
    if (at.prev_rank == at.r)
      return failed(at.r, at.label + " sends to a stage on the same rank (handed over locally)");
    if (st.grad_sent[at.idx]) return failed(at.r, "sends " + at.label + " twice");
    if (!st.grad_done(at.idx))
      return failed(at.r, at.label + " sends before " + name(Op::kBackward, in.micro, in.chunk) +
                              " computes it");
    st.grad_sent[at.idx] = 1;
    post(at.r, {at.r, kGradients, at.prev_rank}, {in.micro, at.stage, 0});
    return Step::kRan;
  }

  Step recv_act(const At& at) {
    return receive(at, at.first, "receives on the first stage", at.prev_rank, kActivations,
                   state_[at.r].act_received, "activation", at.stage - 1, Op::kSendAct);
  }

  Step recv_grad(const At& at) {
    return receive(at, at.last, "receives on the last stage", at.next_rank, kGradients, state_[at.r].grad_received,
                   "gradient", at.stage + 1, Op::kSendGrad);
  }

  // A receive of an activation (from the stage before) or a gradient (from the stage
  // after): checked, then blocked until its message is there, or taken in order.
  Step receive(const At& at, bool no_peer, const char* why_no_peer, int from, Carries kind, std::vector<char>& received,
               const char* what, int from_stage, Op send_op) {
    if (no_peer) return failed(at.r, at.label + " " + why_no_peer);
    if (from == at.r) return failed(at.r, at.label + " receives from a stage on the same rank (handed over locally)");
    if (received[at.idx]) return failed(at.r, "receives " + at.label + " twice");
    Channel& ch = channel(from, kind, at.r);
    if (ch.received >= ch.sent.size()) {
      leave(at.r);  // the rank idles from now
      return Step::kBlocked;
    }
    const Message& msg = ch.sent[ch.received];
    if (msg.micro != at.in.micro || msg.stage != from_stage) return out_of_order(what, from, at.r, at.in, send_op, msg);
    take(at.r, ch);
    received[at.idx] = 1;
    return Step::kRan;
  }

  // Rank r takes the channel's next message, in order: its clock moves to the message's
  // arrival when that is later (and it waits, its posted sends leaving, from now).
  void take(int r, Channel& ch) {
    RankState& st = state_[r];
    const Message& msg = ch.sent[ch.received];
    ++ch.received;
    const double ready = arrival(msg, st.time);
    if (ready > st.time) leave(r);
    st.time = std::max(st.time, ready);
  }

  // A send posted by rank r: it leaves now, or (Costs::progress_when_waiting) when r
  // next waits. A channel's message holds the time it left.
  void post(int r, const ChannelKey& key, Message msg) {
    msg.time = state_[r].time;
    if (costs_.progress_when_waiting)
      state_[r].unsent.push_back({key, msg});
    else
      channels_[key].sent.push_back(msg);
  }

  // Rank r waits from its time on: the sends it has posted leave.
  void leave(int r) {
    RankState& st = state_[r];
    for (auto& [key, msg] : st.unsent) {
      msg.time = st.time;
      channels_[key].sent.push_back(msg);
    }
    st.unsent.clear();
  }

  // When a message that left is ready for a receiver that waits for it from `waiting`.
  double arrival(const Message& msg, double waiting) const {
    return (costs_.progress_when_waiting ? std::max(msg.time, waiting) : msg.time) + costs_.transfer;
  }

  Step out_of_order(const char* channel, int from, int to, const Instr& recv, Op send_op,
                    const Message& msg) {
    std::ostringstream os;
    os << "out of order: on the " << channel << " channel rank " << from << " -> rank " << to
       << ", rank " << to << "'s " << to_string(recv) << " meets rank " << from << "'s "
       << name(send_op, msg.micro, s_.chunk_of(msg.stage))
       << " (receives must come in the order of the sends)";
    error_ = os.str();
    return Step::kFailed;
  }

  void compute(int r, const Instr& in, double cost) {
    RankState& st = state_[r];
    sim_.timeline[r].push_back({st.time, st.time + cost, in});
    st.time += cost;
    sim_.busy[r] += cost;
  }

  bool check_complete() {
    const int P = s_.stages, v = s_.virtual_stages;
    for (int r = 0; r < P; ++r)
      for (int i = 0; i < s_.micro_batches; ++i)
        for (int c = 0; c < v; ++c) {
          const RankState& st = state_[r];
          const size_t idx = index(i, c);
          auto never = [&](Op op) {
            error_ = "rank " + std::to_string(r) + " never runs " + name(op, i, c);
            return false;
          };
          // Every forward, and its fused backward or its B and W (step() has checked
          // that a W follows its B, so a unit with neither lacks the B).
          if (!st.forward_done[idx]) return never(Op::kForward);
          if (!st.grad_done(idx)) return never(Op::kBackward);
          if (st.input_done[idx] && !st.weight_done[idx]) return never(Op::kBackwardWeight);
        }
    // In (from, what, to) order: for 1F1B each rank's activations, then its gradients.
    for (const auto& [key, ch] : channels_) {
      if (ch.received >= ch.sent.size()) continue;
      const auto [from, what, to] = key;
      const Message& msg = ch.sent[ch.received];
      error_ = "rank " + std::to_string(from) + "'s " +
               name(what == kActivations ? Op::kSendAct : Op::kSendGrad, msg.micro,
                    s_.chunk_of(msg.stage)) +
               " is never received by rank " + std::to_string(to);
      return false;
    }
    return true;
  }

  const Schedule& s_;
  Costs costs_;
  Simulation sim_;
  std::string error_;
  std::vector<RankState> state_;
  std::map<ChannelKey, Channel> channels_;
};

}  // namespace

Simulation simulate(const Schedule& s, const Costs& c) { return Simulator(s, c).run(); }

Simulation simulate(const Schedule& s, double fwd_cost, double bwd_cost) {
  return simulate(s, Costs{fwd_cost, bwd_cost / 2, bwd_cost / 2});
}

double ideal_bubble(int stages, int micro_batches, int virtual_stages) {
  const double denom = static_cast<double>(virtual_stages) * micro_batches + stages - 1;
  return denom > 0 ? (stages - 1) / denom : 0.0;
}

// With forward = B = W = T every rank idles the same (P-1) u per step (Notes [ZB-H1],
// [ZB-V]; the fused ones: the fill and drain of 1F1B), u being a forward and a whole
// backward of one chunk (3T) for the fused schedules and a forward (T) for the split
// ones, besides its work of 3T per (micro, chunk): the bubble is (P-1) / (work/u + P-1).
double ideal_bubble(const std::string& kind, int stages, int micro_batches, int virtual_stages) {
  const double P = stages, m = micro_batches;
  double work = 0;  // in units u
  if (kind == "gpipe" || kind == "1f1b")
    work = m;
  else if (kind == "interleaved_1f1b")
    work = virtual_stages * m;
  else if (kind == "zbh1")
    work = 3 * m;
  else if (kind == "zbv")
    work = 6 * m;
  else
    throw ConfigError(schedule_problem(kind, stages, micro_batches, virtual_stages));
  return work + P - 1 > 0 ? (P - 1) / (work + P - 1) : 0.0;
}

std::string bubble_formula(const std::string& kind) {
  if (kind == "gpipe" || kind == "1f1b") return "(P-1)/(m+P-1)";
  if (kind == "interleaved_1f1b") return "(P-1)/(vm+P-1)";
  if (kind == "zbh1") return "(P-1)/(3m+P-1)";
  if (kind == "zbv") return "(P-1)/(6m+P-1)";
  throw ConfigError(schedule_problem(kind, 1, 1, 1));
}

std::string draw(const Schedule& s, const Simulation& sim, int max_columns) {
  if (!sim.ok) return sim.error;
  // One column per forward: the unit is the simulated forward cost, read back from the
  // timeline since the simulation does not keep its costs.
  double unit = 0;
  for (const auto& row : sim.timeline)
    for (const auto& slot : row)
      if (slot.instr.op == Op::kForward && slot.end > slot.start) {
        unit = slot.end - slot.start;
        break;
      }
  if (unit <= 0) unit = 1;
  const int columns = static_cast<int>(std::lround(sim.makespan / unit));
  const int shown = std::max(0, std::min(columns, max_columns));

  auto label = [&](const Instr& in) {
    const char* op = in.op == Op::kForward ? "F" : in.op == Op::kBackwardWeight ? "W" : "B";
    std::string l = op + std::to_string(in.micro);
    if (s.virtual_stages > 1) l += "." + std::to_string(in.chunk);
    return l;
  };
  // Width over the whole drawing, so columns line up from rank to rank.
  size_t width = 2;  // ".."
  for (const auto& row : sim.timeline)
    for (const auto& slot : row) width = std::max(width, label(slot.instr).size());

  const std::string last_rank = std::to_string(static_cast<int>(sim.timeline.size()) - 1);
  std::string out;
  for (size_t r = 0; r < sim.timeline.size(); ++r) {
    std::vector<std::string> cells(shown, "..");
    for (const auto& slot : sim.timeline[r]) {
      const long from = std::lround(slot.start / unit), to = std::lround(slot.end / unit);
      for (long c = from; c < to && c < shown; ++c)
        if (c >= 0) cells[c] = label(slot.instr);
    }
    std::string rank = std::to_string(r);
    out += "rank " + rank + std::string(last_rank.size() - rank.size(), ' ') + " |";
    for (auto& cell : cells) out += " " + cell + std::string(width - cell.size(), ' ');
    if (columns > shown) out += " …";
    out += " |\n";
  }
  return out;
}

}  // namespace tetra::pipeline
