// The per-rank estimate of `train --dry-run` (Note [Per-rank estimate]) against a real
// run on thread-ranks: every rank's model state (parameters, gradients, optimizer state,
// buffers) equals what Trainer::memory() counts at the end of the run, to the byte, and
// the bytes each mesh axis carries in one step equal what its communicators were handed
// in the run's second step (Note [Traffic counters]: the counters of an axis include
// every communicator split from it). ZeRO stages 0 (data_parallel) to 3, and a pipeline
// x data mesh under each gradient synchroniser.
//
// Activations are estimated, not measured here: nothing in a run counts the bytes
// autograd keeps, so the test leaves them out.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "core/mesh.h"
#include "core/runtime.h"
#include "core/model_plan.h"
#include "core/trainer.h"
#include "tests/common/numerics.h"

using namespace tetra;
using namespace tetra::core;
using collectives::Traffic;

namespace {

// Small enough to run fast, large enough for several buckets (bucket_mb below) and for
// shards that need padding (a layer of 10 outputs).
const char* kJob = R"(
model: {type: mlp, hidden: [48, 24]}
data: {type: fashion-mnist, batch_size: 48, eval_samples: 96}
optimizer: {type: adamw, lr: 1.0e-3, clip_grad_norm: 1.0}
train: {max_steps: 3, seed: 3, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

const std::vector<std::string> kAxes = {"pipeline", "tensor", "data"};

struct Measured {
  ModelStateBytes memory;
  std::map<std::string, Traffic> step;  // step 2's traffic, per axis
};

// Runs the job on its mesh's processes as thread-ranks; each rank's memory at the end
// and its traffic per axis between the end of step 1 and the end of step 2.
std::vector<Measured> run(const JobSpec& spec) {
  set_threads(1);
  const int processes = Plan(spec).process_count();
  std::vector<Measured> out(static_cast<size_t>(processes));
  collectives::run_local_ranks(processes, [&](int p, collectives::Communicator& world) {
    TrainerOptions o;
    o.world = world.shared_from_this();
    Trainer* trainer = nullptr;
    std::map<std::string, Traffic> after_first;
    Measured& m = out[static_cast<size_t>(p)];
    auto traffic = [&](const std::string& axis) { return trainer->mesh()->axis(axis)->traffic(); };
    o.on_step = [&](int64_t step, double) {
      for (const auto& axis : kAxes) {
        if (step == 1) after_first[axis] = traffic(axis);
        if (step == 2) m.step[axis] = traffic(axis) - after_first[axis];
      }
    };
    Trainer t(spec, o);
    trainer = &t;
    m.memory = t.run().memory;
  });
  return out;
}

std::vector<RankEstimate> estimate(const JobSpec& spec) { return ModelPlan(spec).estimate(); }

void expect_matches(const std::vector<std::string>& sets, const char* yaml = kJob) {
  std::string what;
  for (const auto& s : sets) what += s + " ";
  SCOPED_TRACE(what);
  const JobSpec spec = numerics::job(yaml, sets, "estimate");
  const std::vector<RankEstimate> est = estimate(spec);
  const std::vector<Measured> got = run(spec);
  ASSERT_EQ(est.size(), got.size());
  for (size_t r = 0; r < est.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const ModelStateBytes& e = est[r].state;
    const ModelStateBytes& m = got[r].memory;
    EXPECT_EQ(e.parameters, m.parameters);
    EXPECT_EQ(e.gradients, m.gradients);
    EXPECT_EQ(e.optimizer, m.optimizer);
    EXPECT_EQ(e.buffers, m.buffers);
    EXPECT_GT(m.total(), 0);
    std::printf("  %s rank %zu: state %lld B (params %lld, grads %lld, optimizer %lld, buffers %lld)", what.c_str(), r,
                static_cast<long long>(m.total()), static_cast<long long>(m.parameters),
                static_cast<long long>(m.gradients), static_cast<long long>(m.optimizer),
                static_cast<long long>(m.buffers));
    for (const auto& axis : kAxes) std::printf("; %s %s", axis.c_str(), got[r].step.at(axis).str().c_str());
    std::printf("\n");
    for (const auto& axis : kAxes) {
      auto it = est[r].traffic.find(axis);
      const Traffic want = it == est[r].traffic.end() ? Traffic{} : it->second;
      const Traffic have = got[r].step.at(axis);
      EXPECT_EQ(want, have) << axis << " axis: estimated " << want.str() << "; the run " << have.str();
    }
  }
}

TEST(Estimate, DataParallelMatchesARun) { expect_matches({"mesh.data=2", "data_parallel.bucket_mb=0.05"}); }

TEST(Estimate, ZeroStage1MatchesARun) { expect_matches({"mesh.data=2", "zero.stage=1", "zero.bucket_mb=0.05"}); }

TEST(Estimate, ZeroStage2MatchesARun) { expect_matches({"mesh.data=3", "zero.stage=2", "zero.bucket_mb=0.05"}); }

TEST(Estimate, ZeroStage3MatchesARun) { expect_matches({"mesh.data=2", "zero.stage=3"}); }

// The cost model prices ZeRO-3's prefetched gathers chained (Note [Fitted
// collectives]): every gather but the forward's first; none without prefetch, and no
// reduce-scatter (each is issued after a layer's backward).
TEST(Estimate, ZeroStage3NamesTheOpsItChains) {
  for (int prefetch : {0, 1}) {
    SCOPED_TRACE("prefetch " + std::to_string(prefetch));
    const JobSpec spec = numerics::job(kJob, {"mesh.data=2", "zero.stage=3", "zero.prefetch=" + std::to_string(prefetch)}, "chained");
    for (const RankEstimate& r : estimate(spec)) {
      const Traffic& all = r.traffic.at("data");
      const Traffic& chained = r.chained.at("data");
      const int64_t units = all.count[Traffic::kReduceScatter];
      ASSERT_GT(units, 1);
      EXPECT_EQ(chained.count[Traffic::kReduceScatter], 0);
      EXPECT_EQ(chained.count[Traffic::kAllgather], prefetch ? all.count[Traffic::kAllgather] - 1 : 0);
      EXPECT_EQ(chained.count[Traffic::kAllreduce], 0);
    }
  }
}

TEST(Estimate, ZeroStage3WithAccumulationMatchesARun) {
  expect_matches({"mesh.data=2", "zero.stage=3", "train.accumulation_steps=2", "optimizer.type=sgd",
                  "optimizer.momentum=0.9", "optimizer.clip_grad_norm=0"});
}

TEST(Estimate, PipelineTimesDataParallelMatchesARun) {
  expect_matches({"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4", "pipeline.schedule=1f1b",
                  "data_parallel.bucket_mb=0.05"});
}

TEST(Estimate, GPipeTimesZeroStage2MatchesARun) {
  expect_matches({"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=3", "pipeline.schedule=gpipe",
                  "zero.stage=2", "zero.bucket_mb=0.05"});
}

// The dry-run's table prints a row per rank and states its byte convention.
// A GPT over the tensor axis: the split layers' parts at 1/T, and the activations each
// block half sums (or gathers and reduce-scatters, under sequence parallelism), composed
// with a pipeline, the data axis and ZeRO.
const char* kGptJob = R"(
model: {type: gpt, layers: 2, d_model: 32, heads: 4}
data: {type: text, seq_len: 16, batch_size: 8, eval_samples: 16}
optimizer: {type: adamw, lr: 1.0e-3, clip_grad_norm: 1.0}
train: {max_steps: 3, seed: 3, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

std::vector<std::string> gpt(std::vector<std::string> sets) {
  sets.push_back("data.path=" + numerics::small_text("tetra_estimate_text.txt"));
  return sets;
}

TEST(Estimate, TensorParallelMatchesARun) {
  expect_matches(gpt({"mesh.tensor=2"}), kGptJob);
  expect_matches(gpt({"mesh.tensor=2", "tensor.sequence_parallel=true", "mesh.data=2", "zero.stage=3"}), kGptJob);
  expect_matches(gpt({"mesh.tensor=2", "mesh.pipeline=2", "pipeline.micro_batches=2", "model.layers=3"}), kGptJob);
}

TEST(Estimate, TableNamesEveryRankAndTheConvention) {
  const JobSpec spec = numerics::job(kJob, {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4"}, "estimate");
  const std::vector<RankEstimate> est = estimate(spec);
  ASSERT_EQ(est.size(), 4u);
  const std::string table = estimate_table(Plan(spec), est);
  EXPECT_NE(table.find("2(n-1)/n"), std::string::npos) << table;
  EXPECT_NE(table.find("sent/pipeline"), std::string::npos) << table;
  EXPECT_NE(table.find("sent/data"), std::string::npos) << table;
  // Different stages hold different layers and send different bytes.
  const RankEstimate* stage[2] = {nullptr, nullptr};
  for (const auto& r : est) stage[r.coord.at("pipeline")] = &r;
  ASSERT_TRUE(stage[0] && stage[1]);
  EXPECT_NE(stage[0]->layers, stage[1]->layers);
  EXPECT_GT(stage[0]->traffic.at("pipeline").sent, 0);
  EXPECT_NE(stage[0]->state.parameters, stage[1]->state.parameters);
}

}  // namespace
