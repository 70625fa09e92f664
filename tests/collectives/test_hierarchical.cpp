// The hierarchical communicator over D "processes" x R replicas, all thread-ranks of this
// process: inner = a local group per process, outer = a local group per replica index.
// The conformance suite at group sizes 1..8 in several shapes, then what only the
// composition has: its send/recv reach, non-rectangular splits, stage timeouts, the
// factory's checks. test_mpi_hierarchical.cpp runs it with a real MPI outer.
#include "collectives/hierarchical.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/local.h"
#include "tests/collectives/conformance.h"

namespace tetra::collectives {
namespace {

using namespace std::chrono_literals;
namespace conf = conformance;

struct Shape {
  int D, R;  // processes, replicas per process
};

std::string shape_name(const Shape& s) { return std::to_string(s.D) + "x" + std::to_string(s.R); }


using conformance::contains;
using conformance::error_of;

// The inner groups [d][r] and outer groups [r][d] of a D x R layout, all local.
struct Groups {
  std::vector<std::vector<CommunicatorPtr>> inner, outer;
};

Groups make_groups(const Shape& s) {
  Groups g;
  for (int d = 0; d < s.D; ++d) g.inner.push_back(make_local_group(s.R, "inner " + std::to_string(d)));
  for (int r = 0; r < s.R; ++r) g.outer.push_back(make_local_group(s.D, "outer " + std::to_string(r)));
  return g;
}

// Runs fn(comm, d, r) on D*R threads, each over its own hierarchical communicator (made
// on that thread: the factory is collective), and rethrows the first exception.
void run_grid(const Shape& s, const std::function<void(Communicator&, int d, int r)>& fn,
              const HierarchicalOptions& options = {}, const std::string& name = "hier") {
  Groups groups = make_groups(s);
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int d = 0; d < s.D; ++d)
    for (int r = 0; r < s.R; ++r)
      threads.emplace_back([&, d, r] {
        try {
          CommunicatorPtr c = make_hierarchical(groups.inner[d][r], groups.outer[r][d], name, options);
          fn(*c, d, r);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) first = std::current_exception();
        }
      });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// ---- the conformance suite in every shape ---------------------------------------------

// One test per shape, running every check in order on the same group (as the flat
// RunAllInOrder does): each ctest case is a process of its own, and start-up, not the
// checks, would dominate a test per check.
class HierarchicalShape : public ::testing::TestWithParam<Shape> {};

TEST_P(HierarchicalShape, Conformance) {
  const Shape s = GetParam();
  conf::Config cfg;
  cfg.timeout = 30s;
  cfg.large_numel = 0;
  run_grid(s, [&](Communicator& c, int d, int r) {
    SCOPED_TRACE(shape_name(s));
    EXPECT_EQ(c.backend(), "hierarchical");
    EXPECT_EQ(c.name(), "hier");
    EXPECT_EQ(c.size(), s.D * s.R);
    EXPECT_EQ(c.rank(), d * s.R + r) << "a process's replicas are contiguous";
    conf::check_allreduce(c, cfg);
    // 192 KiB of f32 (above the default threshold): 3 * 2^14 elements split evenly for
    // every R here, one more is padded for every R > 1.
    for (int64_t n : {int64_t{3} << 14, (int64_t{3} << 14) + 1}) {
      conf::Config large = cfg;
      large.large_numel = n;
      conf::check_allreduce_large(c, large);
    }
    conf::check_reduce_scatter(c, cfg);
    conf::check_allgather(c, cfg);
    conf::check_broadcast(c, cfg);
    conf::check_awaited(c, cfg);
    conf::check_barrier(c, cfg);
    conf::check_split_rectangles(c, s.D, cfg);
    // The flat suite's split: its groups are rectangles only with one process or one
    // replica per process (HierarchicalSplit.NonRectangleIsACommErrorOnEveryRank covers
    // the others).
    if (s.D == 1 || s.R == 1) conf::check_split(c, cfg);
    conf::check_validation(c, cfg);
  });
  // Every sum through reduce_scatter -> outer allreduce -> allgather, padded when R does
  // not divide the size (the default threshold sends only the large ones that way).
  HierarchicalOptions chunked;
  chunked.split_min_bytes = 0;
  run_grid(s, [&](Communicator& c, int, int) {
    SCOPED_TRACE(shape_name(s) + ", every sum by chunks");
    conf::check_allreduce(c, cfg);
  }, chunked);
}

INSTANTIATE_TEST_SUITE_P(Shapes, HierarchicalShape,
                         ::testing::Values(Shape{1, 1}, Shape{1, 2}, Shape{2, 1}, Shape{2, 2}, Shape{1, 3},
                                           Shape{3, 1}, Shape{2, 3}, Shape{3, 2}, Shape{2, 4}, Shape{4, 2},
                                           Shape{1, 8}, Shape{8, 1}),
                         [](const ::testing::TestParamInfo<Shape>& info) { return "p" + shape_name(info.param); });

// The rectangle check's expectations are a flat group's: a local group passes it too.
TEST(HierarchicalSplit, RectanglesMatchAFlatGroup) {
  conf::Config cfg;
  cfg.timeout = 30s;
  for (Shape s : {Shape{2, 3}, Shape{4, 2}})
    run_local_ranks(s.D * s.R, [&](int, Communicator& c) { conf::check_split_rectangles(c, s.D, cfg); });
}

// ---- send/recv: within a process and along a replica index ------------------------------

TEST(HierarchicalSendRecv, SameProcessAndSameReplicaIndex) {
  for (Shape s : {Shape{2, 3}, Shape{3, 2}}) {
    SCOPED_TRACE(shape_name(s));
    run_grid(s, [&](Communicator& c, int d, int r) {
      // Ring inside the process (tag 1) and ring across processes (tag 2), both ways of
      // tag order: each recv passes over a pending message of the other tag where the
      // two rings meet the same peer.
      const int right = d * s.R + (r + 1) % s.R, left = d * s.R + (r + s.R - 1) % s.R;
      const int next = ((d + 1) % s.D) * s.R + r, prev = ((d + s.D - 1) % s.D) * s.R + r;
      std::vector<WorkPtr> works;
      for (int tag : {1, 3}) works.push_back(c.send(at::full({5}, c.rank() * 10 + tag, at::kInt), right, {tag, 10s}));
      for (int tag : {2, 4}) works.push_back(c.send(at::full({5}, c.rank() * 10 + tag, at::kFloat), next, {tag, 10s}));
      at::Tensor from_left3 = at::zeros({5}, at::kInt), from_left1 = at::zeros({5}, at::kInt);
      at::Tensor from_prev4 = at::zeros({5}, at::kFloat), from_prev2 = at::zeros({5}, at::kFloat);
      works.push_back(c.recv(from_left3, left, {3, 10s}));
      works.push_back(c.recv(from_left1, left, {1, 10s}));
      works.push_back(c.recv(from_prev4, prev, {4, 10s}));
      works.push_back(c.recv(from_prev2, prev, {2, 10s}));
      for (auto& w : works) EXPECT_EQ(error_of(w), "");
      EXPECT_TRUE(at::equal(from_left3, at::full({5}, left * 10 + 3, at::kInt))) << from_left3;
      EXPECT_TRUE(at::equal(from_left1, at::full({5}, left * 10 + 1, at::kInt))) << from_left1;
      EXPECT_TRUE(at::equal(from_prev4, at::full({5}, prev * 10 + 4, at::kFloat))) << from_prev4;
      EXPECT_TRUE(at::equal(from_prev2, at::full({5}, prev * 10 + 2, at::kFloat))) << from_prev2;
    });
  }
}

// Rank 4 = (process 1, replica 1) of 2 x 3 has no path to rank 0 = (0, 0): a clear error,
// naming both ranks and who is reachable, before anything is sent.
TEST(HierarchicalSendRecv, OtherPairsAreAClearCommError) {
  run_grid({2, 3}, [&](Communicator& c, int, int) {
    if (c.rank() == 4) {
      std::string e = error_of(c.send(at::ones({2}), 0, {0, 5s}));
      EXPECT_TRUE(contains(e, "hier: send to 0 tag 0")) << e;
      EXPECT_TRUE(contains(e, "rank 4 (process 1, replica 1) cannot send to rank 0 (process 0, replica 0)")) << e;
      EXPECT_TRUE(contains(e, "only to the ranks of its own process (3..5) and to those with its replica index (1, 4)"))
          << e;
    }
    if (c.rank() == 0) {
      std::string e = error_of(c.recv(at::ones({2}), 5, {0, 5s}));
      EXPECT_TRUE(contains(e, "rank 0 (process 0, replica 0) cannot receive from rank 5 (process 1, replica 2)"))
          << e;
    }
  });
}

// ---- split shapes it cannot make ------------------------------------------------------

TEST(HierarchicalSplit, NonRectangleIsACommErrorOnEveryRank) {
  struct Case {
    std::function<std::pair<int, int>(int rank)> color_key;
    std::string text;
  };
  const std::vector<Case> cases = {
      // check_split's "all but rank 0": 3 ranks of 2 x 2.
      {[](int g) { return std::make_pair(g == 0 ? -1 : 1, g); },
       "color 1 has ranks 1, 2, 3 in key order, as (process,replica) (0,1) (1,0) (1,1)"},
      // All ranks, but ordered replica by replica: not what inner x outer splits give.
      {[](int g) { return std::make_pair(0, (g % 2) * 2 + g / 2); },
       "color 0 has ranks 0, 2, 1, 3 in key order"},
  };
  for (const Case& k : cases) {
    const auto t0 = Clock::now();
    run_grid({2, 2}, [&](Communicator& c, int, int) {
      auto [color, key] = k.color_key(c.rank());
      try {
        c.split(color, key, "bad", 10s);
        ADD_FAILURE() << "rank " << c.rank() << ": a non-rectangular split succeeded";
      } catch (const CommError& e) {
        EXPECT_TRUE(contains(e.what(), k.text)) << e.what();
        EXPECT_TRUE(contains(e.what(), "splits only into rectangles")) << e.what();
      }
    });
    EXPECT_LT(Clock::now() - t0, 30s) << "every rank must see the error at once, none wait in an inner split";
  }
}

// ---- failures name the group and the stage, within the op's timeout --------------------

// Replica 1 of process 0 never comes (inner stage), then process 1 never comes (outer).
TEST(HierarchicalErrors, AbsentPeersAreTimeoutsNamingTheStage) {
  // Which stage an absent peer is found in: without the fingerprints' own exchange first.
  const ScopedHealthOptions no_fingerprints{{}};
  run_grid({2, 2}, [&](Communicator& c, int d, int r) {
    if (c.rank() != 0) return;
    const auto t0 = Clock::now();
    std::string e = error_of(c.allreduce(at::ones({4}), {ReduceOp::kSum, 300ms}));
    EXPECT_LT(Clock::now() - t0, 30s);  // not the 300 s default
    EXPECT_TRUE(contains(e, "hier: allreduce sum")) << e;
    EXPECT_TRUE(contains(e, "inner stage (replica 0 of 2 in process 0)")) << e;
    try {
      c.barrier({1s})->wait();
      ADD_FAILURE() << "an op after a failure succeeded";
    } catch (const CommError& e) {
      EXPECT_TRUE(contains(e.what(), "an earlier op on this communicator failed")) << e.what();
    }
  });
  run_grid({2, 2}, [&](Communicator& c, int d, int r) {
    if (d != 0) return;
    const auto t0 = Clock::now();
    WorkPtr w = c.allreduce(at::ones({4}), {ReduceOp::kMax, 300ms});
    try {
      w->wait();
      ADD_FAILURE() << "the allreduce finished without process 1";
    } catch (const TimeoutError& e) {
      EXPECT_TRUE(contains(e.what(), "hier: allreduce max")) << e.what();
      EXPECT_TRUE(contains(e.what(), "outer stage (process 0 of 2, replica index " + std::to_string(r) + ")"))
          << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a TimeoutError: " << e.what();
    }
    EXPECT_LT(Clock::now() - t0, 30s);  // not the 300 s default
  });
}

// ---- the factory --------------------------------------------------------------------

TEST(HierarchicalFactory, NullSameOrAbsent) {
  auto one = make_local_group(1);
  try {
    make_hierarchical(nullptr, one[0], "h");
    ADD_FAILURE() << "null inner accepted";
  } catch (const CommError& e) {
    EXPECT_TRUE(contains(e.what(), "make_hierarchical(h): the inner communicator is null")) << e.what();
  }
  EXPECT_THROW(make_hierarchical(one[0], nullptr, "h"), CommError);
  EXPECT_THROW(make_hierarchical(one[0], one[0], "h"), CommError);
  // Replica 1 never calls: the handshake times out instead of waiting forever.
  Groups g = make_groups({1, 2});
  const auto t0 = Clock::now();
  EXPECT_THROW(make_hierarchical(g.inner[0][0], g.outer[0][0], "alone", {0, 200ms}), TimeoutError);
  EXPECT_LT(Clock::now() - t0, 30s);  // not the 300 s default
}

// The factory's error on each of the 4 ranks of 2 x 2, given each rank's outer group.
std::vector<std::string> factory_errors(const Groups& g, CommunicatorPtr (&outer_of)[2][2], const std::string& name) {
  std::vector<std::string> errors(4);
  std::vector<std::thread> threads;
  for (int d = 0; d < 2; ++d)
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, d, r] {
        try {
          make_hierarchical(g.inner[d][r], outer_of[d][r], name, {0, 10s});
        } catch (const CommError& e) {
          errors[static_cast<size_t>(d * 2 + r)] = e.what();
        }
      });
  for (auto& t : threads) t.join();
  return errors;
}

TEST(HierarchicalFactory, ChecksTheShapeOverInnerAndOuter) {
  {
    // Outer groups that pair replica 0 of one process with replica 1 of the other.
    Groups g = make_groups({2, 2});
    auto a = make_local_group(2, "a"), b = make_local_group(2, "b");
    CommunicatorPtr outer_of[2][2] = {{a[0], b[0]}, {b[1], a[1]}};  // [d][r]
    for (const std::string& e : factory_errors(g, outer_of, "mixed")) {
      EXPECT_TRUE(contains(e, "make_hierarchical(mixed): the outer group")) << e;
      EXPECT_TRUE(contains(e, "must join the replicas with one index")) << e;
    }
  }
  {
    // Replica 1's outer group ranks the processes the other way round.
    Groups g = make_groups({2, 2});
    CommunicatorPtr outer_of[2][2] = {{g.outer[0][0], g.outer[1][1]}, {g.outer[0][1], g.outer[1][0]}};
    for (const std::string& e : factory_errors(g, outer_of, "swapped"))
      EXPECT_TRUE(contains(e, "every replica of a process must have the process's index")) << e;
  }
}

}  // namespace
}  // namespace tetra::collectives
