// The health wrapper (Note [Health wrapper], collectives/health.h): a backend is only its
// transport; the fingerprint check and the watchdog's registration are a wrapper's, put
// around what a factory hands out when the process's health options ask for them, and
// every split of a wrapped communicator is wrapped the same way.
#include "collectives/health.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "collectives/local.h"
#include "collectives/watchdog.h"
#include "tests/collectives/conformance.h"

namespace tetra::collectives {
namespace {

using namespace std::chrono_literals;
using conformance::contains;
using conformance::error_of;

HealthOptions options(bool check, Duration stall) {
  HealthOptions h;
  h.check = check;
  h.stall_warning = stall;
  return h;
}

bool wrapped(Communicator& c) { return &c.transport() != &c; }

// How many of this process's watched communicators belong to `c`'s group.
size_t watched_members(const Communicator& c) {
  size_t n = 0;
  for (const MemberProgress& m : local_progress())
    if (m.group && m.group->identity == c.group()->identity) ++n;
  return n;
}

TEST(HealthWrapper, ABackendAloneWhenNothingIsAsked) {
  const ScopedHealthOptions off(options(false, Duration(0)));
  auto comms = make_local_group(2, "bare");
  EXPECT_FALSE(wrapped(*comms[0]));
  EXPECT_EQ(comms[0]->backend(), "local");
  EXPECT_EQ(watched_members(*comms[0]), 0u);  // no stall warnings asked: not watched
}

TEST(HealthWrapper, StallWarningsAloneWrapAndWatchWithoutFingerprints) {
  const ScopedHealthOptions stalls(options(false, 60s));
  auto comms = make_local_group(2, "watched");
  ASSERT_TRUE(wrapped(*comms[0]));
  EXPECT_EQ(comms[0]->backend(), "local");  // the backend's name, through the wrapper
  EXPECT_EQ(comms[0]->name(), "watched");
  EXPECT_EQ(watched_members(*comms[0]), 2u);
  // No fingerprint: mismatched sizes reach the local backend's own check.
  WorkPtr a = comms[0]->allreduce(at::ones({10}));
  WorkPtr b = comms[1]->allreduce(at::ones({12}));
  const std::string e = error_of(a);
  EXPECT_FALSE(contains(e, "collectives.check")) << e;
  error_of(b);
  comms.clear();
}

TEST(HealthWrapper, TheCheckAgreesBeforeTheOpAndCountsNoTrafficOfItsOwn) {
  const ScopedHealthOptions on(options(true, Duration(0)));
  std::vector<Traffic> traffic(2);
  std::vector<std::string> errors(2);
  std::vector<double> sums(2);
  run_local_ranks(2, [&](int rank, Communicator& c) {
    EXPECT_TRUE(wrapped(c));
    at::Tensor t = at::full({4}, static_cast<float>(rank + 1));
    c.allreduce(t)->wait();
    sums[static_cast<size_t>(rank)] = t.sum().item<double>();
    traffic[static_cast<size_t>(rank)] = c.traffic();
    // Then a mismatch: named by the fingerprints, not by the backend.
    errors[static_cast<size_t>(rank)] =
        error_of(rank == 0 ? c.allreduce(at::ones({2})) : c.broadcast(at::ones({2}), {0}));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(sums[static_cast<size_t>(r)], 12.0);
    // One allreduce of 16 bytes as the caller issued it; the fingerprint's allgather is the
    // wrapper's and counts nowhere.
    EXPECT_EQ(traffic[static_cast<size_t>(r)].count[Traffic::kAllreduce], 1);
    EXPECT_EQ(traffic[static_cast<size_t>(r)].count[Traffic::kAllgather], 0);
    EXPECT_EQ(traffic[static_cast<size_t>(r)].payload[Traffic::kAllreduce], 16);
    EXPECT_TRUE(contains(errors[static_cast<size_t>(r)], "collectives.check")) << errors[static_cast<size_t>(r)];
    EXPECT_TRUE(contains(errors[static_cast<size_t>(r)], "rank 1 called broadcast from 0 #2")) << errors[static_cast<size_t>(r)];
  }
}

TEST(HealthWrapper, ASplitOfAWrappedGroupIsWrappedWithTheOptionsOfItsTime) {
  auto comms = [] {
    const ScopedHealthOptions on(options(true, 60s));
    return make_local_group(2, "world");
  }();
  std::vector<CommunicatorPtr> checked(2), bare(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      checked[static_cast<size_t>(r)] = comms[static_cast<size_t>(r)]->split(0, r, "checked half");
    });
  for (auto& t : ts) t.join();
  ts.clear();
  {
    const ScopedHealthOptions off(options(false, Duration(0)));
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] { bare[static_cast<size_t>(r)] = comms[static_cast<size_t>(r)]->split(0, r, "bare half"); });
    for (auto& t : ts) t.join();
  }
  // The split is a wrapper around the backend's split (the same recorder as its root), or
  // the backend's split alone when nothing is asked any more.
  EXPECT_TRUE(wrapped(*checked[0]));
  EXPECT_FALSE(wrapped(*bare[0]));
  EXPECT_EQ(checked[0]->recorder(), comms[0]->recorder());
  EXPECT_EQ(checked[0]->group()->identity, checked[1]->group()->identity);
  EXPECT_EQ(watched_members(*checked[0]), 2u);
  // The wrapped split checks.
  std::vector<std::string> errors(2);
  ts.clear();
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      Communicator& c = *checked[static_cast<size_t>(r)];
      errors[static_cast<size_t>(r)] = error_of(r == 0 ? c.allreduce(at::ones({3})) : c.allreduce(at::ones({5})));
    });
  for (auto& t : ts) t.join();
  for (const std::string& e : errors) EXPECT_TRUE(contains(e, "collectives.check")) << e;
}

TEST(HealthWrapper, AbortReachesTheLocalBackendThroughTheWrapper) {
  const ScopedHealthOptions on(options(true, 60s));
  auto comms = make_local_group(2, "abortable");
  ASSERT_TRUE(wrapped(*comms[0]));
  WorkPtr w = comms[0]->allreduce(at::ones({4}));  // rank 1 never comes
  abort_local_group(*comms[1], "rank 1 gave up");
  const std::string e = error_of(w);
  EXPECT_TRUE(contains(e, "rank 1 gave up")) << e;
}

}  // namespace
}  // namespace tetra::collectives
