// The numerics contract for ZeRO: with the same seed and global batch, stages 1, 2 and 3
// on N data-parallel thread-ranks (over the local backend) follow the single-process run
// at every step within float reduction-order error — losses and parameters — with plain
// SGD without clipping (a sum instead of an average shows at once), AdamW with clipping,
// accumulation, an odd world (padded shards), composed with a pipeline; checkpoints
// reshard onto any layout; the model state per rank matches ZeRO's formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "collectives/error.h"
#include "collectives/local.h"
#include "core/checkpoint.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "data_parallel/data_parallel.h"
#include "pipeline/pipeline.h"
#include "tests/common/numerics.h"
#include "zero/zero.h"

using namespace tetra;
using namespace tetra::core;
namespace fs = std::filesystem;

namespace {

const char* kJob = R"(
model: {type: mlp, hidden: [64, 32]}
data: {type: fashion-mnist, batch_size: 96, eval_samples: 600}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: 20, seed: 5, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

const std::vector<std::string> kAdamWClipped = {"optimizer.type=adamw", "optimizer.lr=2.0e-3",
                                                "optimizer.weight_decay=0.01", "optimizer.clip_grad_norm=0.5"};

const char* kGptJob = R"(
model: {type: gpt, layers: 2, d_model: 32, heads: 2}
data: {type: text, seq_len: 16, batch_size: 8, eval_samples: 32}
optimizer: {type: adamw, lr: 1.0e-3, clip_grad_norm: 1.0}
train: {max_steps: 8, seed: 5, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

// The job the helpers below build (the MLP unless a test switches it).
const char* base_job = kJob;

// One name for every run here (numerics' "job"): a checkpoint resumes only its own job.
JobSpec job(std::vector<std::string> sets) { return numerics::job(base_job, sets); }

// The shared numerics harness (tests/common/numerics.h) over this file's job.
using numerics::expect_follows;
using numerics::Outcome;

Outcome single(std::vector<std::string> sets = {}) { return numerics::run_single(base_job, sets); }

// Runs the job on n thread-ranks (the mesh in `sets`, data = n by default).
Outcome parallel(int n, std::vector<std::string> sets, bool set_data_axis = true) {
  if (set_data_axis) sets.push_back("mesh.data=" + std::to_string(n));
  return numerics::run_parallel(base_job, n, sets);
}

}  // namespace

// Plain SGD without clipping: gradients summed instead of averaged would double every
// update and show in the first step.
TEST(Zero, EveryStageFollowsOneProcessWithPlainSgd) {
  Outcome ref = single();
  for (int stage : {1, 2, 3})
    expect_follows(ref, parallel(2, {"zero.stage=" + std::to_string(stage)}), 1e-5, "stage " + std::to_string(stage));
}

// Three ranks: every unit is padded to a multiple of 3 x 16 elements. AdamW with clipping:
// the norm comes from the shards.
TEST(Zero, OddWorldWithAdamWAndClipping) {
  Outcome ref = single(kAdamWClipped);
  for (int stage : {1, 2, 3}) {
    auto sets = kAdamWClipped;
    sets.push_back("zero.stage=" + std::to_string(stage));
    expect_follows(ref, parallel(3, sets), 1e-5, "stage " + std::to_string(stage));
  }
}

TEST(Zero, AccumulationCommunicatesOnTheLastMicroBatchAndFollows) {
  Outcome ref = single({"train.accumulation_steps=2", "optimizer.momentum=0.9"});
  for (int stage : {1, 2, 3})
    expect_follows(ref,
                   parallel(2, {"train.accumulation_steps=2", "optimizer.momentum=0.9", "zero.stage=" + std::to_string(stage)}),
                   1e-5, "stage " + std::to_string(stage));
}

TEST(Zero, OverlapOffAndSmallUnits) {
  Outcome ref = single({"optimizer.type=adam", "optimizer.lr=1.0e-3"});
  for (int stage : {1, 2}) {
    const std::string st = "zero.stage=" + std::to_string(stage);
    expect_follows(ref, parallel(2, {"optimizer.type=adam", "optimizer.lr=1.0e-3", st, "zero.overlap=false"}), 1e-5,
                   st + " overlap off");
    expect_follows(ref, parallel(2, {"optimizer.type=adam", "optimizer.lr=1.0e-3", st, "zero.bucket_mb=0.01"}), 1e-5,
                   st + " small units");
  }
  expect_follows(ref, parallel(2, {"optimizer.type=adam", "optimizer.lr=1.0e-3", "zero.stage=3", "zero.prefetch=0"}), 1e-5,
                 "stage 3 without prefetch");
}

// ZeRO 1, 2 and 3 inside each pipeline stage's data group: pipeline 2 x data 2.
TEST(Zero, ComposedWithAPipelineFollowsOneProcess) {
  Outcome ref = single(kAdamWClipped);
  for (int stage : {1, 2, 3}) {
    auto sets = kAdamWClipped;
    for (const char* s : {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4", "pipeline.schedule=1f1b"})
      sets.push_back(s);
    sets.push_back("zero.stage=" + std::to_string(stage));
    expect_follows(ref, parallel(4, sets, false), 1e-5, "pipeline x zero " + std::to_string(stage));
  }
}

TEST(Zero, GptAtStageThreeFollowsOneProcess) {
  const std::string text = numerics::small_text("tetra_zero_text.txt");
  base_job = kGptJob;
  std::vector<std::string> sets = {"data.path=" + text};
  Outcome ref = single(sets);
  sets.push_back("zero.stage=3");
  expect_follows(ref, parallel(2, sets), 1e-5, "gpt stage 3");
  // Evaluation switches the wrapped blocks to eval mode (their dropout is their own
  // flag, not a child's): two evaluations agree.
  sets.push_back("model.dropout=0.2");
  sets.push_back("mesh.data=2");
  set_threads(1);
  collectives::run_local_ranks(2, [&](int, collectives::Communicator& world) {
    TrainerOptions o;
    o.world = world.shared_from_this();
    Trainer t(job(sets), o);
    t.run();
    EXPECT_EQ(t.evaluate().test_loss, t.evaluate().test_loss);
  });
  base_job = kJob;
}

// For fp32 Adam with P parameters on N ranks: 16P (stage 0), 8P + 8P/N (1), 4P + 12P/N (2),
// 16P/N (3), each within 5% (the padding) plus the communication buffers it declares.
TEST(Zero, ModelStatePerRankMatchesTheFormulas) {
  std::vector<std::string> sets = {"optimizer.type=adam", "model.hidden=[256,256]", "train.max_steps=2",
                                   "zero.bucket_mb=0.25"};
  const double P = 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10;
  for (int n : {2, 3}) {
    for (int stage : {0, 1, 2, 3}) {
      auto s = sets;
      s.push_back("zero.stage=" + std::to_string(stage));
      Outcome r = parallel(n, s);
      const double expect[4] = {16 * P, 8 * P + 8 * P / n, 4 * P + 12 * P / n, 16 * P / n};
      for (int rank = 0; rank < n; ++rank) {
        const ModelStateBytes& m = r.memory[rank];
        const double state = static_cast<double>(m.parameters + m.gradients + m.optimizer);
        EXPECT_NEAR(state, expect[stage], 0.05 * expect[stage])
            << "stage " << stage << " on " << n << " ranks, rank " << rank << ": parameters " << m.parameters
            << " gradients " << m.gradients << " optimizer " << m.optimizer;
        if (stage == 0) {
          EXPECT_EQ(m.buffers, 0);
        }
        // Buffers, in units of the largest unit (the first layer, 784 x 256 + 256 elements):
        // stage 1 two chunks, stage 2 two units of gradients and two chunks, stage 3 two
        // units of gradients and the gather pool (the running layer, one prefetched, one
        // on its way back).
        const int64_t unit = (784 * 256 + 256 + 4096) * 4;
        if (stage >= 1) {
          EXPECT_LE(m.buffers, (stage == 3 ? 5 : 3) * unit) << "stage " << stage;
        }
        // Every rank holds exactly the same bytes (balanced shards).
        EXPECT_EQ(m.total(), r.memory[0].total()) << "stage " << stage << " rank " << rank;
      }
    }
  }
}

namespace {
struct Interrupt {};

// Trains 20 steps with a checkpoint every 10 under `layout`, stopped after step 15.
void write_checkpoint_at_10(const std::string& dir, int n, std::vector<std::string> layout) {
  layout.push_back("checkpoint.dir=" + dir);
  layout.push_back("checkpoint.every_steps=10");
  set_threads(1);
  auto body = [&](TrainerOptions o) {
    o.on_step = [](int64_t step, double) {
      if (step == 15) throw Interrupt{};
    };
    Trainer(job(layout), o).run();
  };
  if (n == 1) {
    EXPECT_THROW(body({}), Interrupt);
    return;
  }
  EXPECT_ANY_THROW(collectives::run_local_ranks(n, [&](int, collectives::Communicator& world) {
    TrainerOptions o;
    o.world = world.shared_from_this();
    body(o);
  }));
}
}  // namespace

// A checkpoint written by one layout resumes on another, online: the resumed steps
// follow the uninterrupted run of the new layout.
TEST(Zero, CheckpointsReshardOntoAnyLayout) {
  const std::string base = testing::TempDir() + "/tetra_zero_ckpt_" + std::to_string(::getpid());
  fs::remove_all(base);
  Outcome whole = single(kAdamWClipped);
  struct Case {
    int from_n;
    std::vector<std::string> from;
    int to_n;
    std::vector<std::string> to;
    std::string what;
  };
  const std::vector<Case> cases = {
      {2, {"mesh.data=2", "zero.stage=2"}, 3, {"mesh.data=3", "zero.stage=2"}, "stage 2: 2 -> 3 ranks"},
      {3, {"mesh.data=3", "zero.stage=3"}, 2, {"mesh.data=2", "zero.stage=1"}, "3 ranks stage 3 -> 2 ranks stage 1"},
      {2, {"mesh.data=2", "zero.stage=3"}, 1, {}, "stage 3 -> one process"},
      {1, {}, 2, {"mesh.data=2", "zero.stage=3"}, "one process -> stage 3"},
      {2, {"mesh.data=2", "zero.stage=1"}, 2, {"mesh.data=2"}, "stage 1 -> data parallel"},
      {4, {"mesh.data=4", "zero.stage=1"}, 2, {"mesh.data=2", "zero.stage=2"}, "4 ranks stage 1 -> 2 ranks stage 2"},
      {2, {"mesh.data=2", "zero.stage=3"}, 4, {"mesh.pipeline=2", "mesh.data=2", "zero.stage=1", "pipeline.micro_batches=4"},
       "stage 3 -> pipeline x zero 1"},
      {4, {"mesh.pipeline=2", "mesh.data=2", "zero.stage=2", "pipeline.micro_batches=4"}, 3, {"mesh.data=3", "zero.stage=3"},
       "pipeline x zero 2 -> 3 ranks stage 3"},
  };
  int k = 0;
  for (const auto& c : cases) {
    const std::string dir = base + "/" + std::to_string(k++);
    auto from = kAdamWClipped;
    from.insert(from.end(), c.from.begin(), c.from.end());
    write_checkpoint_at_10(dir, c.from_n, from);
    ASSERT_TRUE(CheckpointStore(dir, 3).latest()) << c.what;
    auto to = kAdamWClipped;
    to.insert(to.end(), c.to.begin(), c.to.end());
    to.push_back("checkpoint.dir=" + dir);
    Outcome rest = c.to_n == 1 ? single(to) : parallel(c.to_n, to, false);
    EXPECT_NE(rest.result.resumed_from.find("step-00000010"), std::string::npos) << c.what << ": " << rest.result.resumed_from;
    numerics::expect_resumed_follows(whole, rest, 10, 1e-5, c.what);
  }
  fs::remove_all(base);
}

TEST(Zero, ACheckpointOfAnotherModelIsAClearErrorAndChangesNothing) {
  const std::string dir = testing::TempDir() + "/tetra_zero_bad_" + std::to_string(::getpid());
  fs::remove_all(dir);
  write_checkpoint_at_10(dir, 2, {"mesh.data=2", "zero.stage=2"});
  const auto before = CheckpointStore(dir, 3).list();
  set_threads(1);
  collectives::run_local_ranks(2, [&](int, collectives::Communicator& world) {
    TrainerOptions o;
    o.world = world.shared_from_this();
    try {
      Trainer(job({"mesh.data=2", "zero.stage=3", "model.hidden=[64,16]", "checkpoint.dir=" + dir}), o).run();
      ADD_FAILURE() << "resumed a checkpoint of another model";
    } catch (const ConfigError& e) {
      const std::string msg = e.what();
      // The checkpoint's identity says what differs before any tensor is read (Note
      // [Checkpoint identity]).
      EXPECT_NE(msg.find("step-00000010"), std::string::npos) << msg;
      EXPECT_NE(msg.find("holds another model or data (model.hidden [64,32] there, [64,16] here"), std::string::npos)
          << msg;
    }
  });
  EXPECT_EQ(CheckpointStore(dir, 3).list(), before);  // nothing written, nothing removed
  fs::remove_all(dir);
}

TEST(Zero, AStageOutsideZeroToThreeIsAConfigError) {
  try {
    job({"zero.stage=4"});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("zero.stage"), std::string::npos) << e.what();
  }
}

// With zero.stage >= 1 ZeRO synchronises the data axis, not the data_parallel allreduce,
// even when the job has a data_parallel section.
TEST(Zero, TakesTheDataAxisFromDataParallel) {
  set_threads(1);
  collectives::run_local_ranks(2, [&](int, collectives::Communicator& world) {
    TrainerOptions o;
    o.world = world.shared_from_this();
    Trainer t(job({"mesh.data=2", "zero.stage=2", "data_parallel.bucket_mb=1"}), o);
    std::vector<std::string> names;
    for (const auto& s : t.strategies()) names.push_back(s->name());
    EXPECT_EQ(names, std::vector<std::string>{"zero"});
  });
}

// Evaluation: the data ranks' parts of the test set may need different numbers of
// forwards (300 and 301 samples in batches of 300); ZeRO-3 gathers inside every forward,
// so a rank with fewer must still join the others' gathers, and the sums stay exact.
TEST(Zero, EvaluationOfUnevenPartsAtStageThreeIsExact) {
  const std::vector<std::string> sets = {"data.eval_samples=601", "data.eval_batch_size=300", "train.max_steps=3"};
  Outcome ref = single(sets);
  auto z = sets;
  z.push_back("zero.stage=3");
  z.push_back("collectives.timeout_s=60");
  Outcome got = parallel(2, z);
  ASSERT_TRUE(ref.result.final_eval && got.result.final_eval);
  EXPECT_EQ(got.result.final_eval->samples, 601);
  EXPECT_NEAR(got.result.final_eval->test_loss, ref.result.final_eval->test_loss, 1e-5 * ref.result.final_eval->test_loss);
  EXPECT_EQ(*got.result.final_eval->accuracy, *ref.result.final_eval->accuracy);
}
