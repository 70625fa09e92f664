// The numerics contract with dropout on (Note [Layout-invariant dropout]): data parallel
// ranks, pipeline stages with micro-batches (with and without activation checkpointing),
// pipeline x data, and gradient accumulation all draw the masks one process draws, so they
// follow its loss at every step within relative 1e-5 and end with its parameters. Plain
// SGD without clipping, so a gradient summed where it should be averaged cannot hide.
// Thread-ranks over the local backend, small models: the whole file runs in seconds.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "collectives/local.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "data_parallel/data_parallel.h"
#include "pipeline/pipeline.h"

using namespace tetra;
using namespace tetra::core;

namespace {

// 8 layers, a dropout in each half: Flatten, (Linear, ReLU, Dropout) x 2, Linear.
const char* kMlp = R"(
model: {type: mlp, hidden: [32, 32], dropout: 0.3}
data: {type: synthetic, shape: [24], classes: 4, train_samples: 512, test_samples: 64, batch_size: 16}
optimizer: {type: sgd, lr: 0.2}
train: {max_steps: 6, seed: 3, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

// Embedding, 2 blocks, head: 7 dropouts (embedding; attention, projection, MLP per block).
const char* kGpt = R"(
model: {type: gpt, layers: 2, heads: 2, d_model: 16, d_ff: 32, dropout: 0.2}
data: {type: text, seq_len: 16, batch_size: 8, eval_samples: 16}
optimizer: {type: sgd, lr: 0.5}
train: {max_steps: 5, seed: 4, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

std::string text_file() {
  const std::string path = testing::TempDir() + "/tetra_dropout_text_" + std::to_string(::getpid()) + ".txt";
  std::ofstream f(path);
  for (int i = 0; i < 120; ++i) f << "pack my box with " << i << " dozen liquor jugs. ";
  return path;
}

struct Outcome {
  TrainResult result;
  TensorMap weights;  // the whole model under its single-process names
};

// Runs `yaml` on pipeline x data thread-ranks (one process when both are 1); rank 0's
// outcome, after checking that every rank saw the same losses.
Outcome run(const char* yaml, int stages, int data, std::vector<std::string> sets) {
  SectionRegistry plugins;
  data_parallel::register_data_parallel(plugins);
  pipeline::register_pipeline(plugins);
  sets.push_back("mesh.pipeline=" + std::to_string(stages));
  sets.push_back("mesh.data=" + std::to_string(data));
  auto job = [&] { return parse_job_string(yaml, "dropout", sets, plugins).spec; };
  set_threads(1);
  const int n = stages * data;
  std::vector<Outcome> out(n);
  auto one = [&](int rank, TrainerOptions o) {
    Trainer t(job(), o);
    out[rank].result = t.run();
    out[rank].weights = t.weights();  // collective: gathered on rank 0
  };
  if (n == 1) {
    one(0, {});
  } else {
    collectives::run_local_ranks(n, [&](int rank, collectives::Communicator& world) {
      TrainerOptions o;
      o.world = world.shared_from_this();
      one(rank, o);
    });
  }
  for (int r = 1; r < n; ++r) EXPECT_EQ(out[r].result.losses, out[0].result.losses) << "rank " << r;
  return out[0];
}

void expect_follows(const Outcome& ref, const Outcome& got, const std::string& what) {
  ASSERT_EQ(ref.result.losses.size(), got.result.losses.size()) << what;
  for (size_t i = 0; i < ref.result.losses.size(); ++i)
    EXPECT_NEAR(got.result.losses[i], ref.result.losses[i], 1e-5 * std::abs(ref.result.losses[i]))
        << what << ", step " << i + 1;
  ASSERT_FALSE(ref.weights.empty());
  ASSERT_EQ(got.weights.size(), ref.weights.size()) << what;
  for (const auto& [name, w] : ref.weights) {
    ASSERT_TRUE(got.weights.count(name)) << what << ": no " << name;
    const torch::Tensor g = got.weights.at(name);
    EXPECT_TRUE(torch::allclose(g, w, 1e-5, 1e-6))
        << what << ": " << name << " differs by " << (g - w).abs().max().item<double>();
  }
}

// Every layout of `yaml` (with the overrides `base`) against one process.
void expect_every_layout_follows(const char* yaml, const std::vector<std::string>& base = {}) {
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), base.begin(), base.end());
    return more;
  };
  const Outcome ref = run(yaml, 1, 1, with({}));
  // Not vacuous: the masks change the losses.
  const Outcome plain = run(yaml, 1, 1, with({"model.dropout=0"}));
  EXPECT_GT(std::abs(plain.result.losses.back() - ref.result.losses.back()), 1e-3);

  expect_follows(ref, run(yaml, 1, 2, with({})), "data 2");
  expect_follows(ref, run(yaml, 1, 1, with({"train.accumulation_steps=2"})), "accumulation 2");
  expect_follows(ref, run(yaml, 1, 2, with({"train.accumulation_steps=2"})), "data 2 x accumulation 2");
  expect_follows(ref, run(yaml, 2, 1, with({"pipeline.schedule=1f1b", "pipeline.micro_batches=2"})),
                 "pipeline 2, 1f1b m=2");
  expect_follows(ref,
                 run(yaml, 2, 1, with({"pipeline.schedule=gpipe", "pipeline.micro_batches=4", "pipeline.checkpoint=always"})),
                 "pipeline 2, gpipe m=4, checkpoint always");
  expect_follows(ref,
                 run(yaml, 2, 2,
                     with({"pipeline.schedule=1f1b", "pipeline.micro_batches=2", "pipeline.checkpoint=except_last"})),
                 "pipeline 2 x data 2, 1f1b m=2, checkpoint except_last");
}

}  // namespace

TEST(DropoutLayouts, MlpFollowsOneProcessInEveryLayout) { expect_every_layout_follows(kMlp); }

TEST(DropoutLayouts, GptFollowsOneProcessInEveryLayout) {
  expect_every_layout_follows(kGpt, {"data.path=" + text_file()});
}
