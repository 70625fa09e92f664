// Pipeline schedules as data (GPipe, 1F1B, interleaved 1F1B) and the simulator that
// checks them.
//
// Note [Schedules as data]
// A schedule is, for each pipeline rank, the list of instructions that rank runs in
// order: forward micro-batch i of chunk c, backward i of c, and the point-to-point
// transfers between neighbouring stages. One executor (executor.h) runs any list; the
// generators below are the only place that knows GPipe from 1F1B. Nothing here touches
// torch, so every schedule can be generated, simulated and drawn in microseconds — by
// the tests for every (stages, micro-batches, virtual stages) and by `train --dry-run`.
//
// Stages. With P ranks and v virtual stages (chunks) per rank, the model is cut into
// P*v consecutive stages; rank r holds stages r, r+P, r+2P, ... (Megatron-LM's
// interleaved assignment), chunk c of rank r being stage c*P + r. With v = 1 rank r
// holds stage r. Stage s sends its output to stage s+1 (on rank (r+1) mod P) and
// receives its output's gradient back from it.
//
// Channels and order. Every directed neighbour pair has two channels: activations
// (rank r -> r+1 mod P) and gradients (r+1 -> r). A send never blocks the sending
// rank's instruction stream; a receive blocks until its message arrives. Each channel
// delivers in order and the executor matches messages by order, so a schedule is valid
// only when, on every channel, the receiver's receives come in the same order as the
// sender's sends. The simulator checks that, each dependency (a forward after its
// input, a backward after its forward and its output gradient, every forward and
// backward exactly once) and that the lists cannot deadlock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tetra::pipeline {

enum class Op {
  kForward,   // run chunk's layers on micro-batch's input
  kBackward,  // backward of that forward (recomputing it first under checkpointing)
  kSendAct,   // send chunk's output for micro-batch to the next stage
  kRecvAct,   // receive chunk's input for micro-batch from the previous stage
  kSendGrad,  // send the gradient of chunk's input to the previous stage
  kRecvGrad,  // receive the gradient of chunk's output from the next stage
};
const char* to_string(Op op);

struct Instr {
  Op op;
  int micro = 0;  // micro-batch index, 0 .. m-1
  int chunk = 0;  // virtual stage on this rank, 0 .. v-1 (global stage chunk*P + rank)
  bool operator==(const Instr& o) const { return op == o.op && micro == o.micro && chunk == o.chunk; }
};
// "F3", "B3", "F3.1" (chunk 1), "sendA3", "recvG3.1".
std::string to_string(const Instr& in);

struct Schedule {
  std::string kind;  // gpipe | 1f1b | interleaved_1f1b
  int stages = 1;          // P: pipeline ranks
  int micro_batches = 1;   // m
  int virtual_stages = 1;  // v: chunks per rank
  std::vector<std::vector<Instr>> ranks;  // ranks[r]: rank r's instructions in order

  int total_stages() const { return stages * virtual_stages; }
  int stage_of(int rank, int chunk) const { return chunk * stages + rank; }
  bool first_stage(int rank, int chunk) const { return stage_of(rank, chunk) == 0; }
  bool last_stage(int rank, int chunk) const { return stage_of(rank, chunk) == total_stages() - 1; }
};

// The schedule kinds, in the order the job spec lists them.
const std::vector<std::string>& schedule_kinds();

// Why (kind, P, m, v) cannot be scheduled, or "" when it can. The rules:
//   P >= 1, m >= 1, v >= 1;
//   gpipe and 1f1b take v = 1 (set schedule: interleaved_1f1b for virtual stages);
//   interleaved_1f1b with v > 1 needs m to be a multiple of P (micro-batches go
//   round the ranks in groups of P, as in Megatron-LM).
// 1F1B with m < P is valid (every rank warms up with all m forwards: GPipe's order).
std::string schedule_problem(const std::string& kind, int stages, int micro_batches, int virtual_stages);

// Generates the schedule; throws tetra::ConfigError with schedule_problem()'s text
// when it cannot be scheduled.
//   gpipe:  all forwards 0..m-1, then all backwards 0..m-1.
//   1f1b:   (PipeDream-Flush) rank r warms up with min(P-r-1, m) forwards, then
//           alternates one forward and one backward, then drains the backwards: at
//           most P-r micro-batches in flight instead of m.
//   interleaved_1f1b: Megatron-LM's interleaved schedule over v chunks per rank.
Schedule make_schedule(const std::string& kind, int stages, int micro_batches, int virtual_stages = 1);

// What the simulator found.
struct Simulation {
  bool ok = false;
  std::string error;  // the first problem: a deadlock (each rank's blocked instruction),
                      // an out-of-order channel, a missing or repeated forward/backward
  // Timing with forward = fwd_cost and backward = bwd_cost per chunk and free transfers.
  double makespan = 0;                 // time of the last instruction
  std::vector<double> busy;            // per rank: time spent in forward/backward
  std::vector<double> bubble;          // per rank: 1 - busy / makespan
  double bubble_fraction = 0;          // over all ranks: 1 - sum(busy) / (P * makespan)
  std::vector<int> peak_in_flight;     // per rank: most (micro, chunk) forwards whose backward
                                       // has not run yet (the activations it holds)
  // Per rank, the compute slots in time order: {start, end, instr} (for drawing).
  struct Slot {
    double start = 0, end = 0;
    Instr instr;
  };
  std::vector<std::vector<Slot>> timeline;
};

// Runs the schedule as the executor would (sends buffered, receives blocking, channels
// in order) and checks it. Never throws for a bad schedule: the result says why.
Simulation simulate(const Schedule& s, double fwd_cost = 1.0, double bwd_cost = 2.0);

// The theoretical bubble of GPipe and 1F1B: (P-1) / (m+P-1); interleaving divides the
// P-1 by v: (P-1) / (v*m + P-1).
double ideal_bubble(int stages, int micro_batches, int virtual_stages = 1);

// The schedule drawn as text, one row per rank, one column per time unit (forward =
// 1 unit, backward = 2), e.g. for 1f1b P=2 m=4:
//   rank 0 | F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 .. B3 B3 |
//   rank 1 | .. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .. .. |
// Forward cells show the micro-batch (with ".c" for chunk c when v > 1), idle is "..".
// `max_columns` bounds the width (longer drawings are cut with "…").
std::string draw(const Schedule& s, const Simulation& sim, int max_columns = 120);

}  // namespace tetra::pipeline
