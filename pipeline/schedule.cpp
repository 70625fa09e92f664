#include "pipeline/schedule.h"

#include <algorithm>
#include <cmath>
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
      prefix = "B";
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
  static const std::vector<std::string> kinds = {"gpipe", "1f1b", "interleaved_1f1b"};
  return kinds;
}

namespace {

std::string plural(int n, const std::string& one, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

// The rank that holds global stage `stage` (Megatron-LM's round-robin assignment).
int rank_of(const Schedule& s, int stage) { return stage % s.stages; }
int chunk_of(const Schedule& s, int stage) { return stage / s.stages; }

// The transfers around each compute instruction. A receive goes right before the
// compute that consumes it and a send right after the compute that produces it: sends
// never block, so the latest receive is the one that waits least, and the lists are
// then deadlock-free exactly when the compute order is.
void emit_forward(const Schedule& s, int rank, int micro, int chunk, std::vector<Instr>& out) {
  const int stage = s.stage_of(rank, chunk);
  // A neighbour on the same rank (P = 1 with v > 1) is handed over locally.
  if (stage > 0 && rank_of(s, stage - 1) != rank) out.push_back({Op::kRecvAct, micro, chunk});
  out.push_back({Op::kForward, micro, chunk});
  if (stage < s.total_stages() - 1 && rank_of(s, stage + 1) != rank)
    out.push_back({Op::kSendAct, micro, chunk});
}

void emit_backward(const Schedule& s, int rank, int micro, int chunk, std::vector<Instr>& out) {
  const int stage = s.stage_of(rank, chunk);
  if (stage < s.total_stages() - 1 && rank_of(s, stage + 1) != rank)
    out.push_back({Op::kRecvGrad, micro, chunk});
  out.push_back({Op::kBackward, micro, chunk});
  if (stage > 0 && rank_of(s, stage - 1) != rank) out.push_back({Op::kSendGrad, micro, chunk});
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
  if (kind != "interleaved_1f1b" && virtual_stages != 1)
    return "schedule " + kind + " runs one virtual stage per rank, got virtual_stages " +
           std::to_string(virtual_stages) + "; set schedule: interleaved_1f1b for virtual stages";
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
  s.ranks.assign(stages, {});
  if (kind == "gpipe")
    make_gpipe(s);
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

// The state of one rank while simulating.
struct RankState {
  size_t pc = 0;
  double time = 0;
  int in_flight = 0;
  // Indexed by micro * v + chunk.
  std::vector<char> forward_done, backward_done, act_received, grad_received, act_sent, grad_sent;
};

enum class Step { kRan, kBlocked, kFailed };

class Simulator {
 public:
  Simulator(const Schedule& s, double fwd, double bwd) : s_(s), fwd_(fwd), bwd_(bwd) {}

  Simulation run() {
    const int P = s_.stages;
    if (P < 1 || s_.virtual_stages < 1 || s_.micro_batches < 0 ||
        static_cast<int>(s_.ranks.size()) != P) {
      sim_.error = "the schedule has " + std::to_string(s_.ranks.size()) +
                   " instruction lists for " + plural(P, "stage", "stages");
      return sim_;
    }
    const size_t units = static_cast<size_t>(s_.micro_batches) * s_.virtual_stages;
    state_.assign(P, {});
    for (auto& st : state_)
      for (auto* v : {&st.forward_done, &st.backward_done, &st.act_received, &st.grad_received,
                      &st.act_sent, &st.grad_sent})
        v->assign(units, 0);
    act_.assign(P, {});
    grad_.assign(P, {});
    sim_.busy.assign(P, 0);
    sim_.bubble.assign(P, 0);
    sim_.peak_in_flight.assign(P, 0);
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

  // Runs rank r's next instruction, or says why it cannot.
  Step step(int r) {
    RankState& st = state_[r];
    const Instr& in = s_.ranks[r][st.pc];
    const std::string label = to_string(in);
    if (in.micro < 0 || in.micro >= s_.micro_batches || in.chunk < 0 ||
        in.chunk >= s_.virtual_stages)
      return failed(r, label + " is outside " +
                           plural(s_.micro_batches, "micro-batch", "micro-batches") + " x " +
                           plural(s_.virtual_stages, "chunk", "chunks"));
    const size_t idx = static_cast<size_t>(in.micro) * s_.virtual_stages + in.chunk;
    const int stage = s_.stage_of(r, in.chunk);
    const bool first = stage == 0, last = stage == s_.total_stages() - 1;
    const int prev_rank = first ? -1 : rank_of(s_, stage - 1);
    const int next_rank = last ? -1 : rank_of(s_, stage + 1);

    switch (in.op) {
      case Op::kForward: {
        if (st.forward_done[idx]) return failed(r, "runs " + label + " twice");
        if (!first) {
          if (prev_rank == r) {
            const size_t prev =
                static_cast<size_t>(in.micro) * s_.virtual_stages + chunk_of(s_, stage - 1);
            if (!st.forward_done[prev])
              return failed(r, label + " runs before " +
                                   name(Op::kForward, in.micro, chunk_of(s_, stage - 1)) +
                                   ", whose output it takes");
          } else if (!st.act_received[idx]) {
            return failed(r, label + " runs before its input arrives (no " +
                                 name(Op::kRecvAct, in.micro, in.chunk) + " before it)");
          }
        }
        compute(r, in, fwd_);
        st.forward_done[idx] = 1;
        sim_.peak_in_flight[r] = std::max(sim_.peak_in_flight[r], ++st.in_flight);
        break;
      }
      case Op::kBackward: {
        if (st.backward_done[idx]) return failed(r, "runs " + label + " twice");
        if (!st.forward_done[idx])
          return failed(
              r, label + " runs before its forward " + name(Op::kForward, in.micro, in.chunk));
        if (!last) {
          if (next_rank == r) {
            const size_t next =
                static_cast<size_t>(in.micro) * s_.virtual_stages + chunk_of(s_, stage + 1);
            if (!st.backward_done[next])
              return failed(r, label + " runs before " +
                                   name(Op::kBackward, in.micro, chunk_of(s_, stage + 1)) +
                                   ", whose gradient it takes");
          } else if (!st.grad_received[idx]) {
            return failed(r, label + " runs before its output's gradient arrives (no " +
                                 name(Op::kRecvGrad, in.micro, in.chunk) + " before it)");
          }
        }
        compute(r, in, bwd_);
        st.backward_done[idx] = 1;
        --st.in_flight;
        break;
      }
      case Op::kSendAct: {
        if (last) return failed(r, label + " sends from the last stage");
        if (next_rank == r)
          return failed(r, label + " sends to a stage on the same rank (handed over locally)");
        if (st.act_sent[idx]) return failed(r, "sends " + label + " twice");
        if (!st.forward_done[idx])
          return failed(r, label + " sends before " + name(Op::kForward, in.micro, in.chunk) +
                               " computes it");
        st.act_sent[idx] = 1;
        act_[r].sent.push_back({in.micro, stage, st.time});
        break;
      }
      case Op::kSendGrad: {
        if (first) return failed(r, label + " sends from the first stage");
        if (prev_rank == r)
          return failed(r, label + " sends to a stage on the same rank (handed over locally)");
        if (st.grad_sent[idx]) return failed(r, "sends " + label + " twice");
        if (!st.backward_done[idx])
          return failed(r, label + " sends before " + name(Op::kBackward, in.micro, in.chunk) +
                               " computes it");
        st.grad_sent[idx] = 1;
        grad_[r].sent.push_back({in.micro, stage, st.time});
        break;
      }
      case Op::kRecvAct: {
        if (first) return failed(r, label + " receives on the first stage");
        if (prev_rank == r)
          return failed(r, label + " receives from a stage on the same rank (handed over locally)");
        if (st.act_received[idx]) return failed(r, "receives " + label + " twice");
        Channel& ch = act_[prev_rank];
        if (ch.received >= ch.sent.size()) return Step::kBlocked;
        const Message& msg = ch.sent[ch.received];
        if (msg.micro != in.micro || msg.stage != stage - 1)
          return out_of_order("activation", prev_rank, r, in, Op::kSendAct, msg);
        ++ch.received;
        st.time = std::max(st.time, msg.time);
        st.act_received[idx] = 1;
        break;
      }
      case Op::kRecvGrad: {
        if (last) return failed(r, label + " receives on the last stage");
        if (next_rank == r)
          return failed(r, label + " receives from a stage on the same rank (handed over locally)");
        if (st.grad_received[idx]) return failed(r, "receives " + label + " twice");
        Channel& ch = grad_[next_rank];
        if (ch.received >= ch.sent.size()) return Step::kBlocked;
        const Message& msg = ch.sent[ch.received];
        if (msg.micro != in.micro || msg.stage != stage + 1)
          return out_of_order("gradient", next_rank, r, in, Op::kSendGrad, msg);
        ++ch.received;
        st.time = std::max(st.time, msg.time);
        st.grad_received[idx] = 1;
        break;
      }
    }
    ++st.pc;
    return Step::kRan;
  }

  Step out_of_order(const char* channel, int from, int to, const Instr& recv, Op send_op,
                    const Message& msg) {
    std::ostringstream os;
    os << "out of order: on the " << channel << " channel rank " << from << " -> rank " << to
       << ", rank " << to << "'s " << to_string(recv) << " meets rank " << from << "'s "
       << name(send_op, msg.micro, chunk_of(s_, msg.stage))
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
          const size_t idx = static_cast<size_t>(i) * v + c;
          if (!state_[r].forward_done[idx]) {
            error_ = "rank " + std::to_string(r) + " never runs " + name(Op::kForward, i, c);
            return false;
          }
          if (!state_[r].backward_done[idx]) {
            error_ = "rank " + std::to_string(r) + " never runs " + name(Op::kBackward, i, c);
            return false;
          }
        }
    for (int r = 0; r < P; ++r) {
      for (auto [ch, op, other] : {std::tuple{&act_[r], Op::kSendAct, (r + 1) % P},
                                   std::tuple{&grad_[r], Op::kSendGrad, (r - 1 + P) % P}}) {
        if (ch->received < ch->sent.size()) {
          const Message& msg = ch->sent[ch->received];
          error_ = "rank " + std::to_string(r) + "'s " +
                   name(op, msg.micro, chunk_of(s_, msg.stage)) + " is never received by rank " +
                   std::to_string(other);
          return false;
        }
      }
    }
    return true;
  }

  const Schedule& s_;
  double fwd_, bwd_;
  Simulation sim_;
  std::string error_;
  std::vector<RankState> state_;
  std::vector<Channel> act_;   // act_[r]: rank r -> r+1
  std::vector<Channel> grad_;  // grad_[r]: rank r -> r-1
};

}  // namespace

Simulation simulate(const Schedule& s, double fwd_cost, double bwd_cost) {
  return Simulator(s, fwd_cost, bwd_cost).run();
}

double ideal_bubble(int stages, int micro_batches, int virtual_stages) {
  const double denom = static_cast<double>(virtual_stages) * micro_batches + stages - 1;
  return denom > 0 ? (stages - 1) / denom : 0.0;
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
    std::string l = (in.op == Op::kForward ? "F" : "B") + std::to_string(in.micro);
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
