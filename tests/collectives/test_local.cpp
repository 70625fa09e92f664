// The local backend: the conformance suite at world sizes 1..8 (thread-ranks), and what
// only a shared-memory backend can check cheaply — timeouts naming absent ranks,
// cross-rank mismatches, errors released to peers, ordering, overlap, several groups.
#include "collectives/local.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "tests/collectives/conformance.h"

namespace tetra::collectives {
namespace {

using namespace std::chrono_literals;
namespace conf = conformance;

// ---- the conformance suite at every world size ------------------------------------

class LocalWorld : public ::testing::TestWithParam<int> {
 protected:
  void run(void (*check)(Communicator&, const conf::Config&), int64_t large = 0) {
    conf::Config cfg;
    cfg.timeout = 60s;
    // Big tensors at every world size would not keep world 8 on 2 cores fast.
    cfg.large_numel = large;
    run_local_ranks(GetParam(), [&](int, Communicator& c) { check(c, cfg); });
  }
};

TEST_P(LocalWorld, Allreduce) { run(conf::check_allreduce); }
TEST_P(LocalWorld, AllreduceLarge) { run(conf::check_allreduce_large, GetParam() <= 4 ? 1 << 20 : 1 << 17); }
TEST_P(LocalWorld, ReduceScatter) { run(conf::check_reduce_scatter); }
TEST_P(LocalWorld, Allgather) { run(conf::check_allgather); }
TEST_P(LocalWorld, Broadcast) { run(conf::check_broadcast); }
TEST_P(LocalWorld, Awaited) { run(conf::check_awaited); }
TEST_P(LocalWorld, SendRecv) { run(conf::check_send_recv); }
TEST_P(LocalWorld, Barrier) { run(conf::check_barrier); }
TEST_P(LocalWorld, Split) { run(conf::check_split); }
TEST_P(LocalWorld, Validation) { run(conf::check_validation); }
TEST_P(LocalWorld, RunAllInOrder) {
  conf::Config cfg;
  cfg.large_numel = 1 << 12;
  run_local_ranks(GetParam(), [&](int, Communicator& c) { conf::run_all(c, cfg); });
}

INSTANTIATE_TEST_SUITE_P(Sizes, LocalWorld, ::testing::Range(1, 9),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "world" + std::to_string(info.param);
                         });

// ---- local-specific -------------------------------------------------------------


using conformance::contains;
using conformance::error_of;

template <typename F>
double seconds_of(F&& f) {
  auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Note [Traffic counters]: each kind's payload, the ring-convention bytes a rank sends,
// a failed validation counting nothing, and a split's ops counting on its parent too.
TEST(Local, TrafficCountsPayloadAndSentBytesAndSplitsAddToTheirParent) {
  run_local_ranks(4, [](int rank, Communicator& c) {
    at::Tensor t = at::ones({100}, at::kFloat);  // 400 bytes
    c.allreduce(t)->wait();
    at::Tensor chunk = at::empty({25}, at::kFloat);
    c.reduce_scatter(t, chunk)->wait();
    c.allgather(chunk, t)->wait();
    c.broadcast(t)->wait();
    EXPECT_NE(error_of(c.allgather(t, t)), "");  // invalid: not counted
    Traffic want;
    want.payload[Traffic::kAllreduce] = 400;
    want.payload[Traffic::kReduceScatter] = 400;
    want.payload[Traffic::kAllgather] = 400;
    want.payload[Traffic::kBroadcast] = 400;
    for (int k : {Traffic::kAllreduce, Traffic::kReduceScatter, Traffic::kAllgather, Traffic::kBroadcast})
      want.count[k] = 1;
    want.ops = 4;
    want.sent = 2 * 3 * 400 / 4 + 3 * 400 / 4 * 3;  // 600 + 3 x 300
    EXPECT_EQ(c.traffic(), want) << c.traffic().str();
    auto pair = c.split(rank / 2, rank);  // {0, 1} and {2, 3}
    at::Tensor x = at::zeros({10}, at::kDouble);  // 80 bytes
    if (pair->rank() == 0) pair->send(x, 1)->wait(); else pair->recv(x, 0)->wait();
    const Traffic mine = pair->traffic();
    EXPECT_EQ(mine.ops, 1);
    EXPECT_EQ(mine.sent, pair->rank() == 0 ? 80 : 0);
    EXPECT_EQ(mine.payload[pair->rank() == 0 ? Traffic::kSend : Traffic::kRecv], 80);
    EXPECT_EQ(c.traffic() - want, mine);  // the parent counts the pair's op
  });
}

// Note [Traffic counters]: busy time is the union of the ops' run intervals. Rank 0 has
// a receive running on each of two communicators split from one parent for ~0.3 s at
// once (rank 1 sends only then): each split is busy ~0.3 s and so is the parent — not
// the ~0.6 s their sum would be. Idle before and after counts nothing.
TEST(Local, BusySecondsAreTheUnionOfOverlappingOps) {
  constexpr double kHold = 0.3;
  run_local_ranks(2, [&](int rank, Communicator& c) {
    auto a = c.split(0, rank), b = c.split(0, rank);
    c.barrier()->wait();
    const double before = c.busy_seconds();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // idle: not counted
    at::Tensor x = at::zeros({4}, at::kFloat), y = at::zeros({4}, at::kFloat);
    if (rank == 0) {
      auto wa = a->recv(x, 1), wb = b->recv(y, 1);
      wa->wait();
      wb->wait();
    } else {
      std::this_thread::sleep_for(std::chrono::duration<double>(kHold));
      a->send(x, 0)->wait();
      b->send(y, 0)->wait();
    }
    if (rank == 0) {
      const double parent = c.busy_seconds() - before;
      EXPECT_GE(a->busy_seconds(), kHold * 0.9);
      EXPECT_GE(b->busy_seconds(), kHold * 0.9);
      EXPECT_GE(parent, kHold * 0.9);
      EXPECT_LT(parent, kHold * 1.6) << "the two receives overlapped: their union, not their sum";
    }
    c.barrier()->wait();
  });
}

TEST(Local, Basics) {
  auto comms = make_local_group(3, "replicas");
  ASSERT_EQ(comms.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(comms[r]->rank(), r);
    EXPECT_EQ(comms[r]->size(), 3);
    EXPECT_EQ(comms[r]->backend(), "local");
    EXPECT_EQ(comms[r]->name(), "replicas");
  }
  EXPECT_THROW(make_local_group(0), tetra::Error);
}

// One thread can drive every rank: ops are asynchronous.
TEST(Local, OneThreadDrivesAllRanks) {
  auto comms = make_local_group(4);
  std::vector<at::Tensor> ts;
  std::vector<WorkPtr> ws;
  for (int r = 0; r < 4; ++r) {
    ts.push_back(at::full({1000}, r + 1, at::kFloat));
    ws.push_back(comms[r]->allreduce(ts.back()));
  }
  for (auto& w : ws) w->wait();
  for (auto& t : ts) EXPECT_TRUE(at::equal(t, at::full({1000}, 10, at::kFloat)));
}

TEST(Local, TimeoutNamesTheAbsentRank) {
  auto comms = make_local_group(2);
  AllreduceOptions opts;
  opts.timeout = 200ms;
  at::Tensor t = at::ones({10});
  WorkPtr w = comms[0]->allreduce(t, opts);
  double took = seconds_of([&] {
    try {
      w->wait();
      ADD_FAILURE() << "the allreduce finished without its peer";
    } catch (const TimeoutError& e) {
      EXPECT_TRUE(contains(e.what(), "rank 1 of 2 did not join within 200 ms")) << e.what();
    }
  });
  EXPECT_GE(took, 0.15);
  EXPECT_LT(took, 30.0);  // ended, not the 300 s default (room for a starved sanitizer run)
  // Broken on both ranks now: later ops fail at once, even with the default timeout.
  EXPECT_TRUE(contains(error_of(comms[0]->barrier()), "an earlier op on this communicator failed"));
  took = seconds_of([&] {
    std::string e = error_of(comms[1]->allreduce(at::ones({10})));
    EXPECT_TRUE(contains(e, "the group was aborted")) << e;
    EXPECT_TRUE(contains(e, "rank 0 failed")) << e;
  });
  EXPECT_LT(took, 30.0);  // at once, not after the 300 s default
  comms.clear();  // shuts down without hanging
}

// An op whose options leave the timeout at its default takes the process's (the job's
// collectives.timeout_s through HealthOptions), not a fixed 300 s.
TEST(Local, AnOpWithTheDefaultTimeoutTakesTheJobsTimeout) {
  HealthOptions health = health_options();
  health.timeout = 200ms;
  ScopedHealthOptions scoped(health);
  auto comms = make_local_group(2);
  WorkPtr w = comms[0]->allreduce(at::ones({10}));  // AllreduceOptions{}: the default
  double took = seconds_of([&] {
    const std::string e = error_of(w);
    EXPECT_TRUE(contains(e, "rank 1 of 2 did not join within 200 ms")) << e;
  });
  EXPECT_LT(took, 30.0);  // ended, not the 300 s default
  comms.clear();
}

TEST(Local, TimeoutNamesSeveralAbsentRanks) {
  auto comms = make_local_group(4);
  AllreduceOptions opts;
  opts.timeout = 200ms;
  WorkPtr w0 = comms[0]->allreduce(at::ones({10}), opts);
  WorkPtr w2 = comms[2]->allreduce(at::ones({10}), opts);
  std::string e0 = error_of(w0), e2 = error_of(w2);
  EXPECT_TRUE(contains(e0, "ranks 1, 3 of 4 did not join within 200 ms")) << e0;
  EXPECT_TRUE(contains(e2, "ranks 1, 3 of 4 did not join within 200 ms")) << e2;
  // The one whose deadline passed first throws TimeoutError; the other is released.
  bool t0 = false, t2 = false;
  try { w0->wait(); } catch (const TimeoutError&) { t0 = true; } catch (const CommError&) {}
  try { w2->wait(); } catch (const TimeoutError&) { t2 = true; } catch (const CommError&) {}
  EXPECT_TRUE(t0 || t2);
}

// A rank that never calls, and whose thread just returns: run_local_ranks still ends.
TEST(Local, AbsentRankInRunLocalRanks) {
  std::string error;
  run_local_ranks(2, [&](int rank, Communicator& c) {
    if (rank == 1) return;
    AllreduceOptions opts;
    opts.timeout = 200ms;
    error = error_of(c.allreduce(at::ones({3}), opts));
  });
  EXPECT_TRUE(contains(error, "rank 1 of 2 did not join")) << error;
}

TEST(Local, MismatchedSizesFailOnEveryRank) {
  const ScopedHealthOptions backend_checks_only{{}};  // this tests the local backend's own check
  auto comms = make_local_group(2);
  WorkPtr a = comms[0]->allreduce(at::ones({10}));
  WorkPtr b = comms[1]->allreduce(at::ones({12}));
  for (const WorkPtr& w : {a, b}) {
    std::string e = error_of(w);
    EXPECT_TRUE(contains(e, "allreduce: rank 0 has Float[10], rank 1 has Float[12]")) << e;
  }
  // Both broken afterwards.
  EXPECT_FALSE(error_of(comms[0]->barrier()).empty());
  EXPECT_FALSE(error_of(comms[1]->barrier()).empty());
}

TEST(Local, OtherMismatchesFailOnEveryRank) {
  const ScopedHealthOptions backend_checks_only{{}};  // this tests the local backend's own check
  struct Case {
    std::function<WorkPtr(Communicator&, int)> op;
    std::string text;
  };
  std::vector<Case> cases = {
      {[](Communicator& c, int r) { return c.allreduce(at::ones({4}, r ? at::kDouble : at::kFloat)); },
       "rank 0 has Float[4], rank 1 has Double[4]"},
      {[](Communicator& c, int r) {
         AllreduceOptions o;
         o.op = r ? ReduceOp::kMax : ReduceOp::kSum;
         return c.allreduce(at::ones({4}), o);
       },
       "rank 0 reduces with sum, rank 1 with max"},
      {[](Communicator& c, int r) { return r ? c.broadcast(at::ones({4})) : c.allreduce(at::ones({4})); },
       "rank 0 called allreduce, rank 1 called broadcast"},
      {[](Communicator& c, int r) {
         BroadcastOptions o;
         o.root = r;
         return c.broadcast(at::ones({4}), o);
       },
       "rank 0 has root 0, rank 1 has root 1"},
      {[](Communicator& c, int r) { return c.allgather(at::ones({r + 1}), at::ones({2 * (r + 1)})); },
       "rank 0 has Float[1], rank 1 has Float[2]"},
  };
  for (const Case& k : cases) {
    auto comms = make_local_group(2);
    WorkPtr a = k.op(*comms[0], 0), b = k.op(*comms[1], 1);
    for (const WorkPtr& w : {a, b}) {
      std::string e = error_of(w);
      EXPECT_TRUE(contains(e, k.text)) << e;
    }
  }
}

// An error on one rank (here a recv that times out) releases a peer waiting in a
// collective long before that peer's own timeout.
TEST(Local, ErrorOnOneRankReleasesThePeers) {
  auto comms = make_local_group(3);
  WorkPtr a0 = comms[0]->allreduce(at::ones({8}));
  WorkPtr a2 = comms[2]->allreduce(at::ones({8}));
  RecvOptions ro;
  ro.tag = 3;
  ro.timeout = 100ms;
  double took = seconds_of([&] {
    std::string e1 = error_of(comms[1]->recv(at::zeros({8}), 0, ro));
    EXPECT_TRUE(contains(e1, "recv from 0 tag 3: nothing arrived within 100 ms")) << e1;
    for (const WorkPtr& w : {a0, a2}) {
      std::string e = error_of(w);
      EXPECT_TRUE(contains(e, "rank 1 failed: recv from 0 tag 3")) << e;
    }
  });
  EXPECT_LT(took, 30.0);  // released, not after the 300 s default
}

TEST(Local, RunLocalRanksRethrowsAndReleasesPeers) {
  double took = seconds_of([&] {
    try {
      run_local_ranks(3, [](int rank, Communicator& c) {
        if (rank == 1) throw std::runtime_error("boom on rank 1");
        c.allreduce(at::ones({4}))->wait();  // released with an error, not after 300 s
      });
      ADD_FAILURE() << "no exception";
    } catch (const std::exception& e) {
      // The first to throw: rank 1 itself, or a peer released by its failure.
      EXPECT_TRUE(contains(e.what(), "boom on rank 1")) << e.what();
    }
  });
  EXPECT_LT(took, 30.0);
}

TEST(Local, SendRecvMismatchNamesBoth) {
  const ScopedHealthOptions backend_checks_only{{}};  // this tests the local backend's own check
  auto comms = make_local_group(2);
  comms[0]->send(at::ones({4}), 1)->wait();  // buffered: done without a recv
  std::string e = error_of(comms[1]->recv(at::zeros({5}), 0));
  EXPECT_TRUE(contains(e, "rank 0 sent Float[4], rank 1 receives into Float[5]")) << e;
}

TEST(Local, RecvSkipsOtherTagsAndSources) {
  auto comms = make_local_group(3);
  SendOptions s1, s2;
  s1.tag = 1;
  s2.tag = 2;
  comms[0]->send(at::full({2}, 1.0), 2, s1)->wait();
  comms[1]->send(at::full({2}, 5.0), 2, s2)->wait();
  comms[0]->send(at::full({2}, 2.0), 2, s2)->wait();
  RecvOptions r2;
  r2.tag = 2;
  at::Tensor got = at::zeros({2});
  comms[2]->recv(got, 0, r2)->wait();
  EXPECT_TRUE(at::equal(got, at::full({2}, 2.0)));
  comms[2]->recv(got, 1, r2)->wait();
  EXPECT_TRUE(at::equal(got, at::full({2}, 5.0)));
  RecvOptions r1;
  r1.tag = 1;
  comms[2]->recv(got, 0, r1)->wait();
  EXPECT_TRUE(at::equal(got, at::full({2}, 1.0)));
}

TEST(Local, OpsCompleteInIssueOrder) {
  constexpr int kOps = 50;
  run_local_ranks(3, [&](int rank, Communicator& c) {
    std::vector<at::Tensor> ts;
    std::vector<WorkPtr> ws;
    for (int i = 0; i < kOps; ++i) {
      ts.push_back(at::full({17}, i + rank, at::kLong));
      ws.push_back(c.allreduce(ts.back()));
    }
    ws.back()->wait();
    for (int i = 0; i < kOps; ++i) {
      EXPECT_TRUE(ws[i]->done()) << "op " << i << " not done after the last one";
      EXPECT_TRUE(at::equal(ts[i], at::full({17}, 3 * i + 3, at::kLong))) << "op " << i;
    }
  });
}

TEST(Local, TwoGroupsAtOnce) {
  auto group = [](int n, int rounds, int base) {
    run_local_ranks(n, [&](int rank, Communicator& c) {
      for (int i = 0; i < rounds; ++i) {
        at::Tensor t = at::full({33}, base + rank, at::kInt);
        c.allreduce(t)->wait();
        const int want = n * base + n * (n - 1) / 2;
        EXPECT_TRUE(at::equal(t, at::full({33}, want, at::kInt))) << "group of " << n << " round " << i;
      }
    });
  };
  std::thread a([&] { group(3, 200, 100); });
  std::thread b([&] { group(4, 200, 1000); });
  a.join();
  b.join();
}

TEST(Local, WorkIsNotDoneBeforeThePeersJoin) {
  auto comms = make_local_group(2);
  at::Tensor a = at::ones({100}), b = at::ones({100});
  WorkPtr w0 = comms[0]->allreduce(a);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(w0->done());
  EXPECT_TRUE(at::equal(a, at::ones({100})));  // nothing happened yet
  WorkPtr w1 = comms[1]->allreduce(b);
  w0->wait();
  w1->wait();
  EXPECT_TRUE(w0->done());
  EXPECT_TRUE(at::equal(a, at::full({100}, 2.0)));
  EXPECT_TRUE(at::equal(b, at::full({100}, 2.0)));
}

// In-place broadcast into a parameter (a leaf that requires grad) works.
TEST(Local, BroadcastIntoParameters) {
  run_local_ranks(3, [](int rank, Communicator& c) {
    at::Tensor p = at::full({6}, rank, at::kFloat).set_requires_grad(true);
    c.broadcast(p)->wait();
    EXPECT_TRUE(at::equal(p.detach(), at::zeros({6})));
    at::Tensor g = at::full({6}, rank, at::kFloat).set_requires_grad(true);
    AllreduceOptions o;
    o.op = ReduceOp::kAvg;
    c.allreduce(g, o)->wait();
    EXPECT_TRUE(at::equal(g.detach(), at::full({6}, 1.0)));
  });
}

// In-place variants that alias the output with the input.
TEST(Local, InPlaceReduceScatterAndAllgather) {
  run_local_ranks(4, [](int rank, Communicator& c) {
    // reduce_scatter into this rank's own chunk of its input.
    at::Tensor buf = at::arange(12, at::kFloat) + rank;
    at::Tensor mine = buf.narrow(0, 3 * rank, 3);
    c.reduce_scatter(buf, mine)->wait();
    at::Tensor want = (at::arange(12, at::kFloat) * 4 + 6).narrow(0, 3 * rank, 3);
    EXPECT_TRUE(at::equal(mine, want)) << mine;
    // allgather from this rank's own chunk of the output.
    at::Tensor out = at::zeros({8}, at::kInt);
    out.narrow(0, 2 * rank, 2).fill_(rank + 1);
    c.allgather(out.narrow(0, 2 * rank, 2), out)->wait();
    EXPECT_TRUE(at::equal(out, at::tensor({1, 1, 2, 2, 3, 3, 4, 4}, at::kInt))) << out;
  });
}

// Sub-communicators run at the same time as each other and as their parent.
TEST(Local, SplitGroupsRunConcurrently) {
  run_local_ranks(6, [](int rank, Communicator& c) {
    CommunicatorPtr sub = c.split(rank % 3, rank);
    ASSERT_TRUE(sub);
    EXPECT_EQ(sub->size(), 2);
    std::vector<WorkPtr> ws;
    std::vector<at::Tensor> ts;
    for (int i = 0; i < 20; ++i) {
      ts.push_back(at::full({5}, rank, at::kInt));
      ws.push_back(sub->allreduce(ts.back()));
      ts.push_back(at::full({5}, 1, at::kInt));
      ws.push_back(c.allreduce(ts.back()));
    }
    for (auto& w : ws) w->wait();
    const int pair = (rank % 3) * 2 + 3;  // rank%3 + (rank%3 + 3)
    for (int i = 0; i < 20; ++i) {
      EXPECT_TRUE(at::equal(ts[2 * i], at::full({5}, pair, at::kInt)));
      EXPECT_TRUE(at::equal(ts[2 * i + 1], at::full({5}, 6, at::kInt)));
    }
  });
}

}  // namespace
}  // namespace tetra::collectives
