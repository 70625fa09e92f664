// The numerics contract for data parallelism: with the same seed and global batch, N
// data-parallel thread-ranks (over the local backend) follow the single-process loss at
// every step within float reduction-order error, whatever the buckets, overlap,
// accumulation or hierarchy; compression follows within its documented tolerance.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "collectives/error.h"
#include "collectives/local.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "data_parallel/data_parallel.h"
#include "tests/common/numerics.h"

using namespace tetra;
using namespace tetra::core;

namespace {

const char* kJob = R"(
model: {type: mlp, hidden: [64, 32]}
data: {type: fashion-mnist, batch_size: 96, eval_samples: 600}
optimizer: {type: adamw, lr: 2.0e-3, weight_decay: 0.01, clip_grad_norm: 1.0}
schedule: {type: cosine, warmup_steps: 5}
train: {max_steps: 25, seed: 5, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

// One name for every run here (numerics' "job"): a checkpoint resumes only its own job.
JobSpec job(std::vector<std::string> sets) { return numerics::job(kJob, sets); }

// The shared harness (tests/common/numerics.h): losses and the final evaluation here
// (AdamW with clipping); parameters too in the plain-SGD test below.
TrainResult single(std::vector<std::string> sets = {}) { return numerics::run_single(kJob, sets).result; }

// Runs the job on n thread-ranks; returns rank 0's result (and checks all ranks agree).
TrainResult parallel(int n, std::vector<std::string> sets) {
  sets.push_back("mesh.data=" + std::to_string(n));
  return numerics::run_parallel(kJob, n, sets).result;
}

void expect_follows(const TrainResult& ref, const TrainResult& got, double rel) {
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], rel * std::abs(ref.losses[i])) << "step " << i + 1;
  ASSERT_TRUE(ref.final_eval && got.final_eval);
  EXPECT_NEAR(*got.final_eval->accuracy, *ref.final_eval->accuracy, 2.0 / 600 + 1e-9);
}

}  // namespace

// Plain SGD without clipping, parameters compared: gradients summed instead of averaged
// would double every update.
TEST(DataParallel, PlainSgdFollowsOneProcessParametersToo) {
  const std::vector<std::string> sgd = {"optimizer.type=sgd", "optimizer.lr=0.05", "optimizer.weight_decay=0",
                                        "optimizer.clip_grad_norm=0"};
  const numerics::Outcome ref = numerics::run_single(kJob, sgd);
  for (int n : {2, 3}) {
    auto sets = sgd;
    sets.push_back("mesh.data=" + std::to_string(n));
    numerics::expect_follows(ref, numerics::run_parallel(kJob, n, sets), 1e-5, std::to_string(n) + " ranks, sgd");
  }
}

TEST(DataParallel, TwoRanksFollowOneProcess) {
  TrainResult ref = single();
  expect_follows(ref, parallel(2, {}), 1e-5);
}

TEST(DataParallel, OddWorldOfThree) {
  TrainResult ref = single();
  expect_follows(ref, parallel(3, {}), 1e-5);
}

TEST(DataParallel, OverlapOffAndManySmallBuckets) {
  TrainResult ref = single();
  expect_follows(ref, parallel(2, {"data_parallel.overlap=false"}), 1e-5);
  expect_follows(ref, parallel(2, {"data_parallel.bucket_mb=0.01"}), 1e-5);  // a bucket per layer and then some
}

TEST(DataParallel, AccumulationCommunicatesOnceAndFollows) {
  TrainResult ref = single({"train.accumulation_steps=4"});
  expect_follows(ref, parallel(2, {"train.accumulation_steps=4"}), 1e-5);
  expect_follows(single(), parallel(2, {"train.accumulation_steps=2", "data_parallel.bucket_mb=0.05"}), 1e-5);
}

// Hierarchy needs hosts: on one host, `hierarchical: on` is a ConfigError saying where the
// data group runs, not a silently flat allreduce. (Over two named hosts it follows one
// process: tests/tools/test_multihost.cpp, NamedHosts; over two test hosts, MultiHost.)
TEST(DataParallel, HierarchicalOnOneHostSaysWhereTheRanksRun) {
  try {
    parallel(2, {"data_parallel.hierarchical=on"});
    ADD_FAILURE() << "hierarchical: on over one host ran";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("data_parallel.hierarchical: on needs the same number (> 1) of data ranks on each of more "
                        "than one host; the data group runs "),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("ranks 0-1"), std::string::npos) << what;
  }
}

TEST(DataParallel, CompressionFollowsWithinItsTolerance) {
  TrainResult ref = single();
  TrainResult fp16 = parallel(2, {"data_parallel.compression=fp16"});
  TrainResult bf16 = parallel(2, {"data_parallel.compression=bf16"});
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(fp16.losses[i], ref.losses[i], 1e-2 * ref.losses[i]) << "fp16 step " << i + 1;
    EXPECT_NEAR(bf16.losses[i], ref.losses[i], 5e-2 * ref.losses[i]) << "bf16 step " << i + 1;
  }
}

TEST(DataParallel, BatchThatDoesNotSplitNamesAllTheNumbers) {
  set_threads(1);
  collectives::run_local_ranks(5, [&](int, collectives::Communicator& world) {
    TrainerOptions o;
    o.world = world.shared_from_this();
    try {
      Trainer t(job({"mesh.data=5"}), o);
      FAIL();
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("data.batch_size 96 does not split into 5 data-parallel ranks x 1 micro-batch"),
                std::string::npos)
          << e.what();
    }
  });
}

namespace {
struct Interrupt {};
}  // namespace

TEST(DataParallel, RankZeroCheckpointsAndEveryRankResumesFromIt) {
  set_threads(1);
  const std::string dir = testing::TempDir() + "/tetra_dp_ckpt_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::vector<std::string> sets = {"checkpoint.dir=" + dir, "checkpoint.every_steps=10"};
  TrainResult whole = parallel(2, {"checkpoint.dir=" + dir + "_whole", "checkpoint.every_steps=10"});
  // Stop both ranks after step 15 (the step-10 checkpoint is on disk), then resume.
  sets.push_back("mesh.data=2");
  EXPECT_ANY_THROW(collectives::run_local_ranks(2, [&](int, collectives::Communicator& world) {
    TrainerOptions o;
    o.world = world.shared_from_this();
    o.on_step = [](int64_t step, double) {
      if (step == 15) throw Interrupt{};
    };
    Trainer(job(sets), o).run();
  }));
  sets.pop_back();
  TrainResult rest = parallel(2, sets);
  EXPECT_NE(rest.resumed_from.find("step-00000010"), std::string::npos) << rest.resumed_from;
  ASSERT_EQ(rest.losses.size(), 15u);
  for (size_t i = 0; i < 15; ++i) EXPECT_EQ(rest.losses[i], whole.losses[10 + i]) << "step " << 11 + i;
}

// Gradients are views of the buckets. Code that replaces a .grad (a fresh tensor, or
// none at all so autograd installs its own) must still get the average, and the
// parameter is bound to its bucket again afterwards.
TEST(DataParallel, ReplacedGradientsAreStillAveragedAndRebound) {
  set_threads(1);
  for (bool overlap : {true, false}) {
    JobSpec spec = job({"mesh.data=2", std::string("data_parallel.overlap=") + (overlap ? "true" : "false")});
    auto cfg = std::dynamic_pointer_cast<const StrategyConfig>(spec.plugins.at("data_parallel"));
    ASSERT_TRUE(cfg);
    collectives::run_local_ranks(2, [&](int rank, collectives::Communicator& world) {
      torch::nn::Sequential model(torch::nn::Linear(torch::nn::LinearOptions(4, 3).bias(false)),
                                  torch::nn::Linear(torch::nn::LinearOptions(3, 2).bias(false)));
      std::vector<NamedParam> params;
      for (const auto& p : model->named_parameters()) params.push_back({p.key(), p.value()});
      Mesh mesh(world.shared_from_this(), spec.mesh);
      Trace trace;
      TrainState state{spec, model, params, &mesh, trace};
      auto dp = cfg->build();
      dp->attach(state);
      const at::Tensor bound = params[0].tensor.grad();
      ASSERT_TRUE(bound.defined());  // a view of its bucket from the start
      for (int step = 0; step < 3; ++step) {
        for (auto& p : params) p.tensor.mutable_grad().zero_();
        if (step == 1) params[0].tensor.mutable_grad() = torch::zeros_like(params[0].tensor);  // replaced
        if (step == 2) params[0].tensor.mutable_grad() = at::Tensor();                        // set to none
        // Rank r's input is (r + 1) * x: the average gradient is 1.5 times rank 0's alone.
        torch::Tensor x = torch::linspace(-1, 1, 8).view({2, 4}) * (rank + 1);
        dp->before_backward(true);
        model->forward(x).sum().backward();
        dp->finish_gradients();
        torch::Tensor w1 = params[1].tensor.detach();
        torch::Tensor expect0 = 1.5 * w1.sum(0).view({3, 1}) * torch::linspace(-1, 1, 8).view({2, 4}).sum(0).view({1, 4});
        EXPECT_TRUE(torch::allclose(params[0].tensor.grad(), expect0, 1e-5, 1e-6))
            << "overlap " << overlap << " step " << step << " rank " << rank << "\n" << params[0].tensor.grad();
        EXPECT_EQ(params[0].tensor.grad().data_ptr(), bound.data_ptr()) << "step " << step;
      }
    });
  }
}
