// The zero-bubble schedules (zbh1, zbv: the backward split into B and W, Note [B and W on
// the autograd graph]) against the numerics contract: with plain SGD and no clipping
// (a gradient summed where it should be averaged cannot hide), losses at every step and
// every parameter follow one process within 1e-5 — alone, recomputing the forwards, over
// data ranks, with ZeRO-1 and ZeRO-2 sharding the stages' data groups, with tensor
// parallelism inside the stages, and with gradient accumulation (the schedule runs once per
// accumulation step). Dropout is on, so a mask drawn out of place shows. Thread-ranks over
// the local backend; the mpirun runs are tests/tools' (TrainMpi).
#include <gtest/gtest.h>

#include <unistd.h>

#include "collectives/error.h"
#include "core/job_spec.h"
#include "pipeline/pipeline.h"
#include "tests/common/numerics.h"

using namespace tetra;
using namespace tetra::core;

namespace {

// 8 layers (Flatten, (Linear, ReLU, Dropout) x 2, Linear): up to 4 ranks of ZBV's 2 chunks.
const char* const kMlp = numerics::kDropoutMlp;
// The GPT with 4 blocks: LayerNorms, attention and the tensor-parallel layers per stage.
const char* const kGpt = numerics::kDropoutGpt;
std::vector<std::string> gpt(std::vector<std::string> sets) {
  sets.insert(sets.begin(), "model.layers=4");
  sets.push_back("data.path=" + numerics::small_text("tetra_zb_text_" + std::to_string(::getpid()) + ".txt"));
  return sets;
}

// `sets` on pipeline x data x tensor thread-ranks.
numerics::Outcome run(const char* yaml, int stages, int data, std::vector<std::string> sets, int tensor = 1) {
  sets.push_back("mesh.pipeline=" + std::to_string(stages));
  sets.push_back("mesh.data=" + std::to_string(data));
  if (tensor > 1) sets.push_back("mesh.tensor=" + std::to_string(tensor));
  return numerics::run_parallel(yaml, stages * data * tensor, sets);
}

std::vector<std::string> zb(const std::string& schedule, int m, std::vector<std::string> more = {}) {
  more.push_back("pipeline.schedule=" + schedule);
  more.push_back("pipeline.micro_batches=" + std::to_string(m));
  return more;
}

void expect_follows(const numerics::Outcome& ref, const numerics::Outcome& got, const std::string& what) {
  ASSERT_FALSE(ref.weights.empty());
  numerics::expect_follows(ref, got, 1e-5, what);
}

std::string parse_error(const char* yaml, const std::vector<std::string>& sets) {
  try {
    numerics::job(yaml, sets);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ZeroBubble, MlpFollowsOneProcessAloneRecomputingAndOverData) {
  const numerics::Outcome ref = numerics::run_single(kMlp);
  for (const char* s : {"zbh1", "zbv"}) {
    const std::string k = s;
    expect_follows(ref, run(kMlp, 2, 1, zb(k, 4)), k + " P=2 m=4");
    expect_follows(ref, run(kMlp, 2, 1, zb(k, 1)), k + " P=2 m=1");
    expect_follows(ref, run(kMlp, 4, 1, zb(k, 8)), k + " P=4 m=8");
    expect_follows(ref, run(kMlp, 2, 1, zb(k, 4, {"pipeline.checkpoint=always"})), k + " P=2 m=4 checkpoint always");
    expect_follows(ref, run(kMlp, 2, 2, zb(k, 2, {"pipeline.checkpoint=except_last"})),
                   k + " P=2 x data 2, m=2, checkpoint except_last");
    expect_follows(ref, run(kMlp, 2, 1, zb(k, 2, {"train.accumulation_steps=2"})), k + " P=2 m=2 x accumulation 2");
  }
  // Accumulation under the schedules that were already there.
  expect_follows(ref, run(kMlp, 2, 1, zb("1f1b", 2, {"train.accumulation_steps=4"})), "1f1b m=2 x accumulation 4");
}

TEST(ZeroBubble, MlpFollowsOneProcessUnderZeroOneAndTwo) {
  const numerics::Outcome ref = numerics::run_single(kMlp);
  for (const char* s : {"zbh1", "zbv"})
    for (const char* stage : {"1", "2"}) {
      const std::string what = std::string(s) + " P=2 x data 2 with zero stage " + stage;
      expect_follows(ref, run(kMlp, 2, 2, zb(s, 4, {std::string("zero.stage=") + stage, "zero.bucket_mb=0.001"})), what);
    }
}

TEST(ZeroBubble, GptFollowsOneProcessWithTensorParallelStages) {
  const numerics::Outcome ref = numerics::run_single(kGpt, gpt({}));
  for (const char* s : {"zbh1", "zbv"}) {
    const std::string k = s;
    expect_follows(ref, run(kGpt, 2, 1, gpt(zb(k, 4))), k + " gpt P=2 m=4");
    expect_follows(ref, run(kGpt, 2, 1, gpt(zb(k, 4)), 2), k + " gpt P=2 x tensor 2, m=4");
    expect_follows(ref, run(kGpt, 2, 1, gpt(zb(k, 2, {"tensor.sequence_parallel=true"})), 2),
                   k + " gpt P=2 x tensor 2 sequence-parallel, m=2");
  }
}

TEST(ZeroBubble, WhatTheSchedulesCannotTakeIsAConfigError) {
  const std::string zero3 = parse_error(kMlp, {"mesh.pipeline=2", "mesh.data=2", "pipeline.schedule=zbh1", "zero.stage=3"});
  EXPECT_NE(zero3.find("pipeline.schedule"), std::string::npos) << zero3;
  EXPECT_NE(zero3.find("zero.stage 3"), std::string::npos) << zero3;
  const std::string v3 = parse_error(kMlp, {"mesh.pipeline=2", "pipeline.schedule=zbv", "pipeline.virtual_stages=3"});
  EXPECT_NE(v3.find("virtual_stages"), std::string::npos) << v3;
  const std::string v2 = parse_error(kMlp, {"mesh.pipeline=2", "pipeline.schedule=zbh1", "pipeline.virtual_stages=2"});
  EXPECT_NE(v2.find("virtual_stages"), std::string::npos) << v2;
  // zbv takes its two chunks without being told.
  const JobSpec spec = numerics::job(kMlp, {"mesh.pipeline=2", "pipeline.schedule=zbv"});
  EXPECT_EQ(spec.plugin<pipeline::Options>("pipeline")->virtual_stages, 2);
}
