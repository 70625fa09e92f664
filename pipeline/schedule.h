// Pipeline schedules as data (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1 and ZB-V)
// and the simulator that checks them.
//
// Note [Schedules as data]
// A schedule is, for each pipeline rank, the list of instructions that rank runs in
// order: forward micro-batch i of chunk c, backward i of c (whole, or split into B and
// W for the zero-bubble schedules: Note [Split backward]), and the point-to-point
// transfers between neighbouring stages. One executor (executor.h) runs any list; the
// generators below are the only place that knows GPipe from 1F1B. Nothing here touches
// torch, so every schedule can be generated, simulated and drawn in microseconds — by
// the tests for every (stages, micro-batches, virtual stages) and by `train --dry-run`.
//
// Stages. With P ranks and v virtual stages (chunks) per rank, the model is cut into
// P*v consecutive stages; rank r holds stages r, r+P, r+2P, ... (Megatron-LM's
// interleaved assignment), chunk c of rank r being stage c*P + r. With v = 1 rank r
// holds stage r. ZB-V places its two chunks in a V instead (Placement::kV). Stage s
// sends its output to stage s+1 (on rank s.rank_of(s+1)) and receives its output's
// gradient back from it; neighbouring stages on the same rank hand over locally.
//
// Channels and order. Every ordered pair of ranks (from, to) has two channels, one for
// activations and one for gradients (1F1B: activations r -> r+1, gradients r+1 -> r;
// the V adds activations r+1 -> r and gradients r -> r+1). A send never blocks the sending
// rank's instruction stream; a receive blocks until its message arrives. Each channel
// delivers in order and the executor matches messages by order, so a schedule is valid
// only when, on every channel, the receiver's receives come in the same order as the
// sender's sends. The simulator checks that, each dependency (a forward after its
// input, a backward after its forward and its output gradient, every forward and
// backward exactly once) and that the lists cannot deadlock.
//
// Note [Split backward]
// A backward computes two things: the gradient of the chunk's input, which the previous
// stage waits for, and the gradients of the chunk's weights, which nobody waits for until
// the optimizer step. Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline
// Parallelism", ICLR 2024) run them as two instructions, B (kBackwardInput) and W
// (kBackwardWeight): B as early as 1F1B would run the backward, so the gradient travels
// up the pipeline a W sooner per stage, and W later, in what would have been idle time.
// B frees the activations only the input's gradient needs; W keeps what the weights'
// gradients need (each layer's input and its output's gradient) until it runs. A
// schedule either fuses every backward (gpipe, 1f1b, interleaved_1f1b) or splits every
// one (zbh1, zbv), and runs each W after its own B on the same rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tetra::pipeline {

enum class Op {
  kForward,         // run chunk's layers on micro-batch's input
  kBackward,        // backward of that forward (recomputing it first under checkpointing):
                    // the input's gradient and the weights' together
  kBackwardInput,   // B: the gradient of the chunk's input only (what the previous stage
                    // waits for); the weights' part is kept for the W (zero-bubble)
  kBackwardWeight,  // W: the weights' gradients of a micro-batch whose B has run
  kSendAct,         // send chunk's output for micro-batch to the next stage
  kRecvAct,         // receive chunk's input for micro-batch from the previous stage
  kSendGrad,        // send the gradient of chunk's input to the previous stage
  kRecvGrad,        // receive the gradient of chunk's output from the next stage
};
const char* to_string(Op op);

struct Instr {
  Op op;
  int micro = 0;  // micro-batch index, 0 .. m-1
  int chunk = 0;  // virtual stage on this rank, 0 .. v-1 (global stage chunk*P + rank)
  bool operator==(const Instr& o) const { return op == o.op && micro == o.micro && chunk == o.chunk; }
};
// "F3", "B3" (kBackward and kBackwardInput), "W3", "F3.1" (chunk 1), "sendA3", "recvG3.1".
std::string to_string(const Instr& in);

// Where the P*v stages sit on the P ranks.
//   kLoop: chunk c of rank r is stage c*P + r (Megatron-LM's interleaving; v = 1: stage r).
//   kV:    two chunks, chunk 0 of rank r is stage r and chunk 1 is stage 2P-1-r (ZBV's V:
//          rank 0 holds the first and the last stage, rank P-1 the two middle ones, which
//          hand over locally). Activations of chunk 1 then flow from rank r to r-1.
enum class Placement { kLoop, kV };

struct Schedule {
  std::string kind;        // gpipe | 1f1b | interleaved_1f1b | zbh1 | zbv
  int stages = 1;          // P: pipeline ranks
  int micro_batches = 1;   // m
  int virtual_stages = 1;  // v: chunks per rank
  Placement placement = Placement::kLoop;
  std::vector<std::vector<Instr>> ranks;  // ranks[r]: rank r's instructions in order

  int total_stages() const { return stages * virtual_stages; }
  int stage_of(int rank, int chunk) const {
    return placement == Placement::kV && chunk == 1 ? 2 * stages - 1 - rank : chunk * stages + rank;
  }
  int rank_of(int stage) const {
    return placement == Placement::kV && stage >= stages ? 2 * stages - 1 - stage : stage % stages;
  }
  int chunk_of(int stage) const { return stage / stages; }
  bool first_stage(int rank, int chunk) const { return stage_of(rank, chunk) == 0; }
  bool last_stage(int rank, int chunk) const { return stage_of(rank, chunk) == total_stages() - 1; }
  // Whether the backwards are split into B (kBackwardInput) and W (kBackwardWeight):
  // true for zbh1 and zbv (Note [Split backward]).
  bool split_backward() const;
};

// The schedule kinds, in the order the job spec lists them.
const std::vector<std::string>& schedule_kinds();

// Why (kind, P, m, v) cannot be scheduled, or "" when it can. The rules:
//   P >= 1, m >= 1, v >= 1;
//   gpipe and 1f1b take v = 1 (set schedule: interleaved_1f1b for virtual stages);
//   interleaved_1f1b with v > 1 needs m to be a multiple of P (micro-batches go
//   round the ranks in groups of P, as in Megatron-LM);
//   zbh1 takes v = 1 and zbv v = 2 (its V), any m.
// 1F1B with m < P is valid (every rank warms up with all m forwards: GPipe's order).
std::string schedule_problem(const std::string& kind, int stages, int micro_batches, int virtual_stages);

// Generates the schedule; throws tetra::ConfigError with schedule_problem()'s text
// when it cannot be scheduled.
//   gpipe:  all forwards 0..m-1, then all backwards 0..m-1.
//   1f1b:   (PipeDream-Flush) rank r warms up with min(P-r-1, m) forwards, then
//           alternates one forward and one backward, then drains the backwards: at
//           most P-r micro-batches in flight instead of m.
//   interleaved_1f1b: Megatron-LM's interleaved schedule over v chunks per rank.
//   zbh1:   ZB-H1: 1F1B's order of forwards and B's, rank r delaying its W's by r
//           micro-batches into what would be the cooldown's idle time; the
//           activations of 1F1B, a third of its bubble (Note [ZB-H1]).
//   zbv:    ZB-V: two chunks in a V, at most 2P chunk-activations per rank (1F1B's
//           memory, on every rank) and no bubble but the pipeline's fill (Note [ZB-V]).
Schedule make_schedule(const std::string& kind, int stages, int micro_batches, int virtual_stages = 1);

// The time of one chunk's compute for one micro-batch. A fused backward takes
// input + weight. `transfer`: from a send to its message's arrival at another rank (the
// sender goes on at once, as the executor's sends do); 0: messages arrive as sent.
// `progress_when_waiting`: a rank's progress thread, which moves its messages, gets a
// core only when the rank waits (its host's ranks outnumber its cores, and a transport
// such as TCP needs both ends to move each fragment): a message leaves when its sender
// next waits (for a message not yet there, or at the end of its step), and travels only
// while its receiver waits for it, so it is ready `transfer` after the later of the two.
struct Costs {
  double forward = 1, input = 1, weight = 1;
  double transfer = 0;
  bool progress_when_waiting = false;
};

// What the simulator found.
struct Simulation {
  bool ok = false;
  std::string error;  // the first problem: a deadlock (each rank's blocked instruction),
                      // an out-of-order channel, a missing or repeated forward/backward,
                      // a W before its B, a fused backward mixed with B/W
  // Timing with the Costs per chunk and free transfers.
  double makespan = 0;         // time of the last instruction
  std::vector<double> busy;    // per rank: time spent in forward/backward
  std::vector<double> bubble;  // per rank: 1 - busy / makespan
  double bubble_fraction = 0;  // over all ranks: 1 - sum(busy) / (P * makespan)
  // Memory, in (micro, chunk) units, per rank:
  std::vector<int> peak_in_flight;       // most forwards whose B (or fused backward) has
                                         // not run yet: the activations the rank holds
  std::vector<int> peak_weight_pending;  // most B's whose W has not run yet: what the W's
                                         // keep (each layer's input and output gradient);
                                         // 0 for fused backwards
  // Per rank, the compute slots in time order: {start, end, instr} (for drawing).
  struct Slot {
    double start = 0, end = 0;
    Instr instr;
  };
  std::vector<std::vector<Slot>> timeline;
};

// Runs the schedule as the executor would (sends buffered, receives blocking, channels
// in order) and checks it. Never throws for a bad schedule: the result says why.
Simulation simulate(const Schedule& s, const Costs& c);
// Forward = fwd_cost, fused backward = bwd_cost, B = W = bwd_cost / 2.
Simulation simulate(const Schedule& s, double fwd_cost = 1.0, double bwd_cost = 2.0);

// The theoretical bubble of GPipe and 1F1B: (P-1) / (m+P-1); interleaving divides the
// P-1 by v: (P-1) / (v*m + P-1).
double ideal_bubble(int stages, int micro_batches, int virtual_stages = 1);
// The bubble fraction of a step (idle / (P * makespan), as Simulation::bubble_fraction)
// that `kind` reaches with forward = B = W, the formula bubble_formula(kind) shows:
//   gpipe, 1f1b       (P-1)/(m+P-1)
//   interleaved_1f1b  (P-1)/(vm+P-1)
//   zbh1              (P-1)/(3m+P-1)  for m >= P (Note [ZB-H1])
//   zbv               (P-1)/(6m+P-1)  for m >= 2P-1 (Note [ZB-V])
// Throws tetra::ConfigError for a kind not in schedule_kinds().
double ideal_bubble(const std::string& kind, int stages, int micro_batches, int virtual_stages);
std::string bubble_formula(const std::string& kind);

// The schedule drawn as text, one row per rank, one column per forward's time (with
// simulate()'s default costs a fused backward takes 2 columns, B and W 1 each), e.g. for
// 1f1b P=2 m=4:
//   rank 0 | F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 .. B3 B3 |
//   rank 1 | .. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .. .. |
// and for zbh1 P=3 m=4 (B: the input's gradient, W: the weights'):
//   rank 0 | F0 F1 F2 .. .. B0 W0 F3 B1 W1 B2 W2 B3 W3 |
//   rank 1 | .. F0 F1 .. B0 F2 B1 W0 F3 B2 W1 B3 W2 W3 |
//   rank 2 | .. .. F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3 |
// Cells show the micro-batch (with ".c" for chunk c when v > 1), idle is "..".
// `max_columns` bounds the width (longer drawings are cut with "…").
std::string draw(const Schedule& s, const Simulation& sim, int max_columns = 120);

}  // namespace tetra::pipeline
