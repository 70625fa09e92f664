// The mpi backend as a real Open MPI job: run under `mpirun -np N` (N = 2, 3, 4 from
// ctest; also runs as a single process without mpirun, a world of 1). Every rank runs
// every test; rank 0 prints gtest's output, the others print only their failures, and
// any rank's failure makes every rank exit non-zero.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
// The C API only (no deprecated C++ bindings, which would need libmpi_cxx).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "collectives/backends.h"
#include "collectives/launch.h"
#include "collectives/mpi.h"
#include "tests/collectives/conformance.h"
#include "tests/collectives/mpi_gtest.h"

using namespace std::chrono_literals;
using namespace tetra::collectives;
using tetra::CommError;
using tetra::TimeoutError;

namespace {

CommunicatorPtr g_world;
Communicator& world() { return *g_world; }

// Generous, so that a bug is a TimeoutError rather than a hung job.
constexpr Duration kT = std::chrono::seconds(20);

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                            at::kInt,   at::kLong,   at::kByte};
const std::vector<ReduceOp> kOps = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                                    ReduceOp::kProd};

bool is_float(at::ScalarType t) { return at::isFloatingType(t); }

// Values exact in every dtype. Integer sums wrap in u8 (the expected value is computed
// in the same dtype, so it wraps the same way); products stay small.
at::Tensor pattern(at::ScalarType t, ReduceOp op, int rank, int64_t n, int64_t salt = 0) {
  at::Tensor i = at::arange(n, at::kLong);
  at::Tensor v;
  if (!is_float(t)) {
    v = op == ReduceOp::kProd ? (i * 3 + rank + salt) % 5 + 1 : (i * 37 + rank * 101 + salt) % 251;
  } else {
    v = op == ReduceOp::kProd ? (i + rank + salt) % 5 - 2 : (i * 7 + rank * 3 + salt) % 9 - 4;
  }
  return v.to(t);
}

at::Tensor combine(const at::Tensor& a, const at::Tensor& b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return a + b;
    case ReduceOp::kProd: return a * b;
    case ReduceOp::kMin: return at::minimum(a, b);
    case ReduceOp::kMax: return at::maximum(a, b);
  }
  return a;
}

at::Tensor expected_reduction(at::ScalarType t, ReduceOp op, int size, int64_t n, int64_t salt = 0) {
  at::Tensor acc = pattern(t, op, 0, n, salt);
  for (int r = 1; r < size; ++r) acc = combine(acc, pattern(t, op, r, n, salt), op);
  if (op == ReduceOp::kAvg && size > 1) acc = acc.div(size);
  return acc;
}

std::string label(at::ScalarType t, ReduceOp op, int64_t n, bool in_place) {
  return std::string(c10::toString(t)) + " " + to_string(op) + " n=" + std::to_string(n) +
         (in_place ? " in place" : " out of place");
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  if (!at::equal(got, want)) {
    at::Tensor diff = (got.to(at::kDouble) != want.to(at::kDouble)).nonzero();
    int64_t i = diff.numel() ? diff[0].item<int64_t>() : -1;
    ADD_FAILURE() << what << ": rank " << world().rank() << " differs first at element " << i << ": got "
                  << got.flatten()[i].item<double>() << ", want " << want.flatten()[i].item<double>();
  }
}

std::vector<int64_t> sizes_for(const Communicator& c) { return {0, 1, 7, 5 * c.size() + 1}; }

// ---- basics ---------------------------------------------------------------------------

TEST(Mpi, WorldMatchesTheLauncher) {
  EXPECT_EQ(world().backend(), "mpi");
  EXPECT_EQ(world().name(), "mpi world");
  EXPECT_EQ(mpi_world().get(), g_world.get()) << "mpi_world() must return the same world";
  LaunchInfo launch = detect_launch();
  if (launch.launcher == "mpirun") {
    EXPECT_EQ(world().size(), launch.world_size);
    EXPECT_EQ(world().rank(), launch.rank);
  } else {
    EXPECT_EQ(world().size(), 1);
  }
  BackendRegistry registry;
  register_builtin_backends(registry);
  ASSERT_TRUE(registry.contains("mpi"));
  // The Open MPI this was built against: 4 on Debian 12, 5 on Debian 13.
  EXPECT_EQ(registry.at("mpi").description.rfind("Open MPI " + std::to_string(OMPI_MAJOR_VERSION) + ".", 0), 0u)
      << registry.at("mpi").description;
  EXPECT_EQ(registry.create_world("mpi", launch).get(), g_world.get());
  EXPECT_NE(mpi_library_version().find("Open MPI"), std::string::npos);
}

TEST(Mpi, Barrier) {
  for (int i = 0; i < 5; ++i) world().barrier({kT})->wait();
}

// ---- allreduce ------------------------------------------------------------------------

void check_allreduce(Communicator& c, at::ScalarType t, ReduceOp op, int64_t n, bool in_place) {
  const std::string what = c.name() + " allreduce " + label(t, op, n, in_place);
  at::Tensor want = expected_reduction(t, op, c.size(), n);
  at::Tensor input = pattern(t, op, c.rank(), n);
  at::Tensor out;
  if (in_place) {
    out = input;
    c.allreduce(input, {op, kT})->wait();
  } else {
    out = at::full({n}, 77, t);
    at::Tensor before = input.clone();
    c.allreduce(input, out, {op, kT})->wait();
    EXPECT_TRUE(at::equal(input, before)) << what << ": the input changed";
  }
  expect_equal(out, want, what);
}

TEST(Mpi, AllreduceEveryDtypeOpAndSize) {
  for (at::ScalarType t : kDtypes)
    for (ReduceOp op : kOps) {
      if (op == ReduceOp::kAvg && !is_float(t)) continue;
      for (int64_t n : sizes_for(world()))
        for (bool in_place : {true, false}) check_allreduce(world(), t, op, n, in_place);
    }
}

TEST(Mpi, AllreduceLarge) {
  for (bool in_place : {true, false}) check_allreduce(world(), at::kFloat, ReduceOp::kSum, 1 << 20, in_place);
  check_allreduce(world(), at::kFloat, ReduceOp::kAvg, 1 << 20, true);
  check_allreduce(world(), at::kBFloat16, ReduceOp::kSum, 1 << 18, true);
}

TEST(Mpi, HalfSumsAreExactForSmallIntegers) {
  const int n = world().size();
  for (at::ScalarType t : {at::kBFloat16, at::kHalf}) {
    // Each rank contributes (rank + 1) * (i % 8): sums up to 8 * n(n+1)/2, exact in both.
    at::Tensor i = at::arange(4099, at::kLong) % 8;
    at::Tensor x = (i * (world().rank() + 1)).to(t);
    world().allreduce(x, {ReduceOp::kSum, kT})->wait();
    at::Tensor want = (i * (n * (n + 1) / 2)).to(t);
    expect_equal(x, want, std::string(c10::toString(t)) + " small-integer sum");
  }
}

TEST(Mpi, AverageDividesOnce) {
  at::Tensor x = at::full({5}, static_cast<double>(world().rank() + 1), at::kDouble);
  world().allreduce(x, {ReduceOp::kAvg, kT})->wait();
  const int n = world().size();
  EXPECT_TRUE(at::allclose(x, at::full({5}, (n + 1) / 2.0, at::kDouble)));
}

TEST(Mpi, HundredAsyncAllreducesCompleteInOrder) {
  std::vector<at::Tensor> ts;
  std::vector<WorkPtr> works;
  for (int k = 0; k < 100; ++k) {
    ts.push_back(at::full({64 + k}, static_cast<float>(k + world().rank()), at::kFloat));
    works.push_back(world().allreduce(ts.back(), {ReduceOp::kSum, kT}));
  }
  works.back()->wait();
  for (int k = 0; k < 100; ++k) EXPECT_TRUE(works[k]->done()) << "op " << k << " not done after op 99";
  const int n = world().size();
  for (int k = 0; k < 100; ++k) {
    works[k]->wait();
    const float want = static_cast<float>(n * k + n * (n - 1) / 2);
    EXPECT_TRUE(at::equal(ts[k], at::full({64 + k}, want, at::kFloat))) << "op " << k;
  }
}

// ---- reduce_scatter, allgather, broadcast -----------------------------------------------

TEST(Mpi, ReduceScatterEveryDtypeOpAndSize) {
  Communicator& c = world();
  for (at::ScalarType t : kDtypes)
    for (ReduceOp op : kOps) {
      if (op == ReduceOp::kAvg && !is_float(t)) continue;
      for (int64_t chunk : {0, 1, 7, 13}) {
        const std::string what = "reduce_scatter " + label(t, op, chunk, false);
        at::Tensor input = pattern(t, op, c.rank(), chunk * c.size());
        at::Tensor out = at::full({chunk}, 77, t);
        c.reduce_scatter(input, out, {op, kT})->wait();
        at::Tensor want = expected_reduction(t, op, c.size(), chunk * c.size()).narrow(0, chunk * c.rank(), chunk);
        expect_equal(out, want, what);
      }
    }
}

TEST(Mpi, AllgatherEveryDtypeAndSize) {
  Communicator& c = world();
  for (at::ScalarType t : kDtypes)
    for (int64_t n : {0, 1, 7, 13}) {
      std::vector<at::Tensor> parts;
      for (int r = 0; r < c.size(); ++r) parts.push_back(pattern(t, ReduceOp::kSum, r, n, 11));
      at::Tensor want = at::cat(parts);
      at::Tensor out = at::full({n * c.size()}, 77, t);
      c.allgather(pattern(t, ReduceOp::kSum, c.rank(), n, 11), out, {kT})->wait();
      expect_equal(out, want, std::string("allgather ") + c10::toString(t) + " n=" + std::to_string(n));
      // In place: the input is this rank's chunk of the output.
      at::Tensor buf = at::full({n * c.size()}, 77, t);
      at::Tensor mine = buf.narrow(0, n * c.rank(), n);
      mine.copy_(pattern(t, ReduceOp::kSum, c.rank(), n, 11));
      c.allgather(mine, buf, {kT})->wait();
      expect_equal(buf, want, std::string("allgather in place ") + c10::toString(t) + " n=" + std::to_string(n));
    }
}

TEST(Mpi, BroadcastFromEveryRoot) {
  Communicator& c = world();
  for (at::ScalarType t : kDtypes)
    for (int root = 0; root < c.size(); ++root)
      for (int64_t n : sizes_for(c)) {
        at::Tensor want = pattern(t, ReduceOp::kSum, root, n, 5);
        at::Tensor x = c.rank() == root ? want.clone() : at::full({n}, 77, t);
        c.broadcast(x, {root, kT})->wait();
        expect_equal(x, want,
                     std::string("broadcast ") + c10::toString(t) + " root " + std::to_string(root) +
                         " n=" + std::to_string(n));
      }
  at::Tensor big = c.rank() == 0 ? at::arange(1 << 20, at::kFloat) : at::zeros({1 << 20}, at::kFloat);
  c.broadcast(big, {0, kT})->wait();
  EXPECT_TRUE(at::equal(big, at::arange(1 << 20, at::kFloat)));
}

// ---- point to point ---------------------------------------------------------------------

TEST(Mpi, RingSendRecvTwoTagsInReverseOrder) {
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  for (at::ScalarType t : kDtypes) {
    at::Tensor a = pattern(t, ReduceOp::kSum, c.rank(), 16, 1);
    at::Tensor b = pattern(t, ReduceOp::kSum, c.rank(), 16, 2);
    at::Tensor got_a = at::zeros({16}, t), got_b = at::zeros({16}, t);
    auto s1 = c.send(a, next, {1, kT});
    auto s2 = c.send(b, next, {2, kT});
    auto r2 = c.recv(got_b, prev, {2, kT});
    auto r1 = c.recv(got_a, prev, {1, kT});
    s1->wait();
    s2->wait();
    r2->wait();
    r1->wait();
    expect_equal(got_a, pattern(t, ReduceOp::kSum, prev, 16, 1), std::string("tag 1 ") + c10::toString(t));
    expect_equal(got_b, pattern(t, ReduceOp::kSum, prev, 16, 2), std::string("tag 2 ") + c10::toString(t));
  }
}

TEST(Mpi, LargePointToPoint) {
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int64_t n = 1 << 18;  // above the eager limit: a rendezvous send
  if (c.rank() == 0) {
    c.send(at::arange(n, at::kFloat), 1, {7, kT})->wait();
  } else if (c.rank() == 1) {
    at::Tensor x = at::zeros({n}, at::kFloat);
    c.recv(x, 0, {7, kT})->wait();
    EXPECT_TRUE(at::equal(x, at::arange(n, at::kFloat)));
  }
  c.barrier({kT})->wait();
}

// Ranks 0 and 1 in a communicator of their own (an error breaks a communicator).
CommunicatorPtr pair(const std::string& name) {
  return world().split(world().rank() < 2 ? 0 : -1, world().rank(), name, kT);
}

TEST(Mpi, RecvIntoASmallerBufferIsACommErrorFromWait) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ScopedHealthOptions transport_errors{{}};  // the MPI path's own errors, without fingerprints first
  CommunicatorPtr p = pair("truncate pair");
  if (p) {
    if (p->rank() == 0) {
      p->send(at::ones({8}), 1, {3, kT})->wait();
    } else {
      at::Tensor small = at::zeros({4});
      auto w = p->recv(small, 0, {3, kT});
      try {
        w->wait();
        ADD_FAILURE() << "a truncated recv succeeded";
      } catch (const TimeoutError& e) {
        ADD_FAILURE() << "a TimeoutError, not the truncation: " << e.what();
      } catch (const CommError& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("truncate pair"), std::string::npos) << m;
        EXPECT_NE(m.find("recv from 0 tag 3"), std::string::npos) << m;
        EXPECT_NE(m.find("MPI_ERR_TRUNCATE"), std::string::npos) << m;
        EXPECT_NE(m.find("mpi.cpp:"), std::string::npos) << m;
      }
      // The communicator is broken now: later ops fail at once with the cause.
      try {
        p->barrier({kT})->wait();
        ADD_FAILURE() << "an op on a broken communicator succeeded";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("earlier op"), std::string::npos) << e.what();
      }
    }
  }
  world().barrier({kT})->wait();
}

TEST(Mpi, RecvOfAShorterMessageIsACommError) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ScopedHealthOptions transport_errors{{}};  // the MPI path's own errors, without fingerprints first
  CommunicatorPtr p = pair("short pair");
  if (p) {
    if (p->rank() == 0) {
      p->send(at::ones({4}), 1, {0, kT})->wait();
    } else {
      at::Tensor big = at::zeros({8});
      try {
        p->recv(big, 0, {0, kT})->wait();
        ADD_FAILURE() << "a short message was accepted";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("sent 4 elements"), std::string::npos) << e.what();
      }
    }
  }
  world().barrier({kT})->wait();
}

TEST(Mpi, TagAboveTheLimitIsACommError) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  CommunicatorPtr p = pair("tag pair");
  if (p && p->rank() == 0) {
    try {
      p->send(at::ones({1}), 1, {1 << 30, kT})->wait();
      ADD_FAILURE() << "tag 2^30 accepted";  // above Open MPI's MPI_TAG_UB (ob1 and ucx)
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("MPI_TAG_UB"), std::string::npos) << e.what();
    }
  }
  world().barrier({kT})->wait();
}

// ---- sub-communicators ------------------------------------------------------------------

TEST(Mpi, SplitEvenOddWithReversedKeys) {
  Communicator& w = world();
  const int color = w.rank() % 2;
  CommunicatorPtr sub = w.split(color, -w.rank(), "", kT);
  ASSERT_TRUE(sub);
  EXPECT_EQ(sub->backend(), "mpi");
  EXPECT_EQ(sub->name(), "mpi world/split(" + std::to_string(color) + ")");
  std::vector<int> members;
  for (int r = w.size() - 1; r >= 0; --r)
    if (r % 2 == color) members.push_back(r);
  ASSERT_EQ(sub->size(), static_cast<int>(members.size()));
  EXPECT_EQ(members[sub->rank()], w.rank()) << "keys reverse the order";
  at::Tensor out = at::zeros({sub->size()}, at::kInt);
  sub->allgather(at::full({1}, w.rank(), at::kInt), out, {kT})->wait();
  for (int i = 0; i < sub->size(); ++i) EXPECT_EQ(out[i].item<int>(), members[i]);
  // The sub-communicator runs every op.
  for (ReduceOp op : kOps) check_allreduce(*sub, at::kFloat, op, 9, false);
  // Splitting again; colour < 0 joins none.
  CommunicatorPtr first = sub->split(sub->rank() == 0 ? 0 : -1, 0, "first", kT);
  EXPECT_EQ(static_cast<bool>(first), sub->rank() == 0);
  if (first) {
    EXPECT_EQ(first->size(), 1);
  }
}

TEST(Mpi, SplitShared) {
  CommunicatorPtr local = mpi_split_shared(world(), kT);
  ASSERT_TRUE(local);
  EXPECT_EQ(local->name(), "mpi world/shared");
  LaunchInfo launch = detect_launch();
  if (launch.launcher == "mpirun") {
    EXPECT_EQ(local->size(), launch.local_world_size);
    EXPECT_EQ(local->rank(), launch.local_rank);
  }
  at::Tensor x = at::ones({3}, at::kLong);
  local->allreduce(x, {ReduceOp::kSum, kT})->wait();
  EXPECT_TRUE(at::equal(x, at::full({3}, local->size(), at::kLong)));
}

// ---- timeouts ---------------------------------------------------------------------------

// Rank 0 allreduces on a communicator of all ranks, the others do not come: rank 0's
// wait() throws TimeoutError after ~500 ms and the communicator is broken. Then (after
// a world barrier) the others join late, which completes rank 0's abandoned op, so
// every rank goes on and the job ends cleanly.
TEST(Mpi, PeerThatNeverJoinsIsATimeoutError) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ScopedHealthOptions transport_errors{{}};  // the MPI path's own errors, without fingerprints first
  CommunicatorPtr sub = world().split(0, world().rank(), "timeout test", kT);
  at::Tensor x = at::ones({1000});
  if (world().rank() == 0) {
    const auto start = Clock::now();
    auto w = sub->allreduce(x, {ReduceOp::kSum, 500ms});
    try {
      w->wait();
      ADD_FAILURE() << "the allreduce completed without its peers";
    } catch (const TimeoutError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("timeout test: allreduce sum"), std::string::npos) << m;
      EXPECT_NE(m.find("MPI_Iallreduce"), std::string::npos) << m;
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    EXPECT_GE(ms, 490);
    EXPECT_LT(ms, 3000);
    const auto t1 = Clock::now();
    EXPECT_THROW(sub->barrier({kT})->wait(), CommError);
    EXPECT_LT(Clock::now() - t1, 1s) << "a broken communicator fails at once";
  }
  world().barrier({kT})->wait();
  if (world().rank() != 0) {
    sub->allreduce(x, {ReduceOp::kSum, kT})->wait();  // late: completes rank 0's op
    EXPECT_TRUE(at::equal(x, at::full({1000}, static_cast<float>(world().size()))));
  }
  world().barrier({kT})->wait();
}

TEST(Mpi, RecvThatNeverComesIsATimeoutError) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ScopedHealthOptions transport_errors{{}};  // the MPI path's own errors, without fingerprints first
  CommunicatorPtr p = pair("recv timeout pair");
  if (p && p->rank() == 1) {
    const auto start = Clock::now();
    EXPECT_THROW(p->recv(at::zeros({4}), 0, {9, 300ms})->wait(), TimeoutError);
    EXPECT_LT(Clock::now() - start, 2s);
  }
  world().barrier({kT})->wait();
}

// ---- the shared conformance suite ---------------------------------------------------------

namespace conf = conformance;

TEST(MpiConformance, Allreduce) { conf::check_allreduce(world()); }
TEST(MpiConformance, AllreduceLarge) { conf::check_allreduce_large(world()); }
TEST(MpiConformance, ReduceScatter) { conf::check_reduce_scatter(world()); }
TEST(MpiConformance, Allgather) { conf::check_allgather(world()); }
TEST(MpiConformance, Broadcast) { conf::check_broadcast(world()); }
TEST(MpiConformance, SendRecv) { conf::check_send_recv(world()); }
TEST(MpiConformance, Awaited) { conf::check_awaited(world()); }
TEST(MpiConformance, Barrier) { conf::check_barrier(world()); }
TEST(MpiConformance, Split) { conf::check_split(world()); }
TEST(MpiConformance, Validation) { conf::check_validation(world()); }
// All of it again on a sub-communicator (reversed order) and on the host's ranks.
TEST(MpiConformance, OnASplitWithReversedKeys) {
  CommunicatorPtr rev = world().split(0, world().size() - world().rank(), "reversed", kT);
  ASSERT_TRUE(rev);
  conf::run_all(*rev, {kT, 1 << 16});
}
TEST(MpiConformance, OnTheSharedSplit) {
  CommunicatorPtr local = mpi_split_shared(world(), kT);
  ASSERT_TRUE(local);
  conf::run_all(*local, {kT, 1 << 16});
}

// ---- main: one gtest run per rank --------------------------------------------------------

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  try {
    g_world = mpi_world();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_mpi: cannot start the mpi world: %s\n", e.what());
    return 1;
  }
  const int any = mpi_gtest::run_all_tests(g_world->rank(), "test_mpi");
  g_world.reset();
  return any;
}
