// train.on_nonfinite under every strategy (thread-ranks over `local`): one sample of one
// step reads as NaN, so only the rank whose shard holds it sees a non-finite loss — or,
// under the pipeline, only the last stage, while the first parameter lives on the first —
// and the per-step allreduce (Note [One decision per step]) must carry it to every rank.
// stop: every rank fails with the same message, naming the step, the micro-batch, the data
// rank and the first parameter in model order. skip: every layout ends with the parameters
// and losses of the one-process run that skips the same step (the numerics contract; plain
// SGD without clipping, and AdamW). Here because this folder links every plugin; the
// one-process cases are tests/core/test_faults.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <mutex>

#include "collectives/error.h"
#include "collectives/local.h"
#include "tests/common/numerics.h"
#include "tests/core/poisoned_data.h"

using namespace tetra;
using namespace tetra::core;

namespace {

const char* kJob = R"(
model: {type: mlp, hidden: [32, 16]}
data: {type: synthetic, shape: [12], classes: 4, train_samples: 2048, test_samples: 64, batch_size: 64}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: 6, seed: 9, threads: 1}
data_parallel: {bucket_mb: 0.001}
zero: {bucket_mb: 0.001}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

using testing_faults::PoisonedData;

// Step 3, position 51 of 64: the second half of the batch (data rank 1 of 2; 3 of 4), and
// within a rank's 32 rows the third micro-batch of 4.
constexpr int64_t kStep = 3, kPosition = 51;

TrainerOptions poisoned(const JobSpec& spec) {
  TrainerOptions o;
  o.data = std::make_shared<PoisonedData>(spec, kStep, kPosition);
  return o;
}

JobSpec job(std::vector<std::string> sets) { return numerics::job(kJob, sets, "faults"); }

// Every rank's error message (processes x replicas; a process's replicas report its first).
std::vector<std::string> messages(const JobSpec& spec, int processes) {
  std::vector<std::string> out(static_cast<size_t>(processes));
  const TrainerOptions base = poisoned(spec);
  const int R = Plan(spec).replicas();
  collectives::run_local_ranks(processes, [&](int p, collectives::Communicator& world) {
    TrainerOptions o = base;
    o.world = world.shared_from_this();
    try {
      if (R > 1) {
        replicate::train(spec, o);
      } else {
        Trainer t(spec, o);
        t.run();
      }
      out[static_cast<size_t>(p)] = "finished";
    } catch (const std::exception& e) {
      out[static_cast<size_t>(p)] = e.what();
    }
  });
  return out;
}

std::string first_parameter() { return Trainer(job({})).model()->named_parameters()[0].key(); }

std::string stop_message(const std::string& where) {
  return "step 3 (epoch 1)" + where + ": the loss is nan; first parameter whose gradient is not finite: " +
         first_parameter() + " (train.on_nonfinite: stop; lower optimizer.lr, set optimizer.clip_grad_norm, or use skip)";
}

struct Layout {
  std::string name;
  int processes;
  std::vector<std::string> sets;
  std::string where;  // what the stop message says of the place
};

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> all = {
      {"data parallel", 2, {"mesh.data=2"}, ", data rank 1"},
      {"data parallel, accumulation", 2, {"mesh.data=2", "train.accumulation_steps=4"}, ", micro-batch 3 of 4 on data rank 1"},
      {"zero 1", 2, {"mesh.data=2", "zero.stage=1"}, ", data rank 1"},
      {"zero 2", 2, {"mesh.data=2", "zero.stage=2"}, ", data rank 1"},
      {"zero 3", 2, {"mesh.data=2", "zero.stage=3", "train.accumulation_steps=4"}, ", micro-batch 3 of 4 on data rank 1"},
      {"pipeline x data", 4, {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4"}, ", micro-batch 3 of 4 on data rank 1"},
      {"pipeline x zero 2", 4, {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4", "zero.stage=2"},
       ", micro-batch 3 of 4 on data rank 1"},
      {"replicas", 2, {"mesh.data=2", "replicate.replicas=2"}, ", data rank 3"},
  };
  return all;
}

}  // namespace

TEST(NonfiniteEverywhere, StopSaysTheSameOnEveryRank) {
  for (const Layout& l : layouts()) {
    const std::vector<std::string> got = messages(job(l.sets), l.processes);
    for (size_t p = 0; p < got.size(); ++p) EXPECT_EQ(got[p], stop_message(l.where)) << l.name << ", process " << p;
  }
}

TEST(NonfiniteEverywhere, SkipFollowsTheOneProcessRunThatSkips) {
  for (const char* optimizer : {"optimizer.type=sgd", "optimizer.type=adamw"}) {
    const JobSpec one = job({"train.on_nonfinite=skip", optimizer});
    const numerics::Outcome ref = numerics::run_single(one, poisoned(one));
    ASSERT_EQ(ref.result.skipped_steps, 1);
    ASSERT_EQ(ref.result.losses.size(), 5u);
    for (const Layout& l : layouts()) {
      std::vector<std::string> sets = l.sets;
      sets.insert(sets.end(), {"train.on_nonfinite=skip", optimizer});
      const JobSpec spec = job(sets);
      const numerics::Outcome got = numerics::run_parallel(spec, l.processes, poisoned(spec));
      EXPECT_EQ(got.result.skipped_steps, 1) << l.name;
      EXPECT_EQ(got.result.final_step, 6) << l.name;
      numerics::expect_follows(ref, got, 1e-5, l.name + ", " + optimizer);
    }
  }
}
