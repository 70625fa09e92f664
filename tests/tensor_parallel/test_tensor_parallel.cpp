// The tensor-parallel strategy against the numerics contract (tests/common/numerics.h):
// a GPT split over the tensor axis — alone, and composed with data parallelism — follows
// one process, losses and every parameter of the whole model, with plain SGD (no
// clipping) and with AdamW and clipping (whose norm counts a whole parameter once and a
// split one by its parts); dropout inside the split attention draws one process's masks.
// Sequence parallelism, pipeline stages, ZeRO 1 and 3 over the data ranks of each tensor
// slice, and replica threads compose with it under the same contract. A checkpoint
// written by two tensor ranks resumes on one process, and one process's on two tensor
// ranks, with and without ZeRO. What the axis cannot take is a --check error naming both keys.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "tests/common/numerics.h"
#include "core/checkpoint.h"

using namespace tetra;
using namespace tetra::core;
namespace fs = std::filesystem;

namespace {

const char* kGptJob = R"(
model: {type: gpt, layers: 2, d_model: 32, heads: 4, dropout: 0.1}
data: {type: text, seq_len: 16, batch_size: 8, eval_samples: 32}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: 8, seed: 5, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

const std::vector<std::string> kAdamWClipped = {"optimizer.type=adamw", "optimizer.lr=2.0e-3",
                                                "optimizer.weight_decay=0.01", "optimizer.clip_grad_norm=0.05"};

std::vector<std::string> with(std::vector<std::string> sets, const std::vector<std::string>& more = {}) {
  sets.push_back("data.path=" + numerics::small_text("tetra_tp_text_" + std::to_string(::getpid()) + ".txt"));
  sets.insert(sets.end(), more.begin(), more.end());
  return sets;
}

numerics::Outcome single(const std::vector<std::string>& sets) { return numerics::run_single(kGptJob, with(sets)); }
numerics::Outcome parallel(int n, const std::vector<std::string>& sets) {
  return numerics::run_parallel(kGptJob, n, with(sets));
}

std::string check_error(const std::vector<std::string>& sets) {
  try {
    numerics::job(kGptJob, with(sets));
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "the job was accepted";
  return "";
}

}  // namespace

TEST(TensorParallel, GptOverTwoAndFourTensorRanksFollowsOneProcessWithPlainSgd) {
  const numerics::Outcome ref = single({});
  ASSERT_EQ(ref.result.losses.size(), 8u);
  numerics::expect_follows(ref, parallel(2, {"mesh.tensor=2"}), 1e-5, "tensor 2, sgd");
  numerics::expect_follows(ref, parallel(4, {"mesh.tensor=4"}), 1e-5, "tensor 4, sgd");
  // The unfused column layers (tensor.overlap false: the input gradient summed after the
  // weight gradient, not beside it) are the same arithmetic.
  numerics::expect_follows(ref, parallel(2, {"mesh.tensor=2", "tensor.overlap=false"}), 1e-5, "tensor 2 unfused, sgd");
}

TEST(TensorParallel, Bf16AutocastRunsThroughTheOverlappedLayers) {
  // bf16 rounds the row layers' partial sums before they are added, so this follows one
  // process's bf16 run loosely; what it holds is that the fused backward hands every
  // gradient back in its tensor's dtype under autocast (fp32 parameters, bf16 products).
  const numerics::Outcome ref = single({"train.precision=bf16"});
  numerics::expect_follows(ref, parallel(2, {"mesh.tensor=2", "tensor.sequence_parallel=true", "train.precision=bf16"}),
                           5e-2, "tensor 2 sequence-parallel, bf16");
}

TEST(TensorParallel, SequenceParallelFollowsOneProcess) {
  // Dropout on: the norms' and the residual's masks are drawn on sequence blocks.
  const numerics::Outcome ref = single({});
  numerics::expect_follows(ref, parallel(2, {"mesh.tensor=2", "tensor.sequence_parallel=true"}), 1e-5,
                           "tensor 2 sequence-parallel, sgd");
  numerics::expect_follows(ref, parallel(4, {"mesh.tensor=4", "tensor.sequence_parallel=true"}), 1e-5,
                           "tensor 4 sequence-parallel, sgd");
  // The norms' gradients summed over the blocks, counted once in the clipped norm.
  const numerics::Outcome clipped = single(kAdamWClipped);
  numerics::expect_follows(clipped, parallel(4, with(kAdamWClipped, {"mesh.tensor=2", "mesh.data=2",
                                                                     "tensor.sequence_parallel=true"})),
                           1e-5, "tensor 2 sequence-parallel x data 2, adamw clipped");
}

TEST(TensorParallel, TensorTimesPipelineFollowsOneProcess) {
  const numerics::Outcome ref = single({"model.layers=4"});
  numerics::expect_follows(ref, parallel(4, {"model.layers=4", "mesh.tensor=2", "mesh.pipeline=2",
                                             "pipeline.micro_batches=4"}),
                           1e-5, "tensor 2 x pipeline 2 (gpipe), sgd");
  numerics::expect_follows(ref, parallel(4, {"model.layers=4", "mesh.tensor=2", "mesh.pipeline=2",
                                             "pipeline.micro_batches=4", "pipeline.schedule=1f1b",
                                             "tensor.sequence_parallel=true"}),
                           1e-5, "tensor 2 sequence-parallel x pipeline 2 (1f1b), sgd");
  // Recomputed forwards repeat the tensor sums in backward, in the same order on every rank.
  numerics::expect_follows(ref, parallel(4, {"model.layers=4", "mesh.tensor=2", "mesh.pipeline=2",
                                             "pipeline.micro_batches=4", "pipeline.checkpoint=always"}),
                           1e-5, "tensor 2 x pipeline 2 recomputing, sgd");
}

TEST(TensorParallel, TensorTimesZeroOverTheDataRanksFollowsOneProcess) {
  const numerics::Outcome ref = single({});
  for (const char* stage : {"1", "3"}) {
    numerics::Outcome got = parallel(4, {"mesh.tensor=2", "mesh.data=2", std::string("zero.stage=") + stage});
    numerics::expect_follows(ref, got, 1e-5, std::string("tensor 2 x data 2, zero ") + stage + ", sgd");
  }
  const numerics::Outcome clipped = single(kAdamWClipped);
  numerics::expect_follows(clipped, parallel(4, with(kAdamWClipped, {"mesh.tensor=2", "mesh.data=2", "zero.stage=2"})),
                           1e-5, "tensor 2 x data 2, zero 2, adamw clipped");
}

TEST(TensorParallel, TensorTimesReplicasFollowsOneProcess) {
  const numerics::Outcome ref = single({});
  // Two processes of one tensor slice each running two replica threads: replica r of each
  // process meets replica r of the other on its own tensor group.
  const numerics::Outcome got = parallel(2, {"mesh.tensor=2", "replicate.replicas=2"});
  numerics::expect_follows(ref, got, 1e-5, "tensor 2 x replicas 2, sgd");
  EXPECT_EQ(got.data_ranks, (std::vector<int>{2, 2, 2, 2}));
}

TEST(TensorParallel, EveryAxisInOneJobFollowsOneProcess) {
  // tensor 2 (sequence-parallel) x pipeline 2 x data 2 (replica threads) under ZeRO-1,
  // AdamW with clipping: eight ranks, one plan.
  const std::vector<std::string> model = {"model.layers=4"};
  const numerics::Outcome ref = single(with(kAdamWClipped, model));
  const numerics::Outcome got =
      parallel(4, with(kAdamWClipped, {"model.layers=4", "mesh.tensor=2", "mesh.pipeline=2", "pipeline.micro_batches=2",
                                       "tensor.sequence_parallel=true", "replicate.replicas=2", "zero.stage=1"}));
  numerics::expect_follows(ref, got, 1e-5, "tensor 2 (sp) x pipeline 2 x replicas 2, zero 1, adamw clipped");
  EXPECT_EQ(got.data_ranks.size(), 8u);
}

TEST(TensorParallel, TensorTimesDataWithAdamWAndClippingFollowsOneProcess) {
  const numerics::Outcome ref = single(kAdamWClipped);
  numerics::Outcome got = parallel(4, with(kAdamWClipped, {"mesh.tensor=2", "mesh.data=2"}));
  numerics::expect_follows(ref, got, 1e-5, "tensor 2 x data 2, adamw clipped");
  EXPECT_EQ(got.data_ranks, (std::vector<int>{2, 2, 2, 2}));  // two slices of two tensor ranks
  // Evaluation (loss and accuracy, from the split logits) is one process's too.
  ASSERT_TRUE(got.result.final_eval && ref.result.final_eval);
  EXPECT_NEAR(got.result.final_eval->test_loss, ref.result.final_eval->test_loss, 1e-5 * ref.result.final_eval->test_loss);
  EXPECT_EQ(got.result.final_eval->accuracy, ref.result.final_eval->accuracy);
}

TEST(TensorParallel, CheckpointsHoldWholeTensorsAndResumeOnAnyTensorDegree) {
  const std::string base = testing::TempDir() + "/tetra_tp_ckpt_" + std::to_string(::getpid());
  fs::remove_all(base);
  const numerics::Outcome whole = single(kAdamWClipped);
  struct Case {
    int from_n;
    std::vector<std::string> from;
    int to_n;
    std::vector<std::string> to;
    std::string what;
  };
  const std::vector<Case> cases = {
      {2, {"mesh.tensor=2"}, 1, {}, "tensor 2 -> one process"},
      {1, {}, 2, {"mesh.tensor=2"}, "one process -> tensor 2"},
      {4, {"mesh.tensor=4"}, 4, {"mesh.tensor=2", "mesh.data=2"}, "tensor 4 -> tensor 2 x data 2"},
      {2, {"mesh.tensor=2"}, 2, {"mesh.data=2"}, "tensor 2 -> tensor 1 x data 2"},
      // ZeRO's shards of each tensor slice written as ranges of the whole tensors.
      {4, {"mesh.tensor=2", "mesh.data=2", "zero.stage=3"}, 1, {}, "tensor 2 x data 2 zero 3 -> one process"},
      {1, {}, 4, {"mesh.tensor=2", "mesh.data=2", "zero.stage=1"}, "one process -> tensor 2 x data 2 zero 1"},
      {4, {"mesh.tensor=2", "mesh.data=2", "zero.stage=2"}, 4, {"mesh.data=4", "zero.stage=3"},
       "tensor 2 x data 2 zero 2 -> data 4 zero 3"},
  };
  int k = 0;
  for (const Case& c : cases) {
    const std::string dir = base + "/" + std::to_string(k++);
    // The first 4 steps, then stopped; the last 4 resumed from the checkpoint of step 4.
    std::vector<std::string> first = with(kAdamWClipped, c.from);
    first.insert(first.end(), {"checkpoint.dir=" + dir, "train.max_steps=4"});
    // Same schedule: the whole run's 8 steps (the learning rate has no decay here).
    if (c.from_n == 1) numerics::run_single(kGptJob, first);
    else numerics::run_parallel(kGptJob, c.from_n, first);
    ASSERT_TRUE(CheckpointStore(dir, 3).latest()) << c.what;
    std::vector<std::string> rest_sets = with(kAdamWClipped, c.to);
    rest_sets.push_back("checkpoint.dir=" + dir);
    const numerics::Outcome rest =
        c.to_n == 1 ? numerics::run_single(kGptJob, rest_sets) : numerics::run_parallel(kGptJob, c.to_n, rest_sets);
    EXPECT_NE(rest.result.resumed_from.find("step-00000004"), std::string::npos) << c.what << ": " << rest.result.resumed_from;
    numerics::expect_resumed_follows(whole, rest, 4, 1e-5, c.what);
  }
  fs::remove_all(base);
}

TEST(TensorParallel, WhatTheAxisCannotTakeIsACheckErrorNamingBothKeys) {
  std::string e = check_error({"mesh.tensor=3"});
  EXPECT_NE(e.find("mesh.tensor 3 does not divide model.heads 4"), std::string::npos) << e;
  EXPECT_NE(e.find("model.d_ff 128"), std::string::npos) << e;
  EXPECT_NE(e.find("mesh.tensor 3 does not divide the vocabulary of 256 byte values (data.type text)"), std::string::npos)
      << e;
  try {
    numerics::job("model: {type: mlp, hidden: [64]}\n"
                  "data: {type: synthetic, shape: [12], classes: 4, train_samples: 64, test_samples: 8}\n"
                  "mesh: {tensor: 2}\n",
                  {});
    ADD_FAILURE() << "an mlp over two tensor ranks was accepted";
  } catch (const ConfigError& err) {
    EXPECT_NE(std::string(err.what()).find("job:3:8: error: mesh.tensor: mesh.tensor 2 splits the layers of model.type gpt, "
                                           "and model.type is mlp"),
              std::string::npos)
        << err.what();
  }
  e = check_error({"tensor.sequence_paralel=true", "mesh.tensor=2"});
  EXPECT_NE(e.find("did you mean \"sequence_parallel\"?"), std::string::npos) << e;
  e = check_error({"tensor.sequence_parallel=true"});
  EXPECT_NE(e.find("tensor.sequence_parallel: splits the sequence over the tensor group, and mesh.tensor is 1"),
            std::string::npos)
      << e;
  e = check_error({"tensor.sequence_parallel=true", "mesh.tensor=4", "data.seq_len=18"});
  EXPECT_NE(e.find("tensor.sequence_parallel: tensor.sequence_parallel with mesh.tensor 4 splits each sequence into "
                   "equal blocks, and mesh.tensor 4 does not divide data.seq_len 18"),
            std::string::npos)
      << e;
}
