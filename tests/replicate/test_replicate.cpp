// The numerics contract for replication: with the same seed and global batch, R replica
// threads per process — alone, times data-parallel processes, and inside pipeline x data
// x ZeRO meshes — follow the single-process run at every step (relative 1e-5 in fp32)
// and end with the same parameters; plain SGD without clipping for the first cases (a
// sum instead of an average doubles every update). Then the Replicator's programming
// model: a loop of one's own, its cross-replica ops, and failures that end as errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <vector>

#include "collectives/error.h"
#include "collectives/local.h"
#include "core/plan.h"
#include "replicate/replicate.h"
#include "tests/common/error_of.h"
#include "tests/common/numerics.h"

using namespace tetra;
using namespace tetra::core;
using numerics::expect_follows;
using numerics::Outcome;
using numerics::run_parallel;
using numerics::run_single;
using testing_errors::error_of;

namespace {

const char* kMlp = R"(
model: {type: mlp, hidden: [64, 32]}
data: {type: fashion-mnist, batch_size: 96, eval_samples: 300}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: 12, seed: 5, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

const std::string kGpt = std::string(R"(
model: {type: gpt, layers: 2, d_model: 32, heads: 2}
data: {type: text, path: )") + TETRA_SOURCE_DIR + R"(/README.md, seq_len: 16, batch_size: 16, eval_samples: 32}
optimizer: {type: sgd, lr: 0.1, momentum: 0.9}
train: {max_steps: 6, seed: 5, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

const char* kCnn = R"(
model: {type: cnn, channels: [4, 8], hidden: [32]}
data: {type: fashion-mnist, batch_size: 48, eval_samples: 100}
optimizer: {type: sgd, lr: 0.05, momentum: 0.9}
train: {max_steps: 6, seed: 5, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

}  // namespace

// ---- the numerics contract ---------------------------------------------------------------

TEST(Replicate, ReplicasAloneFollowOneProcessWithPlainSgd) {
  const Outcome ref = run_single(kMlp);
  for (int R : {2, 3}) {
    const Outcome got = run_parallel(kMlp, 1, {"replicate.replicas=" + std::to_string(R)});
    expect_follows(ref, got, 1e-5, std::to_string(R) + " replicas");
    // Each replica a data rank: it trained on 1/R of the batch, not all of it.
    EXPECT_EQ(got.data_ranks, std::vector<int>(static_cast<size_t>(R), R));
  }
}

TEST(Replicate, ReplicasTimesDataProcessesFollowOneProcess) {
  const Outcome ref = run_single(kMlp);
  const Outcome four = run_parallel(kMlp, 2, {"mesh.data=2", "replicate.replicas=2"});
  expect_follows(ref, four, 1e-5, "data 2 x 2 replicas");
  EXPECT_EQ(four.data_ranks, std::vector<int>(4, 4));
  expect_follows(ref, run_parallel(kMlp, 2, {"mesh.data=2", "replicate.replicas=3", "train.accumulation_steps=2",
                                             "data_parallel.bucket_mb=0.01"}),
                 1e-5, "data 2 x 3 replicas, accumulation 2, small buckets");
}

TEST(Replicate, ZeroStagesOverReplicasFollowOneProcess) {
  const Outcome ref = run_single(kMlp);
  for (int stage : {1, 2, 3})
    expect_follows(ref, run_parallel(kMlp, 1, {"replicate.replicas=2", "zero.stage=" + std::to_string(stage)}), 1e-5,
                   "zero " + std::to_string(stage) + " over 2 replicas");
  expect_follows(ref, run_parallel(kMlp, 2, {"mesh.data=2", "replicate.replicas=2", "zero.stage=3"}), 1e-5,
                 "zero 3 over data 2 x 2 replicas");
}

// The composition this issue ends with: pipeline 2 x data 2 x ZeRO x 2 replicas, 8
// replicas in 4 processes.
TEST(Replicate, PipelineTimesDataTimesZeroTimesReplicasFollowsOneProcess) {
  const Outcome ref = run_single(kMlp);
  for (int stage : {1, 2, 3})
    expect_follows(ref,
                   run_parallel(kMlp, 4, {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4",
                                          "zero.stage=" + std::to_string(stage), "replicate.replicas=2"}),
                   1e-5, "pipeline 2 x data 2 x zero " + std::to_string(stage) + " x 2 replicas");
}

TEST(Replicate, GptAndCnnFollowOneProcess) {
  expect_follows(run_single(kGpt), run_parallel(kGpt, 2, {"mesh.pipeline=2", "pipeline.micro_batches=2", "replicate.replicas=2"}),
                 1e-5, "gpt: pipeline 2 x 2 replicas");
  expect_follows(run_single(kCnn), run_parallel(kCnn, 1, {"replicate.replicas=3"}), 1e-5, "cnn: 3 replicas");
}

// Dropout masks are keyed by (seed, step, global sample, layer), so replicas, data ranks
// and micro-batches draw the same masks as one process (core/random.h).
TEST(Replicate, DropoutFollowsOneProcess) {
  const std::vector<std::string> mlp = {"model.dropout=0.3"};
  expect_follows(run_single(kMlp, mlp),
                 run_parallel(kMlp, 2, {"model.dropout=0.3", "mesh.data=2", "replicate.replicas=2", "train.accumulation_steps=2"}),
                 1e-5, "mlp dropout 0.3: data 2 x 2 replicas x accumulation 2");
  expect_follows(run_single(kGpt, {"model.dropout=0.2"}),
                 run_parallel(kGpt, 2, {"model.dropout=0.2", "mesh.pipeline=2", "pipeline.micro_batches=2",
                                        "pipeline.checkpoint=always", "replicate.replicas=2"}),
                 1e-5, "gpt dropout 0.2: pipeline 2 (recomputed) x 2 replicas");
}

// bf16 autocast: each replica's matmuls reduce over its own slice of the batch in bf16,
// so the order of the roundings differs from one process's; the tolerance is bf16's
// (8 bits of mantissa: 2^-8 = 0.4% per rounding, a few of them per step).
TEST(Replicate, Bf16FollowsOneProcessBf16WithinItsTolerance) {
  const Outcome ref = run_single(kMlp, {"train.precision=bf16"});
  expect_follows(ref, run_parallel(kMlp, 1, {"train.precision=bf16", "replicate.replicas=2"}), 2e-2, "bf16, 2 replicas");
}

// A checkpoint holds the whole model under one process's names (a file per rank of the
// job: processes x replicas), so a run of replicas resumes on one process and the other
// way round, and follows the uninterrupted run.
TEST(Replicate, CheckpointsOfReplicasResumeOnOneProcessAndBack) {
  const Outcome whole = run_single(kMlp);
  const std::string dir = ::testing::TempDir() + "/tetra_replicate_ckpt_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  const std::vector<std::string> ck = {"checkpoint.dir=" + dir, "checkpoint.every_steps=6"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), ck.begin(), ck.end());
    return more;
  };
  run_parallel(kMlp, 2, with({"mesh.data=2", "replicate.replicas=2", "train.max_steps=6"}));
  const Outcome resumed = run_single(kMlp, with({}));  // steps 7..12 on one process
  ASSERT_EQ(resumed.result.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i)
    EXPECT_NEAR(resumed.result.losses[i], whole.result.losses[6 + i], 1e-5 * whole.result.losses[6 + i]) << "step " << 7 + i;
  std::filesystem::remove_all(dir);
  run_single(kMlp, with({"train.max_steps=6"}));
  const Outcome back = run_parallel(kMlp, 1, with({"replicate.replicas=3"}));  // steps 7..12 on 3 replicas
  ASSERT_EQ(back.result.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i)
    EXPECT_NEAR(back.result.losses[i], whole.result.losses[6 + i], 1e-5 * whole.result.losses[6 + i]) << "step " << 7 + i;
  Outcome end_whole = whole, end_back = back;  // the parameters at step 12 (the losses are above)
  end_whole.result.losses.clear();
  end_back.result.losses.clear();
  expect_follows(end_whole, end_back, 1e-5, "resumed on 3 replicas: parameters");
  std::filesystem::remove_all(dir);
}

// ---- the plan ------------------------------------------------------------------------------

TEST(Replicate, PlanWidensTheDataGroupAndChecksTheBatchAgainstIt) {
  const Plan plan(numerics::job(kMlp, {"mesh.data=2", "replicate.replicas=3", "train.accumulation_steps=2"}));
  EXPECT_EQ(plan.replicas(), 3);
  EXPECT_EQ(plan.data_ranks(), 6);
  EXPECT_EQ(plan.process_count(), 2);
  EXPECT_EQ(plan.micro_batch_size(), 8);
  EXPECT_EQ(plan.batch_equation(),
            "96 global = 6 data-parallel ranks (mesh.data 2 x replicate.replicas 3) x 2 micro-batches "
            "(train.accumulation_steps) x 8");
  const std::string e = error_of([] { numerics::job(kMlp, {"replicate.replicas=5"}); });
  EXPECT_NE(e.find("data.batch_size 96 does not split into 5 data-parallel ranks (mesh.data 1 x replicate.replicas 5) x "
                   "1 micro-batch: 96 / 5 = 19.20 samples each; make the global batch a multiple of 5"),
            std::string::npos)
      << e;
  const std::string z = error_of([] { numerics::job(kMlp, {"zero.stage=2"}); });
  EXPECT_NE(z.find("error: zero.stage: zero shards the optimizer state, the gradients over the data group (stage 2), so "
                   "it needs more than one rank on the data axis, but there is 1"),
            std::string::npos)
      << z;
  EXPECT_EQ(error_of([] { numerics::job(kMlp, {"zero.stage=2", "replicate.replicas=2"}); }), "");
}

// ---- the Replicator: a loop of one's own -------------------------------------------------

// Least squares by hand: each replica computes the gradient of its slice of the batch,
// averages it over the replicas with all_reduce_mean and steps. The weights must equal
// one process doing the whole batch.
TEST(Replicator, ACustomLoopFollowsOneProcess) {
  const int64_t N = 24, F = 5;
  at::manual_seed(3);
  const at::Tensor X = at::randn({N, F}, at::kDouble), y = at::randn({N, 1}, at::kDouble);
  auto grad = [](const at::Tensor& x, const at::Tensor& t, const at::Tensor& w) {
    return x.t().matmul(x.matmul(w) - t) * (2.0 / static_cast<double>(x.size(0)));
  };
  at::Tensor w_ref = at::zeros({F, 1}, at::kDouble);
  for (int step = 0; step < 10; ++step) w_ref -= 0.05 * grad(X, y, w_ref);

  for (int R : {2, 3, 4}) {
    replicate::ReplicatorOptions o;
    o.replicas = R;
    replicate::Replicator repl(o);
    ASSERT_EQ(repl.num_replicas(), R);
    std::vector<at::Tensor> w;  // each replica's own copy of the weights
    for (int r = 0; r < R; ++r) w.push_back(at::zeros({F, 1}, at::kDouble));
    struct Slice {
      at::Tensor x, t;
    };
    for (int step = 0; step < 10; ++step) {
      auto losses = repl.run<Slice, double>(
          [&](replicate::ReplicaContext& ctx) {
            const int64_t per = N / ctx.num_replicas(), at0 = per * ctx.replica_id();
            return Slice{X.narrow(0, at0, per), y.narrow(0, at0, per)};
          },
          [&](replicate::ReplicaContext& ctx, Slice& s) {
            at::Tensor& wr = w[static_cast<size_t>(ctx.local_replica_id())];
            wr -= 0.05 * ctx.all_reduce_mean(grad(s.x, s.t, wr));
            return (s.x.matmul(wr) - s.t).pow(2).sum().item<double>();
          });
      ASSERT_EQ(losses.values.size(), static_cast<size_t>(R));
      const double total = repl.reduce(collectives::ReduceOp::kSum, losses);
      const double whole = (X.matmul(w[0]) - y).pow(2).sum().item<double>();
      EXPECT_NEAR(total, whole, 1e-9 * whole) << R << " replicas, step " << step;
    }
    for (int r = 0; r < R; ++r)
      EXPECT_TRUE(at::allclose(w[static_cast<size_t>(r)], w_ref, 1e-12, 1e-12)) << R << " replicas, replica " << r;
  }
}

// The cross-replica ops, for every replica count 1..8 and every dtype: results equal what
// plain torch computes from every replica's value.
TEST(Replicator, CrossReplicaOpsAtEveryReplicaCountAndDtype) {
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                              at::kInt,   at::kLong,   at::kByte};
  for (int R = 1; R <= 8; ++R) {
    replicate::ReplicatorOptions o;
    o.replicas = R;
    replicate::Replicator repl(o);
    for (at::ScalarType dt : dtypes) {
      const bool floating = at::isFloatingType(dt);
      // Replica k's value: small integers, exact in every dtype for sums of 8.
      auto value = [&](int k) { return ((at::arange(7, at::kLong) * 3 + k * 5) % 11).to(dt); };
      at::Tensor sum = at::zeros({7}, at::kLong), mx = value(0).to(at::kLong), mn = mx.clone(), prod = at::ones({7}, at::kLong);
      at::Tensor stacked = at::stack([&] {
        std::vector<at::Tensor> v;
        for (int k = 0; k < R; ++k) v.push_back(value(k));
        return v;
      }());
      for (int k = 0; k < R; ++k) {
        sum += value(k).to(at::kLong);
        mx = at::maximum(mx, value(k).to(at::kLong));
        mn = at::minimum(mn, value(k).to(at::kLong));
        prod *= ((value(k).to(at::kLong) % 2) + 1);
      }
      std::atomic<int> bad{0};
      repl.run<int, int>([](replicate::ReplicaContext&) { return 0; },
                         [&](replicate::ReplicaContext& ctx, int&) {
                           const int k = ctx.replica_id();
                           auto same = [&](const at::Tensor& got, const at::Tensor& want) {
                             if (got.scalar_type() != dt || !at::equal(got.to(at::kLong), want.to(at::kLong))) ++bad;
                           };
                           same(ctx.all_reduce_sum(value(k)), sum.to(dt));
                           same(ctx.all_reduce(value(k), collectives::ReduceOp::kMax), mx.to(dt));
                           same(ctx.all_reduce(value(k), collectives::ReduceOp::kMin), mn.to(dt));
                           same(ctx.all_reduce(((value(k).to(at::kLong) % 2) + 1).to(dt), collectives::ReduceOp::kProd),
                                prod.to(dt));
                           if (floating) {
                             at::Tensor mean = ctx.all_reduce_mean(value(k)).to(at::kDouble);
                             at::Tensor want = sum.to(at::kDouble) / R;
                             if (!at::allclose(mean, want, 1e-2, 1e-2)) ++bad;
                           }
                           at::Tensor gathered = ctx.all_gather(value(k));
                           if (!gathered.sizes().equals(stacked.sizes()) || !at::equal(gathered, stacked)) ++bad;
                           for (int root = 0; root < R; ++root)
                             same(ctx.broadcast(value(k), root), value(root));
                           return 0;
                         });
      EXPECT_EQ(bad.load(), 0) << R << " replicas, dtype " << at::toString(dt);
    }
  }
}

// A replica that throws ends run() with its error at once: the others, waiting for it in
// a collective, are released with an error naming it — not a hang, not a timeout.
TEST(Replicator, AFailingReplicaIsAnErrorNotAHang) {
  replicate::ReplicatorOptions o;
  o.replicas = 3;
  replicate::Replicator repl(o);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] {
    repl.run<int, int>([](replicate::ReplicaContext&) { return 0; },
                       [](replicate::ReplicaContext& ctx, int&) {
                         if (ctx.replica_id() == 1) throw std::runtime_error("replica one's input is broken");
                         ctx.all_reduce_sum(at::ones({4}));
                         return 0;
                       });
  });
  EXPECT_NE(e.find("replica one's input is broken"), std::string::npos) << e;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST(Replicate, PlacementGivesEachReplicaItsOwnCoresOrSaysWhyNot) {
  for (int R : {1, 2, 64}) {
    const std::vector<replicate::Placement> p = replicate::place_replicas(R);
    ASSERT_EQ(p.size(), static_cast<size_t>(R));
    for (const auto& x : p) {
      EXPECT_GE(x.threads, 1);
      EXPECT_TRUE(!x.cpus.empty() || !x.why.empty()) << "replica of " << R;
    }
    if (R == 64) {
      EXPECT_NE(p[0].why.find("for 64 replicas"), std::string::npos) << p[0].why;
    }
  }
}
