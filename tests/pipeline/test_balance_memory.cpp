// pipeline.balance by_time under pipeline.memory_gb (Note [Stage memory]): the cut that
// time alone gives overflows the cap on the stage that holds the most micro-batches, and
// the balanced cut is the fastest that fits; when no cut fits, the error names the stage
// and its bytes — from cut_stages, and from `train --check`'s model_issues.
#include <gtest/gtest.h>

#include "collectives/error.h"
#include "core/model_plan.h"
#include "core/trainer.h"
#include "pipeline/pipeline.h"
#include "tests/common/numerics.h"

using namespace tetra;
using namespace tetra::pipeline;

namespace {

const char* kMlp = R"(
model: {type: mlp, hidden: [32, 32]}
data: {type: synthetic, shape: [24], classes: 4, train_samples: 512, test_samples: 64, batch_size: 16}
optimizer: {type: sgd, lr: 0.2}
mesh: {pipeline: 2}
pipeline: {schedule: 1f1b, micro_batches: 4, balance: by_time}
train: {max_steps: 2, seed: 3, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

constexpr int64_t kBig = int64_t{1} << 28;  // 256 MiB of activations per micro-batch

// Six layers of equal time; the first three keep far more activations than the rest.
std::vector<LayerCost> layers() {
  std::vector<LayerCost> c(6);
  for (int i = 0; i < 6; ++i) {
    c[i].name = "layer " + std::to_string(i);
    c[i].forward_s = 1e-3;
    c[i].backward_s = 2e-3;
    c[i].activation_bytes = i < 3 ? kBig : kBig / 16;
  }
  c[1].params = 1000;  // some state too: 1000 x 4 bytes x (parameter + gradient)
  return c;
}

Options options(double memory_gb) {
  core::JobSpec spec = numerics::job(kMlp, {});
  Options o = *spec.plugin<Options>("pipeline");
  o.memory_gb = memory_gb;
  return o;
}

}  // namespace

TEST(BalanceMemory, TheTimeCutOverflowsAndTheBalancedCutFits) {
  const core::JobSpec spec = numerics::job(kMlp, {});
  const std::vector<LayerCost> c = layers();
  // Time alone: [3, 3]. Under 1F1B on 2 ranks stage 0 holds 2 micro-batches in flight:
  // 3 x 256 MiB x 2 = 1.5 GiB (+ its state), over a 1.25 GiB cap.
  const Options uncapped = options(0);
  const Partition by_time = cut_stages(uncapped, c, spec);
  EXPECT_EQ(by_time.str(), "[3, 3]");
  const Options capped = options(1.25);
  const auto over = memory_issues(capped, by_time, c, spec);
  ASSERT_EQ(over.size(), 1u);
  EXPECT_EQ(over[0].key, "pipeline.memory_gb");
  EXPECT_NE(over[0].message.find("stage 0 (rank 0, layers 0-2) needs 1.5 GiB (1610620736 bytes"), std::string::npos)
      << over[0].message;
  EXPECT_NE(over[0].message.find("2 micro-batches in flight"), std::string::npos) << over[0].message;
  // Under the cap: stage 0 takes two of the big layers (1 GiB), stage 1 the rest; of the
  // cuts that fit it is the fastest ([1, 5] fits too, and is slower).
  const Partition fits = cut_stages(capped, c, spec);
  EXPECT_EQ(fits.str(), "[2, 4]");
  EXPECT_TRUE(memory_issues(capped, fits, c, spec).empty());
  // No cut fits under 0.5 GiB: the one that needs least is reported, stage and bytes.
  const Options tiny = options(0.5);
  const auto none = memory_issues(tiny, cut_stages(tiny, c, spec), c, spec);
  ASSERT_FALSE(none.empty());
  EXPECT_NE(none[0].message.find("no cut of the 6 layers into 2 stages fits"), std::string::npos) << none[0].message;
}

TEST(BalanceMemory, TrainCheckNamesTheStageThatDoesNotFit) {
  core::set_threads(1);
  const core::JobSpec spec = numerics::job(kMlp, {"pipeline.memory_gb=0.000001"});
  core::ModelPlan model(spec);
  try {
    model.check();
    FAIL() << "a stage over pipeline.memory_gb passed the check";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("error: pipeline.memory_gb: stage 0 (rank 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bytes"), std::string::npos) << msg;
  }
  // Room enough: nothing to say.
  core::ModelPlan roomy(numerics::job(kMlp, {"pipeline.memory_gb=1"}));
  EXPECT_NO_THROW(roomy.check());
}

// More stages than layers fails the dry run and the run; `train --check` says so too (the
// tuner found it passing: 4 stages x 2 chunks of a 6-layer model).
TEST(BalanceMemory, TrainCheckNamesMoreStagesThanLayers) {
  core::set_threads(1);
  core::ModelPlan eight(numerics::job(kMlp, {"mesh.pipeline=4", "pipeline.schedule=interleaved_1f1b",
                                             "pipeline.virtual_stages=2", "pipeline.micro_batches=4"}));
  try {
    eight.check();
    FAIL() << "8 stages of a 6-layer model passed the check";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("error: pipeline.virtual_stages: the model has 6 layers, fewer than the 8 stages"),
              std::string::npos)
        << msg;
  }
  core::ModelPlan four(numerics::job(kMlp, {"mesh.pipeline=4"}));
  EXPECT_NO_THROW(four.check());
}
