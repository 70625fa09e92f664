// The hierarchical communicator as replication uses it, in a real Open MPI job (mpirun -np
// 2 from ctest; a single process without mpirun is 1 x 3): each process runs 3 replica
// threads; inner = a local group of the 3, outer = per replica index a dup of the MPI
// world (made on the main thread before the replica threads start, as MPI communicator
// creation is collective over the processes). The conformance suite, at sizes that keep
// 2 cores fast, and the splits data parallelism and ZeRO make.
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
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/hierarchical.h"
#include "collectives/local.h"
#include "collectives/mpi.h"
#include "tests/collectives/conformance.h"
#include "tests/collectives/mpi_gtest.h"

using namespace std::chrono_literals;
using namespace tetra::collectives;
namespace conf = tetra::collectives::conformance;

namespace {

constexpr int kReplicas = 3;
// Generous, so that a bug is a TimeoutError rather than a hung job.
constexpr Duration kT = std::chrono::seconds(30);

CommunicatorPtr g_world;
// Per replica: the group with the default threshold, and one that sends every sum
// through reduce_scatter -> outer allreduce -> allgather.
std::vector<CommunicatorPtr> g_hier, g_chunked;

// Runs fn on every replica thread at once and rethrows the first exception.
void on_replicas(const std::function<void(int r)>& fn) {
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < kReplicas; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// The D x R group: outer dups on this (the main) thread, then the factory on every replica.
std::vector<CommunicatorPtr> make_group(const std::string& name, const HierarchicalOptions& options) {
  std::vector<CommunicatorPtr> outer;
  for (int r = 0; r < kReplicas; ++r)
    outer.push_back(g_world->split(0, g_world->rank(), name + " outer " + std::to_string(r), kT));
  std::vector<CommunicatorPtr> inner = make_local_group(kReplicas, name + " inner");
  std::vector<CommunicatorPtr> group(kReplicas);
  on_replicas([&](int r) { group[static_cast<size_t>(r)] = make_hierarchical(inner[r], outer[r], name, options); });
  return group;
}

void conformance(void (*check)(Communicator&, const conf::Config&), int64_t large = 0,
                 std::vector<CommunicatorPtr>* group = &g_hier) {
  conf::Config cfg{kT, large};
  on_replicas([&](int r) { check(*(*group)[static_cast<size_t>(r)], cfg); });
}

TEST(MpiHierarchical, Shape) {
  const int D = g_world->size(), d = g_world->rank();
  on_replicas([&](int r) {
    Communicator& c = *g_hier[static_cast<size_t>(r)];
    EXPECT_EQ(c.backend(), "hierarchical");
    EXPECT_EQ(c.size(), D * kReplicas);
    EXPECT_EQ(c.rank(), d * kReplicas + r);
  });
}

TEST(MpiHierarchical, Allreduce) { conformance(conf::check_allreduce); }
TEST(MpiHierarchical, AllreduceByChunks) { conformance(conf::check_allreduce, 0, &g_chunked); }
// 2^16 floats: 256 KiB, above the default threshold, and not a multiple of 3 (padded).
TEST(MpiHierarchical, AllreduceLarge) { conformance(conf::check_allreduce_large, 1 << 16); }
TEST(MpiHierarchical, ReduceScatter) { conformance(conf::check_reduce_scatter); }
TEST(MpiHierarchical, Allgather) { conformance(conf::check_allgather); }
TEST(MpiHierarchical, Broadcast) { conformance(conf::check_broadcast); }
TEST(MpiHierarchical, Awaited) { conformance(conf::check_awaited); }
TEST(MpiHierarchical, Barrier) { conformance(conf::check_barrier); }
TEST(MpiHierarchical, Validation) { conformance(conf::check_validation); }

TEST(MpiHierarchical, SplitRectangles) {
  conf::Config cfg{kT, 0};
  const int D = g_world->size();
  on_replicas([&](int r) { conf::check_split_rectangles(*g_hier[static_cast<size_t>(r)], D, cfg); });
}

// Within the process (tag 1, over local) and across processes along the replica index
// (tag 2, over MPI).
TEST(MpiHierarchical, SendRecvWithinAndAcross) {
  const int D = g_world->size(), d = g_world->rank();
  on_replicas([&](int r) {
    Communicator& c = *g_hier[static_cast<size_t>(r)];
    const int right = d * kReplicas + (r + 1) % kReplicas, left = d * kReplicas + (r + kReplicas - 1) % kReplicas;
    std::vector<WorkPtr> works;
    works.push_back(c.send(at::full({6}, c.rank(), at::kLong), right, {1, kT}));
    at::Tensor from_left = at::zeros({6}, at::kLong), from_prev = at::zeros({6}, at::kLong);
    const int next = ((d + 1) % D) * kReplicas + r, prev = ((d + D - 1) % D) * kReplicas + r;
    if (D > 1) works.push_back(c.send(at::full({6}, c.rank(), at::kLong), next, {2, kT}));
    works.push_back(c.recv(from_left, left, {1, kT}));
    if (D > 1) works.push_back(c.recv(from_prev, prev, {2, kT}));
    for (auto& w : works) w->wait();
    EXPECT_TRUE(at::equal(from_left, at::full({6}, left, at::kLong)));
    if (D > 1) {
      EXPECT_TRUE(at::equal(from_prev, at::full({6}, prev, at::kLong)));
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  try {
    g_world = mpi_world();
    g_hier = make_group("data", {});
    HierarchicalOptions chunked;
    chunked.split_min_bytes = 0;
    g_chunked = make_group("data chunked", chunked);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_mpi_hierarchical: cannot set up the groups: %s\n", e.what());
    return 1;
  }
  const int any = mpi_gtest::run_all_tests(g_world->rank(), "test_mpi_hierarchical");
  g_hier.clear();
  g_chunked.clear();
  g_world.reset();
  return any;
}
