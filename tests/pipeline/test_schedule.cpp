// Pipeline schedules: every valid (kind, P, m, v) simulates cleanly with the bubble and
// memory the theory promises, invalid ones say why, and the simulator catches broken
// hand-made lists.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "collectives/error.h"
#include "pipeline/schedule.h"

using namespace tetra::pipeline;

namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Calls f(kind, P, m, v) over the grid the tests sweep.
template <typename F>
void for_each_config(F f) {
  for (const auto& kind : schedule_kinds())
    for (int P = 1; P <= 8; ++P)
      for (int m = 1; m <= 32; ++m)
        for (int v = 1; v <= 4; ++v) f(kind, P, m, v);
}

Schedule hand_made(int P, int m, int v, std::vector<std::vector<Instr>> ranks) {
  Schedule s;
  s.kind = "hand";
  s.stages = P;
  s.micro_batches = m;
  s.virtual_stages = v;
  s.ranks = std::move(ranks);
  return s;
}

constexpr Op F = Op::kForward, B = Op::kBackward, SA = Op::kSendAct, RA = Op::kRecvAct,
             SG = Op::kSendGrad, RG = Op::kRecvGrad, BI = Op::kBackwardInput,
             BW = Op::kBackwardWeight;

// Forward = B = W: the paper's unit costs (simulate()'s defaults too, as B = W = 2/2).
const Costs kUnit{1, 1, 1};

}  // namespace

TEST(Schedule, InstructionNames) {
  EXPECT_EQ(to_string(Instr{F, 3, 0}), "F3");
  EXPECT_EQ(to_string(Instr{B, 3, 0}), "B3");
  EXPECT_EQ(to_string(Instr{F, 3, 1}), "F3.1");
  EXPECT_EQ(to_string(Instr{SA, 3, 0}), "sendA3");
  EXPECT_EQ(to_string(Instr{RG, 3, 1}), "recvG3.1");
  EXPECT_EQ(to_string(Instr{BI, 3, 1}), "B3.1");
  EXPECT_EQ(to_string(Instr{BW, 3, 0}), "W3");
  EXPECT_STREQ(to_string(BI), "backward_input");
  EXPECT_STREQ(to_string(BW), "backward_weight");
  EXPECT_EQ(schedule_kinds(),
            (std::vector<std::string>{"gpipe", "1f1b", "interleaved_1f1b", "zbh1", "zbv"}));
}

TEST(Schedule, EveryValidConfigSimulatesAndEveryInvalidOneThrowsItsProblem) {
  int valid = 0;
  for_each_config([&](const std::string& kind, int P, int m, int v) {
    const std::string problem = schedule_problem(kind, P, m, v);
    SCOPED_TRACE(kind + " P=" + std::to_string(P) + " m=" + std::to_string(m) +
                 " v=" + std::to_string(v));
    if (!problem.empty()) {
      try {
        make_schedule(kind, P, m, v);
        ADD_FAILURE() << "no ConfigError";
      } catch (const tetra::ConfigError& e) {
        EXPECT_EQ(e.what(), problem);
      }
      return;
    }
    ++valid;
    Schedule s = make_schedule(kind, P, m, v);
    ASSERT_EQ(static_cast<int>(s.ranks.size()), P);
    EXPECT_EQ(s.split_backward(), kind == "zbh1" || kind == "zbv");
    EXPECT_EQ(s.placement, kind == "zbv" ? Placement::kV : Placement::kLoop);
    for (const auto& list : s.ranks)
      for (const auto& in : list)
        if (in.op == B || in.op == BI || in.op == BW) {
          EXPECT_EQ(in.op != B, s.split_backward()) << to_string(in);
        }
    Simulation sim = simulate(s);
    ASSERT_TRUE(sim.ok) << sim.error;
    ASSERT_EQ(static_cast<int>(sim.busy.size()), P);
    for (int r = 0; r < P; ++r) {
      // Every unit once: forward 1 + backward 2 (fused, or B 1 + W 1).
      EXPECT_DOUBLE_EQ(sim.busy[r], 3.0 * m * v);
      EXPECT_EQ(static_cast<int>(sim.timeline[r].size()), (s.split_backward() ? 3 : 2) * m * v);
      if (!s.split_backward()) {
        EXPECT_EQ(sim.peak_weight_pending[r], 0);
      }
    }
  });
  // gpipe, 1f1b and interleaved v = 1: 8 x 32 each; interleaved v = 2..4 where P divides m:
  // 3 x 85; zbh1 (v = 1) and zbv (v = 2): 8 x 32 each.
  EXPECT_EQ(valid, 3 * 256 + 3 * 85 + 2 * 256);
}

TEST(Schedule, ProblemsNameTheValues) {
  EXPECT_EQ(schedule_problem("1f1b", 4, 8, 1), "");
  EXPECT_EQ(schedule_problem("interleaved_1f1b", 4, 8, 2), "");
  EXPECT_EQ(schedule_problem("interleaved_1f1b", 4, 6, 1), "");  // v = 1 is plain 1F1B
  EXPECT_EQ(schedule_problem("1f1b", 4, 2, 1), "");              // m < P is GPipe's order
  EXPECT_EQ(
      schedule_problem("zigzag", 2, 4, 1),
      "schedule \"zigzag\" is not known (schedules: gpipe, 1f1b, interleaved_1f1b, zbh1, zbv)");
  EXPECT_EQ(schedule_problem("gpipe", 0, 4, 1), "the pipeline needs at least 1 stage, got 0");
  EXPECT_EQ(schedule_problem("gpipe", 2, 0, 1), "the pipeline needs at least 1 micro-batch, got 0");
  EXPECT_EQ(schedule_problem("interleaved_1f1b", 2, 4, 0),
            "the pipeline needs at least 1 virtual stage per rank, got 0");
  EXPECT_TRUE(contains(schedule_problem("1f1b", 2, 4, 2),
                       "set schedule: interleaved_1f1b for virtual stages"));
  EXPECT_EQ(schedule_problem("gpipe", 2, 4, 3),
            "schedule gpipe runs one virtual stage per rank, got virtual_stages 3; "
            "set schedule: interleaved_1f1b for virtual stages");
  EXPECT_EQ(
      schedule_problem("interleaved_1f1b", 4, 6, 2),
      "interleaved_1f1b needs micro_batches to be a multiple of the 4 pipeline stages, got 6");
  EXPECT_THROW(make_schedule("interleaved_1f1b", 4, 6, 2), tetra::ConfigError);

  EXPECT_EQ(schedule_problem("zbh1", 4, 3, 1), "");  // any m, as 1F1B
  EXPECT_EQ(schedule_problem("zbv", 4, 3, 2), "");   // any m: no groups of P
  EXPECT_EQ(schedule_problem("zbh1", 4, 8, 2),
            "schedule zbh1 runs one virtual stage per rank, got virtual_stages 2; "
            "set schedule: zbv for two virtual stages");
  EXPECT_EQ(schedule_problem("zbv", 4, 8, 1),
            "zbv runs two virtual stages per rank (a V), got virtual_stages 1");
  EXPECT_EQ(schedule_problem("zbv", 4, 8, 3),
            "zbv runs two virtual stages per rank (a V), got virtual_stages 3");
  EXPECT_THROW(make_schedule("zbv", 4, 8), tetra::ConfigError);  // v defaults to 1
}

TEST(Schedule, GpipeHoldsEveryMicroBatch1F1BAtMostTheStagesAfter) {
  for (int P = 1; P <= 8; ++P)
    for (int m = 1; m <= 32; ++m) {
      Simulation g = simulate(make_schedule("gpipe", P, m));
      Simulation o = simulate(make_schedule("1f1b", P, m));
      ASSERT_TRUE(g.ok && o.ok);
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(g.peak_in_flight[r], m) << "P=" << P << " m=" << m << " r=" << r;
        EXPECT_EQ(o.peak_in_flight[r], std::min(P - r, m)) << "P=" << P << " m=" << m << " r=" << r;
      }
    }
}

TEST(Schedule, GpipeAnd1F1BHaveTheIdealBubble) {
  for (const std::string kind : {"gpipe", "1f1b"})
    for (int P = 1; P <= 8; ++P)
      for (int m = 1; m <= 32; ++m) {
        Simulation sim = simulate(make_schedule(kind, P, m), 1.0, 2.0);
        ASSERT_TRUE(sim.ok) << sim.error;
        EXPECT_DOUBLE_EQ(sim.makespan, (m + P - 1) * 3.0) << kind << " P=" << P << " m=" << m;
        EXPECT_NEAR(sim.bubble_fraction, ideal_bubble(P, m), 1e-12)
            << kind << " P=" << P << " m=" << m;
      }
}

TEST(Schedule, InterleavingShrinksTheBubble) {
  for (int P = 1; P <= 8; ++P)
    for (int m = P; m <= 32; m += P)
      for (int v = 2; v <= 4; ++v) {
        Simulation plain = simulate(make_schedule("1f1b", P, m));
        Simulation inter = simulate(make_schedule("interleaved_1f1b", P, m, v));
        ASSERT_TRUE(inter.ok) << inter.error;
        EXPECT_LE(inter.bubble_fraction, plain.bubble_fraction + 1e-12)
            << "P=" << P << " m=" << m << " v=" << v;
        EXPECT_NEAR(inter.bubble_fraction, ideal_bubble(P, m, v), 1e-12)
            << "P=" << P << " m=" << m << " v=" << v;
      }
  EXPECT_DOUBLE_EQ(ideal_bubble(4, 8, 2), 3.0 / 19.0);
}

TEST(Schedule, ZBH1HoldsThe1F1BActivations) {
  for (int P = 1; P <= 8; ++P)
    for (int m = 1; m <= 32; ++m) {
      Simulation o = simulate(make_schedule("1f1b", P, m));
      Simulation z = simulate(make_schedule("zbh1", P, m));
      ASSERT_TRUE(o.ok && z.ok);
      EXPECT_EQ(z.peak_in_flight, o.peak_in_flight) << "P=" << P << " m=" << m;
      // Rank r holds back r W's (Note [ZB-H1]).
      for (int r = 0; r < P; ++r)
        EXPECT_EQ(z.peak_weight_pending[r], std::min(r + 1, m))
            << "P=" << P << " m=" << m << " r=" << r;
    }
}

TEST(Schedule, ZBVHoldsTwoChunksPerStageOnEveryRank) {
  // The paper: ZB-V's peak activations are 1F1B's first stage's, P stages of them, on
  // every rank; in chunks (half a stage each) 2P, reached once m >= 2P-1.
  for (int P = 1; P <= 8; ++P)
    for (int m = 1; m <= 32; ++m) {
      Simulation z = simulate(make_schedule("zbv", P, m, 2));
      ASSERT_TRUE(z.ok) << z.error;
      for (int r = 0; r < P; ++r) {
        SCOPED_TRACE("P=" + std::to_string(P) + " m=" + std::to_string(m) +
                     " r=" + std::to_string(r));
        EXPECT_LE(z.peak_in_flight[r], 2 * P);
        EXPECT_EQ(z.peak_in_flight[r], std::min({m + 1 + r, 2 * m, 2 * P}));
        if (m >= 2 * P - 1) {
          EXPECT_EQ(z.peak_in_flight[r], 2 * P);
          EXPECT_EQ(z.peak_weight_pending[r], 2 * r + 1);  // the cooldown's B's first
        }
      }
    }
}

TEST(Schedule, ZeroBubbleMakespans) {
  // Forward = B = W = 1. 1F1B idles 3(P-1) per rank, ZB-H1 P-1 (bubble rate (P-1)/m vs
  // (P-1)/(3m) in the paper's idle-over-work terms), ZB-V the fill only.
  for (int P = 1; P <= 8; ++P)
    for (int m = 1; m <= 32; ++m) {
      SCOPED_TRACE("P=" + std::to_string(P) + " m=" + std::to_string(m));
      Simulation o = simulate(make_schedule("1f1b", P, m), kUnit);
      Simulation h = simulate(make_schedule("zbh1", P, m), kUnit);
      Simulation v = simulate(make_schedule("zbv", P, m, 2), kUnit);
      ASSERT_TRUE(o.ok && h.ok && v.ok);
      EXPECT_DOUBLE_EQ(o.makespan, 3 * m + 3 * (P - 1));
      if (m >= P) {
        EXPECT_DOUBLE_EQ(h.makespan, 3 * m + (P - 1));
        EXPECT_NEAR(h.bubble_fraction, ideal_bubble("zbh1", P, m, 1), 1e-12);
      } else {
        EXPECT_LT(h.makespan, o.makespan);  // m < P: no steady state, still better
      }
      // ZB-V in chunk units: 6m of work per rank.
      if (m >= 2 * P - 1) {
        EXPECT_DOUBLE_EQ(v.makespan, 6 * m + (P - 1));
        EXPECT_NEAR(v.bubble_fraction, ideal_bubble("zbv", P, m, 2), 1e-12);
        if (P > 1) {
          EXPECT_LT(v.bubble_fraction, h.bubble_fraction);
        }
      }
      if (m >= 2 * P && m % P == 0 && P > 1) {
        Simulation i = simulate(make_schedule("interleaved_1f1b", P, m, 2), kUnit);
        ASSERT_TRUE(i.ok);
        EXPECT_DOUBLE_EQ(i.makespan, 6 * m + 3 * (P - 1));
        EXPECT_LT(v.makespan, i.makespan);
        EXPECT_LT(v.bubble_fraction, i.bubble_fraction);
      }
    }
}

TEST(Schedule, IdealBubbleByKind) {
  for (int P = 1; P <= 8; ++P)
    for (int m = 1; m <= 32; ++m) {
      EXPECT_DOUBLE_EQ(ideal_bubble("gpipe", P, m, 1), ideal_bubble(P, m));
      EXPECT_DOUBLE_EQ(ideal_bubble("1f1b", P, m, 1), ideal_bubble(P, m));
      EXPECT_DOUBLE_EQ(ideal_bubble("interleaved_1f1b", P, m, 2), ideal_bubble(P, m, 2));
    }
  EXPECT_DOUBLE_EQ(ideal_bubble("zbh1", 4, 8, 1), 3.0 / 27.0);
  EXPECT_DOUBLE_EQ(ideal_bubble("zbv", 4, 8, 2), 3.0 / 51.0);
  EXPECT_DOUBLE_EQ(ideal_bubble("zbv", 1, 8, 2), 0.0);
  EXPECT_EQ(bubble_formula("1f1b"), "(P-1)/(m+P-1)");
  EXPECT_EQ(bubble_formula("gpipe"), "(P-1)/(m+P-1)");
  EXPECT_EQ(bubble_formula("interleaved_1f1b"), "(P-1)/(vm+P-1)");
  EXPECT_EQ(bubble_formula("zbh1"), "(P-1)/(3m+P-1)");
  EXPECT_EQ(bubble_formula("zbv"), "(P-1)/(6m+P-1)");
  EXPECT_THROW(bubble_formula("zigzag"), tetra::ConfigError);
  EXPECT_THROW(ideal_bubble("zigzag", 2, 4, 1), tetra::ConfigError);
}

TEST(Schedule, TheVPlacement) {
  Schedule s = make_schedule("zbv", 4, 8, 2);
  EXPECT_EQ(s.total_stages(), 8);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(s.stage_of(r, 0), r);
    EXPECT_EQ(s.stage_of(r, 1), 7 - r);
    for (int c = 0; c < 2; ++c) {
      EXPECT_EQ(s.rank_of(s.stage_of(r, c)), r);
      EXPECT_EQ(s.chunk_of(s.stage_of(r, c)), c);
    }
  }
  EXPECT_TRUE(s.first_stage(0, 0));
  EXPECT_TRUE(s.last_stage(0, 1));  // rank 0 computes the loss

  // P = 2: chunk 0 goes 0 -> 1, turns on rank 1 (locally), chunk 1 goes 1 -> 0; the
  // gradients come back the same way. Receives right before their compute, sends right
  // after; B carries the gradient's transfers, W none.
  Schedule v = make_schedule("zbv", 2, 1, 2);
  EXPECT_EQ(v.ranks[0], (std::vector<Instr>{{F, 0, 0},
                                            {SA, 0, 0},
                                            {RA, 0, 1},
                                            {F, 0, 1},
                                            {BI, 0, 1},
                                            {SG, 0, 1},
                                            {BW, 0, 1},
                                            {RG, 0, 0},
                                            {BI, 0, 0},
                                            {BW, 0, 0}}));
  EXPECT_EQ(v.ranks[1], (std::vector<Instr>{{RA, 0, 0},
                                            {F, 0, 0},
                                            {F, 0, 1},
                                            {SA, 0, 1},
                                            {RG, 0, 1},
                                            {BI, 0, 1},
                                            {BW, 0, 1},
                                            {BI, 0, 0},
                                            {SG, 0, 0},
                                            {BW, 0, 0}}));

  // One rank: both chunks local, compute only.
  Schedule local = make_schedule("zbv", 1, 3, 2);
  for (const auto& in : local.ranks[0])
    EXPECT_TRUE(in.op == F || in.op == BI || in.op == BW) << to_string(in);
  EXPECT_TRUE(simulate(local).ok);

  Schedule bent = make_schedule("interleaved_1f1b", 2, 4, 4);
  bent.placement = Placement::kV;
  EXPECT_EQ(simulate(bent).error, "a V placement takes 2 virtual stages, the schedule has 4");
}

TEST(Schedule, InterleavedWithOneChunkIs1F1B) {
  for (int P = 1; P <= 8; ++P)
    for (int m = 1; m <= 32; ++m)
      EXPECT_EQ(make_schedule("interleaved_1f1b", P, m, 1).ranks, make_schedule("1f1b", P, m).ranks)
          << "P=" << P << " m=" << m;
}

TEST(Schedule, TransfersAroundTheComputeAndNoneOnOneRank) {
  Schedule s = make_schedule("1f1b", 2, 2);
  EXPECT_EQ(s.ranks[0], (std::vector<Instr>{{F, 0, 0},
                                            {SA, 0, 0},
                                            {F, 1, 0},
                                            {SA, 1, 0},
                                            {RG, 0, 0},
                                            {B, 0, 0},
                                            {RG, 1, 0},
                                            {B, 1, 0}}));
  EXPECT_EQ(s.ranks[1], (std::vector<Instr>{{RA, 0, 0},
                                            {F, 0, 0},
                                            {B, 0, 0},
                                            {SG, 0, 0},
                                            {RA, 1, 0},
                                            {F, 1, 0},
                                            {B, 1, 0},
                                            {SG, 1, 0}}));
  // One rank, two chunks: the stages hand over locally, the lists hold compute only.
  Schedule local = make_schedule("interleaved_1f1b", 1, 2, 2);
  for (const auto& in : local.ranks[0]) EXPECT_TRUE(in.op == F || in.op == B) << to_string(in);
  EXPECT_TRUE(simulate(local).ok);
}

TEST(Simulate, CatchesADeadlock) {
  // Rank 0 waits for a gradient before it has sent the activation that would produce it.
  Schedule s = hand_made(2, 1, 1,
                         {{{RG, 0, 0}, {F, 0, 0}, {SA, 0, 0}, {B, 0, 0}},
                          {{RA, 0, 0}, {F, 0, 0}, {B, 0, 0}, {SG, 0, 0}}});
  Simulation sim = simulate(s);
  EXPECT_FALSE(sim.ok);
  EXPECT_EQ(sim.error, "deadlock: rank 0 waits at recvG0, rank 1 waits at recvA0");
  EXPECT_EQ(draw(s, sim), sim.error);
}

TEST(Simulate, CatchesAnOutOfOrderChannel) {
  Schedule s = make_schedule("gpipe", 2, 2);
  auto& r1 = s.ranks[1];  // recvA0 F0 recvA1 F1 ...: receive 1 before 0
  std::swap(r1[0], r1[2]);
  std::swap(r1[1], r1[3]);
  Simulation sim = simulate(s);
  EXPECT_FALSE(sim.ok);
  EXPECT_TRUE(contains(sim.error, "out of order")) << sim.error;
  EXPECT_TRUE(contains(sim.error, "recvA1")) << sim.error;
  EXPECT_TRUE(contains(sim.error, "sendA0")) << sim.error;
}

TEST(Simulate, CatchesMissingRepeatedAndEarlyCompute) {
  Schedule missing = make_schedule("1f1b", 1, 2);
  missing.ranks[0].pop_back();
  EXPECT_EQ(simulate(missing).error, "rank 0 never runs B1");

  Schedule twice = hand_made(1, 2, 1, {{{F, 0, 0}, {F, 0, 0}, {B, 0, 0}, {F, 1, 0}, {B, 1, 0}}});
  EXPECT_EQ(simulate(twice).error, "rank 0: runs F0 twice");

  Schedule early = hand_made(1, 1, 1, {{{B, 0, 0}, {F, 0, 0}}});
  EXPECT_EQ(simulate(early).error, "rank 0: B0 runs before its forward F0");

  // A forward on a later stage without its receive.
  Schedule no_input = make_schedule("gpipe", 2, 1);
  no_input.ranks[1].erase(no_input.ranks[1].begin());
  EXPECT_TRUE(contains(simulate(no_input).error, "F0 runs before its input arrives"))
      << simulate(no_input).error;

  // Local handoff: chunk 1's forward before chunk 0's on the same rank.
  Schedule local = hand_made(1, 1, 2, {{{F, 0, 1}, {F, 0, 0}, {B, 0, 1}, {B, 0, 0}}});
  EXPECT_TRUE(contains(simulate(local).error, "F0.1 runs before F0")) << simulate(local).error;

  Schedule out_of_range = hand_made(1, 1, 1, {{{F, 1, 0}}});
  EXPECT_FALSE(simulate(out_of_range).ok);
}

TEST(Simulate, ChecksTheSplitBackward) {
  Schedule w_first = hand_made(1, 1, 1, {{{F, 0, 0}, {BW, 0, 0}, {BI, 0, 0}}});
  EXPECT_EQ(simulate(w_first).error, "rank 0: W0 runs before its B0");

  Schedule both = hand_made(1, 1, 1, {{{F, 0, 0}, {BI, 0, 0}, {B, 0, 0}}});
  EXPECT_EQ(simulate(both).error,
            "rank 0: micro-batch 0 of chunk 0 runs both a fused backward and a split B/W "
            "(one or the other)");
  Schedule w_after_fused = hand_made(1, 1, 1, {{{F, 0, 0}, {B, 0, 0}, {BW, 0, 0}}});
  EXPECT_TRUE(contains(simulate(w_after_fused).error, "runs both a fused backward and a split B/W"))
      << simulate(w_after_fused).error;

  Schedule no_w = make_schedule("zbh1", 2, 3);
  no_w.ranks[1].pop_back();  // its last W
  EXPECT_EQ(simulate(no_w).error, "rank 1 never runs W2");

  Schedule w_twice = hand_made(1, 1, 1, {{{F, 0, 0}, {BI, 0, 0}, {BW, 0, 0}, {BW, 0, 0}}});
  EXPECT_EQ(simulate(w_twice).error, "rank 0: runs W0 twice");

  Schedule early = hand_made(1, 1, 1, {{{BI, 0, 0}, {F, 0, 0}, {BW, 0, 0}}});
  EXPECT_EQ(simulate(early).error, "rank 0: B0 runs before its forward F0");

  // B sends the gradient; a send before it has nothing to send.
  Schedule send_early = hand_made(2, 1, 1,
                                  {{{F, 0, 0}, {SA, 0, 0}, {RG, 0, 0}, {BI, 0, 0}, {BW, 0, 0}},
                                   {{RA, 0, 0}, {F, 0, 0}, {SG, 0, 0}, {BI, 0, 0}, {BW, 0, 0}}});
  EXPECT_EQ(simulate(send_early).error, "rank 1: sendG0 sends before B0 computes it");

  // The V's local turn: chunk 0's B on rank P-1 needs chunk 1's B there first.
  Schedule turn = make_schedule("zbv", 1, 1, 2);
  ASSERT_EQ(
      turn.ranks[0],
      (std::vector<Instr>{{F, 0, 0}, {F, 0, 1}, {BI, 0, 1}, {BW, 0, 1}, {BI, 0, 0}, {BW, 0, 0}}));
  std::swap(turn.ranks[0][2], turn.ranks[0][4]);
  EXPECT_EQ(simulate(turn).error, "rank 0: B0 runs before B0.1, whose gradient it takes");

  // Split and fused cost what the Costs say.
  Simulation sim = simulate(make_schedule("zbh1", 1, 2), Costs{1, 2, 3});
  ASSERT_TRUE(sim.ok);
  EXPECT_DOUBLE_EQ(sim.makespan, 2 * (1 + 2 + 3));
  Simulation fused = simulate(make_schedule("1f1b", 1, 2), Costs{1, 2, 3});
  EXPECT_DOUBLE_EQ(fused.makespan, 2 * (1 + 2 + 3));
}

TEST(Simulate, ChannelsGoBothWaysInTheV) {
  // Rank 0 takes chunk 1's inputs from rank 1 (rank 1 -> 0 carries activations too):
  // receiving micro-batch 1 first is out of order on that channel.
  Schedule s = make_schedule("zbv", 2, 2, 2);
  auto& r0 = s.ranks[0];
  auto recv = [&](int micro) { return std::find(r0.begin(), r0.end(), Instr{RA, micro, 1}); };
  std::iter_swap(recv(0), recv(1));
  Simulation sim = simulate(s);
  EXPECT_EQ(sim.error,
            "out of order: on the activation channel rank 1 -> rank 0, rank 0's recvA1.1 meets "
            "rank 1's sendA0.1 (receives must come in the order of the sends)");
}

TEST(Draw, OneRowPerRankOneColumnPerUnit) {
  Schedule s = make_schedule("1f1b", 2, 4);
  Simulation sim = simulate(s, 1.0, 2.0);
  ASSERT_TRUE(sim.ok);
  const std::string text = draw(s, sim);
  EXPECT_EQ(text,
            "rank 0 | F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 .. B3 B3 |\n"
            "rank 1 | .. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .. .. |\n");

  const std::string cut = draw(s, sim, 5);
  EXPECT_TRUE(contains(cut, "rank 0 | F0 F1 .. .. B0 … |")) << cut;

  Schedule inter = make_schedule("interleaved_1f1b", 2, 4, 2);
  const std::string chunks = draw(inter, simulate(inter));
  EXPECT_TRUE(contains(chunks, "rank 0 | F0.0 F1.0 F0.1 ")) << chunks;
  EXPECT_TRUE(contains(chunks, "rank 1 | ..   F0.0 ")) << chunks;  // idle padded to the width

  // B and W one column each (the header's example).
  Schedule zb = make_schedule("zbh1", 3, 4);
  EXPECT_EQ(draw(zb, simulate(zb)),
            "rank 0 | F0 F1 F2 .. .. B0 W0 F3 B1 W1 B2 W2 B3 W3 |\n"
            "rank 1 | .. F0 F1 .. B0 F2 B1 W0 F3 B2 W1 B3 W2 W3 |\n"
            "rank 2 | .. .. F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3 |\n");
  Schedule v = make_schedule("zbv", 2, 4, 2);
  const std::string vee = draw(v, simulate(v));
  EXPECT_TRUE(contains(vee, "rank 0 | F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 ")) << vee;
}

// A message arrives `transfer` after its send, and the sender goes on at once: one
// micro-batch through 2 stages waits for both of its crossings (F = 1, B + W = 2,
// transfer 0.5); with 4 micro-batches some crossings hide behind other micro-batches'
// work.
namespace {

// F = B = W = 1, each message 0.5 on the wire.
Costs unit_costs_with_transfer() {
  Costs c;
  c.forward = 1;
  c.input = c.weight = 1;
  c.transfer = 0.5;
  return c;
}

}  // namespace

TEST(Schedule, TransfersDelayArrivalsNotSenders) {
  Costs c = unit_costs_with_transfer();
  const Simulation one = simulate(make_schedule("1f1b", 2, 1), c);
  ASSERT_TRUE(one.ok) << one.error;
  EXPECT_DOUBLE_EQ(one.makespan, 2 * (1 + 2) + 2 * 0.5);
  c.transfer = 0;
  const double still = simulate(make_schedule("1f1b", 2, 4), c).makespan;
  c.transfer = 0.5;
  const Simulation four = simulate(make_schedule("1f1b", 2, 4), c);
  ASSERT_TRUE(four.ok) << four.error;
  EXPECT_GT(four.makespan, still);
  EXPECT_LT(four.makespan, still + 4 * 2 * 0.5);  // not every crossing waits
  // The zero-bubble schedules keep W's to fill what the transfers leave idle.
  EXPECT_LE(simulate(make_schedule("zbh1", 2, 4), c).makespan, four.makespan);
}

// Where a rank's progress thread gets a core only when its rank waits
// (Costs::progress_when_waiting), a message leaves when its sender waits and travels
// while its receiver waits. GPipe, 2 stages, 2 micro-batches, F = 1, B = 2, transfer 0.5.
// As posted: stage 1's forwards run from 1.5 to 3.5, its backwards to 7.5, the last
// gradient is there at 8 and stage 0 ends at 10. Moved only while waiting: stage 0's
// activations leave together when it waits (t = 2); stage 1 has waited since 0, so the
// first is ready at 2.5, the second 0.5 after stage 1 waits for it (3.5 -> 4); its
// backwards run from 5 to 9, and its gradients leave when its step ends (9); stage 0
// takes each 0.5 after it waits for it: 9.5 to 11.5, then 12 to 14.
TEST(Schedule, MessagesMoveWhileTheirRanksWait) {
  Costs c = unit_costs_with_transfer();
  const Simulation posted = simulate(make_schedule("gpipe", 2, 2), c);
  ASSERT_TRUE(posted.ok) << posted.error;
  EXPECT_DOUBLE_EQ(posted.makespan, 10);
  c.progress_when_waiting = true;
  const Simulation waiting = simulate(make_schedule("gpipe", 2, 2), c);
  ASSERT_TRUE(waiting.ok) << waiting.error;
  EXPECT_DOUBLE_EQ(waiting.makespan, 14);
  // Every schedule still completes, only later.
  for (const char* kind : {"1f1b", "interleaved_1f1b", "zbh1", "zbv"}) {
    const int v = std::string(kind) == "interleaved_1f1b" || std::string(kind) == "zbv" ? 2 : 1;
    c.progress_when_waiting = false;
    const Simulation a = simulate(make_schedule(kind, 4, 8, v), c);
    c.progress_when_waiting = true;
    const Simulation b = simulate(make_schedule(kind, 4, 8, v), c);
    ASSERT_TRUE(a.ok && b.ok) << kind << ": " << a.error << b.error;
    EXPECT_GE(b.makespan, a.makespan) << kind;
  }
}
