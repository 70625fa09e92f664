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
             SG = Op::kSendGrad, RG = Op::kRecvGrad;

}  // namespace

TEST(Schedule, InstructionNames) {
  EXPECT_EQ(to_string(Instr{F, 3, 0}), "F3");
  EXPECT_EQ(to_string(Instr{B, 3, 0}), "B3");
  EXPECT_EQ(to_string(Instr{F, 3, 1}), "F3.1");
  EXPECT_EQ(to_string(Instr{SA, 3, 0}), "sendA3");
  EXPECT_EQ(to_string(Instr{RG, 3, 1}), "recvG3.1");
  EXPECT_EQ(schedule_kinds(), (std::vector<std::string>{"gpipe", "1f1b", "interleaved_1f1b"}));
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
    Simulation sim = simulate(s);
    ASSERT_TRUE(sim.ok) << sim.error;
    ASSERT_EQ(static_cast<int>(sim.busy.size()), P);
    for (int r = 0; r < P; ++r) {
      EXPECT_DOUBLE_EQ(sim.busy[r], 3.0 * m * v);  // every unit once, forward 1 + backward 2
      EXPECT_EQ(static_cast<int>(sim.timeline[r].size()), 2 * m * v);
    }
  });
  // gpipe, 1f1b and interleaved v = 1: 8 x 32 each; interleaved v = 2..4 where P divides m: 3 x 85.
  EXPECT_EQ(valid, 3 * 256 + 3 * 85);
}

TEST(Schedule, ProblemsNameTheValues) {
  EXPECT_EQ(schedule_problem("1f1b", 4, 8, 1), "");
  EXPECT_EQ(schedule_problem("interleaved_1f1b", 4, 8, 2), "");
  EXPECT_EQ(schedule_problem("interleaved_1f1b", 4, 6, 1), "");  // v = 1 is plain 1F1B
  EXPECT_EQ(schedule_problem("1f1b", 4, 2, 1), "");              // m < P is GPipe's order
  EXPECT_EQ(schedule_problem("zigzag", 2, 4, 1),
            "schedule \"zigzag\" is not known (schedules: gpipe, 1f1b, interleaved_1f1b)");
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
}
