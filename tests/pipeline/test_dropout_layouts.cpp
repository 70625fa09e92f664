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
#include "tests/common/numerics.h"

using namespace tetra;
using namespace tetra::core;

namespace {

using numerics::kDropoutGpt;
using numerics::kDropoutMlp;

std::string text_file() {
  const std::string path = testing::TempDir() + "/tetra_dropout_text_" + std::to_string(::getpid()) + ".txt";
  std::ofstream f(path);
  for (int i = 0; i < 120; ++i) f << "pack my box with " << i << " dozen liquor jugs. ";
  return path;
}

using numerics::Outcome;

// The shared harness (tests/common/numerics.h) on pipeline x data thread-ranks (one
// process when both are 1).
Outcome run(const char* yaml, int stages, int data, std::vector<std::string> sets) {
  if (stages * data == 1) return numerics::run_single(yaml, sets);
  sets.push_back("mesh.pipeline=" + std::to_string(stages));
  sets.push_back("mesh.data=" + std::to_string(data));
  return numerics::run_parallel(yaml, stages * data, sets);
}

void expect_follows(const Outcome& ref, const Outcome& got, const std::string& what) {
  ASSERT_FALSE(ref.weights.empty());
  numerics::expect_follows(ref, got, 1e-5, what);
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

TEST(DropoutLayouts, MlpFollowsOneProcessInEveryLayout) { expect_every_layout_follows(kDropoutMlp); }

TEST(DropoutLayouts, GptFollowsOneProcessInEveryLayout) {
  expect_every_layout_follows(kDropoutGpt, {"data.path=" + text_file()});
}
