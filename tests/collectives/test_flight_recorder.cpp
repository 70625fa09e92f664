// The flight recorder, collective fingerprints, stall warnings and the analysis of dumps,
// over thread-ranks (the local backend): what each rank recorded, a rank that calls
// another op or shape or skips one named by the fingerprints, a rank that never comes
// named by the stall warning, the timeout and the dump's analysis.
#include "collectives/flight_recorder.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "collectives/local.h"
#include "collectives/watchdog.h"
#include "tests/collectives/conformance.h"

namespace tetra::collectives {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;


using conformance::contains;
using conformance::error_of;

HealthOptions checked(Duration stall = Duration(0)) {
  HealthOptions h;
  h.check = true;
  h.stall_warning = stall;
  return h;
}

TEST(FlightRecorder, RecordsEveryOpWithItsSequenceAndState) {
  auto comms = make_local_group(2, "pair");
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      Communicator& c = *comms[static_cast<size_t>(r)];
      c.allreduce(at::ones({3, 4}))->wait();
      if (r == 0) c.send(at::ones({5}), 1, {7})->wait();
      else c.recv(at::zeros({5}), 0, {7})->wait();
      c.barrier()->wait();
    });
  for (auto& t : ts) t.join();
  const std::vector<OpRecord> ops = comms[1]->recorder()->snapshot();
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[0].op, "allreduce sum");
  EXPECT_EQ(ops[0].seq, 1);
  EXPECT_EQ(ops[0].dtype, "Float");
  EXPECT_EQ(ops[0].shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(ops[0].bytes, 48);
  EXPECT_EQ(ops[0].state, OpState::kFinished);
  EXPECT_TRUE(ops[0].started_us >= ops[0].queued_us && ops[0].ended_us >= ops[0].started_us);
  EXPECT_TRUE(ops[1].p2p);
  EXPECT_EQ(ops[1].peer, 0);
  EXPECT_EQ(ops[1].tag, 7);
  EXPECT_EQ(ops[1].seq, 1);  // the first receive from 0 with tag 7
  EXPECT_EQ(ops[2].op, "barrier");
  EXPECT_EQ(ops[2].seq, 2);  // collectives count on their own
  ASSERT_TRUE(ops[0].group);
  EXPECT_EQ(ops[0].group->identity, comms[0]->group()->identity);
  EXPECT_EQ(ops[0].group->rank, 1);
}

TEST(FlightRecorder, SplitsShareTheRootsRecorderAndAgreeOnTheirIdentity) {
  auto comms = make_local_group(4, "world");
  std::vector<CommunicatorPtr> halves(4);
  std::vector<std::thread> ts;
  for (int r = 0; r < 4; ++r)
    ts.emplace_back([&, r] { halves[static_cast<size_t>(r)] = comms[static_cast<size_t>(r)]->split(r % 2, r, "half"); });
  for (auto& t : ts) t.join();
  EXPECT_EQ(halves[0]->recorder(), comms[0]->recorder());
  EXPECT_EQ(halves[0]->group()->identity, halves[2]->group()->identity);
  EXPECT_NE(halves[0]->group()->identity, halves[1]->group()->identity);
  EXPECT_EQ(comms[0]->recorder()->snapshot().back().op, "split");  // the same op on every member, whatever its color
}

TEST(FlightRecorder, TheRingKeepsTheNewest) {
  FlightRecorder rec("rank 0", 4);
  for (int i = 1; i <= 10; ++i) {
    OpRecord r;
    r.op = "barrier";
    r.seq = i;
    rec.ended(rec.record(r));
  }
  const auto ops = rec.snapshot();
  ASSERT_EQ(ops.size(), 4u);
  EXPECT_EQ(ops.front().seq, 7);
  EXPECT_EQ(ops.back().seq, 10);
  OpRecord gone;
  EXPECT_FALSE(rec.snapshot_of(2, gone));
}

// ---- fingerprints ------------------------------------------------------------------------

TEST(Fingerprints, ARankThatCallsAnotherOpIsNamedOnEveryRank) {
  const ScopedHealthOptions on(checked());
  std::vector<std::string> errors(3);
  run_local_ranks(3, [&](int rank, Communicator& c) {
    WorkPtr w = rank == 2 ? c.allgather(at::ones({2}), at::zeros({6})) : c.allreduce(at::ones({2}));
    errors[static_cast<size_t>(rank)] = error_of(w);
  });
  for (const std::string& e : errors) {
    EXPECT_TRUE(contains(e, "collectives.check")) << e;
    EXPECT_TRUE(contains(e, "ranks 0, 1 called allreduce sum #1 Float[2]")) << e;
    EXPECT_TRUE(contains(e, "rank 2 called allgather #1 Float[2]")) << e;
  }
}

TEST(Fingerprints, ARankThatSkipsACollectiveIsNamed) {
  const ScopedHealthOptions on(checked());
  std::vector<std::string> errors(3);
  run_local_ranks(3, [&](int rank, Communicator& c) {
    try {
      if (rank != 1) c.allreduce(at::ones({4}))->wait();  // rank 1 skips it
      c.broadcast(at::ones({4}))->wait();
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(rank)] = e.what();
    }
  });
  EXPECT_TRUE(contains(errors[0], "ranks 0, 2 called allreduce sum #1 Float[4]; rank 1 called broadcast from 0 #1 Float[4]"))
      << errors[0];
  EXPECT_TRUE(contains(errors[1], "rank 1 called broadcast from 0 #1")) << errors[1];
}

TEST(Fingerprints, ADifferentShapeIsNamedBeforeAnyByteMoves) {
  const ScopedHealthOptions on(checked());
  std::vector<std::string> errors(2);
  std::vector<at::Tensor> xs = {at::full({2, 3}, 1.0), at::full({3, 2}, 2.0)};
  run_local_ranks(2, [&](int rank, Communicator& c) { errors[static_cast<size_t>(rank)] = error_of(c.allreduce(xs[static_cast<size_t>(rank)])); });
  EXPECT_TRUE(contains(errors[0], "rank 0 called allreduce sum #1 Float[2, 3]; rank 1 called allreduce sum #1 Float[3, 2]"))
      << errors[0];
  // Same numel, so without the check the sums would have mixed the layouts silently.
  EXPECT_TRUE(at::equal(xs[0], at::full({2, 3}, 1.0)));
}

TEST(Fingerprints, AReceiveOfAnotherShapeNamesTheSend) {
  const ScopedHealthOptions on(checked());
  std::string error;
  run_local_ranks(2, [&](int rank, Communicator& c) {
    if (rank == 0) c.send(at::ones({4}), 1, {3})->wait();
    else error = error_of(c.recv(at::zeros({2, 2}), 0, {3}));
  });
  EXPECT_TRUE(contains(error, "rank 1 expects send #1 Float[2, 2] from rank 0, which sent send #1 Float[4]")) << error;
}

TEST(Fingerprints, MatchingOpsPassAndGiveTheSameResults) {
  const ScopedHealthOptions on(checked());
  run_local_ranks(4, [&](int rank, Communicator& c) {
    at::Tensor x = at::full({5}, static_cast<double>(rank + 1));
    c.allreduce(x)->wait();
    EXPECT_TRUE(at::equal(x, at::full({5}, 10.0)));
    at::Tensor out = at::zeros({4});
    c.reduce_scatter(at::ones({16}), out)->wait();
    EXPECT_TRUE(at::equal(out, at::full({4}, 4.0)));
    if (rank % 2 == 0) c.send(at::full({2}, 1.0 * rank), rank + 1, {1})->wait();
    else {
      at::Tensor y = at::zeros({2});
      c.recv(y, rank - 1, {1})->wait();
      EXPECT_TRUE(at::equal(y, at::full({2}, 1.0 * (rank - 1))));
    }
  });
}

// ---- stalls, timeouts, dumps ---------------------------------------------------------------

TEST(Stalls, AWaitingRankIsToldWhoHasNotJoinedAndTheTimeoutSaysItToo) {
  const fs::path dir = fs::path(testing::TempDir()) / ("flight_stall_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  FlightRecorder::set_dump_dir(dir.string());
  const ScopedHealthOptions on(checked(300ms));
  std::vector<std::string> errors(2);
  testing::internal::CaptureStderr();
  run_local_ranks(3, [&](int rank, Communicator& c) {
    c.barrier()->wait();
    if (rank == 2) {
      // Rank 2 is busy elsewhere (a long compute) and never comes to the allreduce.
      std::this_thread::sleep_for(2500ms);
      return;
    }
    AllreduceOptions o;
    o.timeout = 1500ms;
    errors[static_cast<size_t>(rank)] = error_of(c.allreduce(at::ones({8}), o));
  });
  const std::string err = testing::internal::GetCapturedStderr();
  FlightRecorder::set_dump_dir("");
  // The warning came while it happened, before the timeout.
  EXPECT_TRUE(contains(err, "tetra: stall: rank 0")) << err;
  EXPECT_TRUE(contains(err, "in allreduce sum #2 on local")) << err;
  EXPECT_TRUE(contains(err, "ranks 0, 1 of 3 entered it; not yet: rank 2")) << err;
  EXPECT_TRUE(contains(err, "is at #1 on this group")) << err;  // rank 2 stopped after the barrier
  // The timeout names the same, and where the dump is (on the rank that timed out first;
  // the local backend then releases the other with that rank's failure).
  const std::string timeout_error = contains(errors[0], "did not join") && !contains(errors[0], "aborted") ? errors[0] : errors[1];
  EXPECT_TRUE(contains(timeout_error, "not yet: rank 2")) << timeout_error;
  EXPECT_TRUE(contains(timeout_error, "flight recorder: " + dir.string())) << timeout_error;
  // The dump's analysis says it without the live process.
  std::vector<nlohmann::json> dumps;
  for (const auto& f : fs::directory_iterator(dir)) {
    std::ifstream in(f.path());
    dumps.push_back(nlohmann::json::parse(in));
  }
  ASSERT_EQ(dumps.size(), 1u);  // one file per process
  const std::string analysis = analyze(dumps);
  EXPECT_TRUE(contains(analysis, "never entered allreduce sum #2 on local")) << analysis;
  EXPECT_TRUE(contains(analysis, "its last op was barrier #1")) << analysis;
}

TEST(Stalls, AReceiveWaitingForASendNamesThePeer) {
  const ScopedHealthOptions on(checked(200ms));
  testing::internal::CaptureStderr();
  run_local_ranks(2, [&](int rank, Communicator& c) {
    if (rank == 1) {
      RecvOptions o;
      o.timeout = 1200ms;
      error_of(c.recv(at::zeros({3}), 0, o));
    } else {
      std::this_thread::sleep_for(1500ms);
    }
  });
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(contains(err, "tetra: stall: rank 1")) << err;
  EXPECT_TRUE(contains(err, "the peer, rank 0 (rank 0, host")) << err;
  EXPECT_TRUE(contains(err, "has sent 0 to this rank so far")) << err;
}

// ---- the analysis of several processes' dumps ---------------------------------------------

OpRecord op(const std::shared_ptr<GroupInfo>& g, const std::string& name, int64_t seq, OpState state, int64_t started,
            int peer = -1) {
  OpRecord r;
  r.group = g;
  r.op = name;
  r.seq = seq;
  r.state = state;
  r.started_us = started;
  r.peer = peer;
  r.p2p = peer >= 0;
  r.dtype = "Float";
  r.shape = {1024};
  return r;
}

nlohmann::json dump_of(int rank, const std::vector<OpRecord>& ops, int64_t now) {
  nlohmann::json entries = nlohmann::json::array();
  for (const auto& o : ops) entries.push_back(to_json(o));
  return {{"reason", "timeout"}, {"host", "node" + std::to_string(rank / 2)}, {"pid", 100 + rank}, {"time_us", now},
          {"recorders", {{{"owner", "rank " + std::to_string(rank)}, {"entries", entries}}}}};
}

TEST(Analyze, NamesTheRankThatNeverEnteredAndWhatItDidInstead) {
  const int64_t now = 1'000'000'000'000;
  std::vector<std::shared_ptr<GroupInfo>> data(4), pipe(4);
  for (int r = 0; r < 4; ++r) {
    data[r] = std::make_shared<GroupInfo>(GroupInfo{"data", "mpi:job/1.0", true, "mpi", r, 4});
    pipe[r] = std::make_shared<GroupInfo>(GroupInfo{"pipeline", "mpi:job/2." + std::to_string(r / 2), true, "mpi", r % 2, 2});
  }
  std::vector<nlohmann::json> dumps;
  for (int r = 0; r < 3; ++r)
    dumps.push_back(dump_of(r, {op(data[r], "allreduce sum", 1841, OpState::kFinished, now - 70'000'000),
                                op(data[r], "allreduce sum", 1842, OpState::kStarted, now - 63'000'000)}, now));
  dumps.push_back(dump_of(3, {op(data[3], "allreduce sum", 1841, OpState::kFinished, now - 70'000'000),
                              op(pipe[3], "send to 0 tag 0", 77, OpState::kStarted, now - 62'000'000, 0)}, now));
  const std::string a = analyze(dumps);
  EXPECT_TRUE(contains(a, "rank 3 (host node1, pid 103) never entered allreduce sum #1842 on data")) << a;
  EXPECT_TRUE(contains(a, "waiting 63 s")) << a;
  EXPECT_TRUE(contains(a, "its last op was send to 0 tag 0 #77 on pipeline Float[1024] (running for 62 s)")) << a;
}

TEST(Analyze, NamesDisagreeingOpsAndMissingDumps) {
  const int64_t now = 2'000'000'000'000;
  std::vector<std::shared_ptr<GroupInfo>> g(3);
  for (int r = 0; r < 3; ++r) g[r] = std::make_shared<GroupInfo>(GroupInfo{"data", "gloo:x", true, "gloo", r, 3});
  std::vector<nlohmann::json> dumps;
  dumps.push_back(dump_of(0, {op(g[0], "allreduce sum", 5, OpState::kStarted, now - 9'000'000)}, now));
  OpRecord other = op(g[1], "allgather", 5, OpState::kStarted, now - 9'000'000);
  dumps.push_back(dump_of(1, {other}, now));  // rank 2 left no dump (it died)
  const std::string a = analyze(dumps);
  EXPECT_TRUE(contains(a, "called different ops as #5")) << a;
  EXPECT_TRUE(contains(a, "rank 2 of the group of data left no dump")) << a;
}

}  // namespace
}  // namespace tetra::collectives
