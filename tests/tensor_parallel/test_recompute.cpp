// train.recompute (Note [Recompute], core/models.cpp): the gpt's blocks recomputed whole or
// in attention's core hold the numerics contract on every layout, dropout included, and
// keep the bytes the estimate counts (Note [Kept bytes]).
#include <gtest/gtest.h>

#include <numeric>

#include "core/allocator.h"
#include "core/models.h"
#include "core/random.h"
#include "tests/common/numerics.h"

using namespace tetra;

namespace {

std::vector<std::string> with(std::vector<std::string> sets) {
  sets.push_back("data.path=" + numerics::small_text("recompute.txt"));
  return sets;
}

numerics::Outcome single(const std::vector<std::string>& sets) {
  return numerics::run_single(numerics::kDropoutGpt, with(sets));
}
numerics::Outcome parallel(int n, const std::vector<std::string>& sets) {
  return numerics::run_parallel(numerics::kDropoutGpt, n, with(sets));
}

}  // namespace

// Plain SGD, no clipping, dropout 0.2: a recomputed block draws the masks its forward drew
// and its gradients reach the parameters once, on every layout.
TEST(Recompute, BlocksAndSelectiveFollowOneProcessOnEveryLayout) {
  const numerics::Outcome ref = single({});
  ASSERT_EQ(ref.result.losses.size(), 5u);
  for (const std::string mode : {"blocks", "selective"}) {
    const std::string r = "train.recompute=" + mode;
    numerics::expect_follows(ref, single({r}), 1e-6, mode + ", one process");
    numerics::expect_follows(ref, single({r, "train.accumulation_steps=2"}), 1e-5, mode + ", 2 accumulation steps");
    numerics::expect_follows(ref, parallel(2, {r, "mesh.data=2"}), 1e-5, mode + ", data 2");
    numerics::expect_follows(ref, parallel(2, {r, "mesh.data=2", "zero.stage=3"}), 1e-5, mode + ", zero-3 over 2");
    numerics::expect_follows(ref, parallel(2, {r, "mesh.tensor=2"}), 1e-5, mode + ", tensor 2");
    numerics::expect_follows(ref, parallel(2, {r, "mesh.tensor=2", "tensor.sequence_parallel=true"}), 1e-5,
                             mode + ", tensor 2, sequence parallel");
    numerics::expect_follows(ref, parallel(2, {r, "mesh.pipeline=2", "pipeline.micro_batches=4"}), 1e-5,
                             mode + ", pipeline 2 (1f1b)");
    // Zero-bubble: B asks the recomputed block for its input's gradient, W for its weights'.
    numerics::expect_follows(ref, parallel(2, {r, "mesh.pipeline=2", "pipeline.micro_batches=4", "pipeline.schedule=zbh1"}),
                             1e-5, mode + ", pipeline 2 (zbh1)");
    numerics::expect_follows(ref, parallel(1, {r, "replicate.replicas=2"}), 1e-5, mode + ", 2 replicas");
  }
}

TEST(Recompute, AModelWithoutTransformerBlocksIsRefusedNamingTheKey) {
  try {
    numerics::job(numerics::kDropoutMlp, {"train.recompute=blocks"});
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("recompute"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model type mlp"), std::string::npos) << e.what();
  }
}

// Note [Kept bytes]: the probe measures each kind of layer at 16, 32 and 64 tokens and takes
// the whole sequence from the quadratic through them. Here the whole model's forward on a
// 256-token sample, counted, keeps exactly the sum of what the probe says, in each mode;
// blocks keeps least, none most.
TEST(Recompute, TheProbeCountsTheBytesAWholeForwardKeepsInEachMode) {
  core::set_threads(1);
  const core::JobSpec spec = numerics::job(numerics::kDropoutGpt, with({"data.seq_len=256", "model.d_model=32",
                                                                         "model.heads=4", "model.d_ff=64"}));
  core::DataInfo data;
  data.input_shape = {256};
  data.num_classes = 256;
  data.language_model = true;
  data.seq_len = 256;
  const torch::Tensor sample = torch::randint(0, 256, {1, 256}, torch::kLong);
  std::map<core::Recompute, int64_t> whole;
  for (core::Recompute mode : {core::Recompute::kNone, core::Recompute::kSelective, core::Recompute::kBlocks}) {
    torch::nn::Sequential shapes = core::model_shapes(spec.model, data);
    core::set_recompute(shapes, mode);
    core::LayerProbe probe = core::probe_layers(shapes, sample);
    ASSERT_EQ(probe.scale, 4.0);  // cut to 64 tokens
    core::measure_kept(shapes, probe);
    const int64_t estimated = std::accumulate(probe.kept.begin(), probe.kept.end(), int64_t{0});

    torch::nn::Sequential model = core::build_model(spec.model, data, 1);
    core::set_recompute(model, mode);
    model->train();
    core::RandomContext::Scope random(0, 0, 0);
    model->forward(sample);  // warm-up
    int64_t counted = 0;
    {
      core::CountedBytes count;
      torch::Tensor y = model->forward(sample);
      counted = count.live();
    }
    EXPECT_EQ(estimated, counted) << core::to_string(mode);
    whole[mode] = counted;
    if (mode != core::Recompute::kNone) {
      const int64_t most = *std::max_element(probe.recompute.begin(), probe.recompute.end());
      // What one block's recomputation holds: what the block keeps without it, beyond this.
      EXPECT_GT(most, 0) << core::to_string(mode);
      EXPECT_LE(most, whole[core::Recompute::kNone]) << core::to_string(mode);
    }
  }
  EXPECT_LT(whole[core::Recompute::kBlocks], whole[core::Recompute::kSelective]);
  EXPECT_LT(whole[core::Recompute::kSelective], whole[core::Recompute::kNone]);
}
