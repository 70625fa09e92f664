// The numerics contract for pipelines: with the same seed and global batch, every
// schedule, any valid micro-batch count, with and without activation checkpointing, and
// pipeline x data follow the single-process loss at every step within relative 1e-5
// (fp32). Stages run as thread-ranks over the local backend; the mpirun runs are in
// tests/tools (TrainMpi.Pipeline*). Also: checkpoints that resume on another layout,
// the per-stage trace, and the mistakes that must be clear errors before any rank talks.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>

#include "collectives/error.h"
#include "collectives/local.h"
#include "core/job_file.h"
#include "core/models.h"
#include "core/runtime.h"
#include "core/model_plan.h"
#include "core/trainer.h"
#include "data_parallel/data_parallel.h"
#include "pipeline/pipeline.h"
#include "tests/common/numerics.h"

using namespace tetra;
using namespace tetra::core;
namespace fs = std::filesystem;

namespace {

// 8 layers: Flatten, (Linear, ReLU) x 3, Linear. clip_grad_norm: the norm spans stages.
const char* kJob = R"(
model: {type: mlp, hidden: [64, 48, 32]}
data: {type: fashion-mnist, batch_size: 96, eval_samples: 600}
optimizer: {type: adamw, lr: 2.0e-3, weight_decay: 0.01, clip_grad_norm: 1.0}
schedule: {type: cosine, warmup_steps: 5}
train: {max_steps: 12, seed: 5, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

// One name for every run here (numerics' "job"): a checkpoint resumes only its own job.
JobSpec job(std::vector<std::string> sets) { return numerics::job(kJob, sets); }

// The shared harness (tests/common/numerics.h); this file compares losses and the final
// evaluation (AdamW with clipping here; the plain-SGD parameter comparison of every
// layout is tests/pipeline/test_dropout_layouts.cpp's and the replicate tests').
TrainResult single(std::vector<std::string> sets = {}) { return numerics::run_single(kJob, sets).result; }

// Runs the job on pipeline x data thread-ranks; rank 0's result (all ranks must agree).
TrainResult parallel(int stages, int data, std::vector<std::string> sets) {
  sets.push_back("mesh.pipeline=" + std::to_string(stages));
  sets.push_back("mesh.data=" + std::to_string(data));
  return numerics::run_parallel(kJob, stages * data, sets).result;
}

void expect_follows(const TrainResult& ref, const TrainResult& got, const std::string& what) {
  ASSERT_EQ(ref.losses.size(), got.losses.size()) << what;
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i])) << what << ", step " << i + 1;
  ASSERT_TRUE(ref.final_eval && got.final_eval) << what;
  EXPECT_NEAR(got.final_eval->test_loss, ref.final_eval->test_loss, 1e-5 * ref.final_eval->test_loss) << what;
  EXPECT_NEAR(*got.final_eval->accuracy, *ref.final_eval->accuracy, 2.0 / 600 + 1e-9) << what;
}

std::vector<std::string> pp(const std::string& schedule, int m, std::vector<std::string> more = {}) {
  more.push_back("pipeline.schedule=" + schedule);
  more.push_back("pipeline.micro_batches=" + std::to_string(m));
  return more;
}

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::path(testing::TempDir()) / ("tetra_pp_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// The ConfigError `fn` throws (on every thread-rank), or "" when none.
std::string config_error(int ranks, const std::function<void(collectives::Communicator*)>& fn) {
  std::vector<std::string> got(ranks);
  auto one = [&](int r, collectives::Communicator* w) {
    try {
      fn(w);
    } catch (const ConfigError& e) {
      got[r] = e.what();
    }
  };
  if (ranks == 1) {
    one(0, nullptr);
  } else {
    collectives::run_local_ranks(ranks, [&](int r, collectives::Communicator& w) { one(r, &w); });
  }
  for (int r = 1; r < ranks; ++r) EXPECT_EQ(got[r], got[0]) << "rank " << r;
  return got[0];
}

}  // namespace

TEST(Pipeline, EveryScheduleFollowsOneProcessOnTwoStages) {
  const TrainResult ref = single();
  for (int m : {1, 3, 4}) expect_follows(ref, parallel(2, 1, pp("gpipe", m)), "gpipe m=" + std::to_string(m));
  for (int m : {1, 2, 6}) expect_follows(ref, parallel(2, 1, pp("1f1b", m)), "1f1b m=" + std::to_string(m));
  expect_follows(ref, parallel(2, 1, pp("1f1b", 4, {"pipeline.prefetch=2"})), "1f1b m=4, receives posted ahead");
  for (int m : {2, 4})
    expect_follows(ref, parallel(2, 1, pp("interleaved_1f1b", m, {"pipeline.virtual_stages=2"})),
                   "interleaved v=2 m=" + std::to_string(m));
}

TEST(Pipeline, FourStagesAndUnevenBalances) {
  const TrainResult ref = single();
  expect_follows(ref, parallel(4, 1, pp("1f1b", 8)), "1f1b P=4 m=8");
  expect_follows(ref, parallel(4, 1, pp("1f1b", 2, {"pipeline.balance=by_params"})), "1f1b P=4 m=2 by_params");
  expect_follows(ref, parallel(4, 1, pp("interleaved_1f1b", 4, {"pipeline.virtual_stages=2"})),
                 "interleaved P=4 v=2 m=4 (8 stages of one layer)");
  expect_follows(ref, parallel(2, 1, pp("gpipe", 4, {"pipeline.balance=[1, 7]"})), "gpipe balance [1, 7]");
  expect_follows(ref, parallel(2, 1, pp("1f1b", 4, {"pipeline.balance=by_time"})), "1f1b by_time");
}

TEST(Pipeline, ActivationCheckpointingFollows) {
  const TrainResult ref = single();
  for (const char* mode : {"except_last", "always"}) {
    expect_follows(ref, parallel(2, 1, pp("gpipe", 4, {std::string("pipeline.checkpoint=") + mode})),
                   std::string("gpipe checkpoint ") + mode);
    expect_follows(ref, parallel(2, 1, pp("1f1b", 6, {std::string("pipeline.checkpoint=") + mode})),
                   std::string("1f1b checkpoint ") + mode);
  }
  expect_follows(ref, parallel(2, 1, pp("interleaved_1f1b", 2, {"pipeline.virtual_stages=2", "pipeline.checkpoint=always"})),
                 "interleaved checkpoint always");
}

TEST(Pipeline, OneRankWithVirtualStagesHandsOverLocally) {
  // P = 1: no world at all; two chunks on the one rank pass activations in memory.
  const TrainResult ref = single();
  set_threads(1);
  expect_follows(ref, Trainer(job(pp("interleaved_1f1b", 4, {"pipeline.virtual_stages=2"}))).run(), "P=1 v=2");
  expect_follows(ref, Trainer(job(pp("gpipe", 3, {"pipeline.checkpoint=always"}))).run(), "P=1 gpipe checkpoint");
}

TEST(Pipeline, ProbingAndTimingTheLayersDrawNoRandomNumbers) {
  // attach's shape probe and by_time's timing run the layers in training mode: they leave
  // torch's generator where building the model left it (it seeds other thread-ranks'
  // parameters), and one stage with one micro-batch is one process, dropout included.
  set_threads(1);
  { Trainer unprobed(job({"model.dropout=0.2"})); }
  const at::Tensor built = at::detail::getDefaultCPUGenerator().get_state();
  const TrainResult ref = single({"model.dropout=0.2"});
  Trainer probed(job(pp("gpipe", 1, {"model.dropout=0.2", "pipeline.balance=by_time"})));
  EXPECT_TRUE(at::detail::getDefaultCPUGenerator().get_state().equal(built));
  EXPECT_EQ(probed.run().losses, ref.losses);
}

TEST(Pipeline, RunningLayersWaitsWhileAThreadRankDrawsItsParameters) {
  // Thread-ranks share the process's generator. Running layers to learn about them puts
  // it back afterwards; doing that while another thread-rank seeds it and draws its model
  // (the trainer holds global_rng_mutex for that) hands that rank other weights. So it
  // waits for the lock, and a draw made under the lock is never rewound.
  const JobSpec spec = job({"model.dropout=0.2"});
  auto data = make_dataset(spec.data, spec.train.seed);
  torch::nn::Sequential model = build_model(spec.model, data->info(), 1);
  std::unique_lock<std::mutex> lock(global_rng_mutex());
  auto measured = std::async(std::launch::async, [&] { return pipeline::measure_layers(model, *data, 8, false, false); });
  EXPECT_EQ(measured.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "layers ran while another thread-rank held the generator";
  torch::manual_seed(11);
  torch::rand({4});
  const at::Tensor after = at::detail::getDefaultCPUGenerator().get_state();
  lock.unlock();
  EXPECT_EQ(measured.get().size(), model->size());
  EXPECT_TRUE(at::detail::getDefaultCPUGenerator().get_state().equal(after)) << "the generator was rewound";
}

TEST(Pipeline, PipelineTimesDataFollowsOneProcess) {
  const TrainResult ref = single();
  expect_follows(ref, parallel(2, 2, pp("1f1b", 4)), "pipeline 2 x data 2, 1f1b m=4");
  expect_follows(ref, parallel(2, 2, pp("gpipe", 3, {"data_parallel.overlap=false", "pipeline.checkpoint=always"})),
                 "pipeline 2 x data 2, gpipe m=3, checkpoint, no overlap");
}

TEST(Pipeline, CheckpointFromTwoStagesResumesOnOneProcessAndOnTwoStages) {
  fs::path d = fresh_dir("resume");
  const TrainResult whole = single({"train.max_steps=20"});
  // 20 steps on 2 stages, saved at step 10 (the whole model, gathered to rank 0)...
  auto at = [&](const std::string& dir, std::vector<std::string> s) {
    s.push_back("train.max_steps=20");
    s.push_back("checkpoint.dir=" + (d / dir).string());
    return s;
  };
  expect_follows(whole, parallel(2, 1, at("a", pp("1f1b", 4, {"checkpoint.every_steps=10"}))), "1f1b, saving");
  const std::string step10 = (d / "a" / "step-00000010").string();
  ASSERT_TRUE(fs::exists(step10));
  // ...resumes as one process without a pipeline, and on 2 stages with another balance.
  set_threads(1);
  TrainResult one = Trainer(job(at("b", {"checkpoint.resume=" + step10}))).run();
  EXPECT_EQ(one.resumed_from, step10);
  TrainResult two = parallel(2, 1, at("c", pp("gpipe", 2, {"pipeline.balance=[2, 6]", "checkpoint.resume=" + step10})));
  ASSERT_EQ(one.losses.size(), 10u);
  ASSERT_EQ(two.losses.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_NEAR(one.losses[i], whole.losses[10 + i], 1e-5 * whole.losses[10 + i]) << "one process, step " << 11 + i;
    EXPECT_NEAR(two.losses[i], whole.losses[10 + i], 1e-5 * whole.losses[10 + i]) << "two stages, step " << 11 + i;
  }
}

TEST(Pipeline, TraceHasATrackPerStageWithEveryMicroBatch) {
  fs::path d = fresh_dir("trace");
  parallel(2, 1, pp("1f1b", 4, {"train.max_steps=2", "log.trace=" + (d / "trace.json").string()}));
  for (int r = 0; r < 2; ++r) {
    std::ifstream in(d / ("trace.rank" + std::to_string(r) + ".json"));
    ASSERT_TRUE(in) << "rank " << r;
    nlohmann::json t = nlohmann::json::parse(in);
    const auto& events = t.is_object() ? t["traceEvents"] : t;
    std::set<std::string> names;
    std::set<std::string> threads;
    for (const auto& e : events) {
      if (e.value("ph", "") == "M" && e.value("name", "") == "thread_name") threads.insert(e["args"]["name"].get<std::string>());
      if (e.value("ph", "") == "X") names.insert(e["name"].get<std::string>());
    }
    EXPECT_TRUE(threads.count("stage " + std::to_string(r))) << "rank " << r;
    for (int i = 0; i < 4; ++i) {
      EXPECT_TRUE(names.count("F" + std::to_string(i))) << "rank " << r << " F" << i;
      EXPECT_TRUE(names.count("B" + std::to_string(i))) << "rank " << r << " B" << i;
    }
  }
}

TEST(Pipeline, ImpossibleNumbersAreClearErrorsBeforeAnyRankTalks) {
  auto parse_error = [](std::vector<std::string> sets) {
    try {
      job(sets);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto has = [](const std::string& text, const std::string& part) {
    EXPECT_NE(text.find(part), std::string::npos) << "\"" << part << "\" not in:\n" << text;
  };
  has(parse_error({"mesh.pipeline=2", "pipeline.micro_batches=5"}),
      "data.batch_size 96 does not split into 1 data-parallel rank x 5 micro-batches");
  has(parse_error({"mesh.pipeline=4", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
                   "pipeline.micro_batches=6"}),
      "interleaved_1f1b needs micro_batches to be a multiple of the 4 pipeline stages, got 6");
  has(parse_error({"mesh.pipeline=2", "pipeline.virtual_stages=2"}), "set schedule: interleaved_1f1b");
  has(parse_error({"mesh.pipeline=2", "pipeline.schedule=1f1f"}), "pipeline.schedule");
  has(parse_error({"mesh.pipeline=2", "train.accumulation_steps=5"}),
      "does not split into 1 data-parallel rank x 40 micro-batches (pipeline.micro_batches x train.accumulation_steps)");
  has(parse_error({"mesh.pipeline=2", "pipeline.balance=[4, 2, 2]"}), "lists 3 layer counts, but there are 2 stages");
  has(parse_error({"mesh.pipeline=2", "pipeline.micro_batch=4"}), "micro_batch");  // a typo is not ignored

  // Known only once the model exists: every rank finds it in attach, before it sends.
  set_threads(1);
  auto trainer_error = [](int ranks, std::vector<std::string> sets) {
    return config_error(ranks, [&](collectives::Communicator* w) {
      TrainerOptions o;
      if (w) o.world = w->shared_from_this();
      Trainer t(job(sets), o);
    });
  };
  has(trainer_error(4, {"mesh.pipeline=4", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=4",
                        "pipeline.micro_batches=8"}),
      "the model has 8 layers, fewer than the 16 stages (pipeline 4 x virtual_stages 4)");
  has(trainer_error(2, {"mesh.pipeline=2", "pipeline.balance=[4, 5]"}), "balance [4, 5] adds up to 9 layers, the model has 8");
  has(trainer_error(1, {"mesh.pipeline=2"}), "run it under mpirun -np 2");
}

TEST(Pipeline, DryRunPlanShowsStagesCostsAndTheSchedule) {
  set_threads(1);
  ModelPlan t(job({"mesh.pipeline=2", "pipeline.micro_batches=4", "pipeline.balance=by_params"}));
  const std::string plan = t.strategies_text();
  EXPECT_NE(plan.find("pipeline: 2 ranks, schedule 1f1b, 4 micro-batches of 24"), std::string::npos) << plan;
  EXPECT_NE(plan.find("balance by_params [2, 6]"), std::string::npos) << plan;  // 784x64 outweighs the rest
  EXPECT_NE(plan.find("bubble 20.0% (ideal (P-1)/(m+P-1) = 20.0%)"), std::string::npos) << plan;
  EXPECT_NE(plan.find("rank 0 | F0 F1 .. .. B0 B0"), std::string::npos) << plan;
  EXPECT_NE(plan.find("rank 1 | .. F0 B0 B0 F1"), std::string::npos) << plan;
  // The zero-bubble schedules are drawn and priced as the others: B and W a slot each.
  ModelPlan zb(job({"mesh.pipeline=2", "pipeline.micro_batches=4", "pipeline.schedule=zbh1", "pipeline.memory_gb=1"}));
  const std::string zplan = zb.strategies_text();
  EXPECT_NE(zplan.find("ideal (P-1)/(3m+P-1) = 7.7%"), std::string::npos) << zplan;
  EXPECT_NE(zplan.find("B (input gradient) = 1, W (weight gradient) = 1"), std::string::npos) << zplan;
  EXPECT_NE(zplan.find("rank 1 | .. F0 B0 F1 B1 W0 F2 B2 W1"), std::string::npos) << zplan;
  EXPECT_NE(zplan.find("pipeline.memory_gb 1 per rank"), std::string::npos) << zplan;
}

// Note [Layer costs]: over the budget, each layer is timed on one short sample and scaled
// by FLOPs; the output sizes are the micro-batch's either way (one sample's probe, a
// 256-token sequence probed as 64 and scaled), and the plan says the times were scaled.
TEST(Pipeline, LayersTooBigToTimeAreTimedOnOneSampleAndScaled) {
  set_threads(1);
  const JobSpec spec = numerics::job(R"(
model: {type: gpt, layers: 2, heads: 2, d_model: 32}
data: {type: text, path: /usr/share/common-licenses/GPL-3, seq_len: 256, batch_size: 8, eval_samples: 8}
optimizer: {type: sgd, lr: 0.1}
train: {max_steps: 1, seed: 5, threads: 1}
)", {}, "gpt");
  auto data = make_dataset(spec.data, spec.train.seed);
  torch::nn::Sequential model = build_model(spec.model, data->info(), 1);
  const auto whole = pipeline::measure_layers(model, *data, 8, false, true);
  const auto scaled = pipeline::measure_layers(model, *data, 8, false, true, /*max_timed_flops=*/0);
  ASSERT_EQ(whole.size(), scaled.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_FALSE(whole[i].scaled);
    EXPECT_TRUE(scaled[i].scaled);
    EXPECT_EQ(scaled[i].activation_bytes, whole[i].activation_bytes) << whole[i].name;
    EXPECT_GT(scaled[i].forward_s, 0) << scaled[i].name;
    EXPECT_GT(scaled[i].backward_s, 0) << scaled[i].name;
  }
  // a GptBlock's output for 8 sequences of 256 positions of 32 floats
  EXPECT_EQ(whole[1].activation_bytes, 8 * 256 * 32 * 4);
  ModelPlan small(job({"mesh.pipeline=2"}));
  EXPECT_EQ(small.strategies_text().find("scaled by its FLOPs"), std::string::npos) << small.strategies_text();
}

// Note [Run folder] and Note [Per-rank records], on two stages over thread-ranks: the
// train records carry each rank's model state (the stages hold different layers), the
// interval's pipeline bubble and the pipeline axis's communication time; the run leaves
// job.yaml (which parses back to the same job) and summary.json, whose per-rank entries
// agree with the last record, and whose communication seconds — the union of the ops'
// run intervals — never exceed the time the run took.
TEST(PipelineRunFolder, RecordsAndSummaryCarryEveryRanksNumbers) {
  const fs::path d = fresh_dir("run_folder");
  const TrainResult r = parallel(2, 1, pp("1f1b", 4, {"log.dir=" + d.string(), "log.metrics=" + (d / "metrics.jsonl").string(),
                                                      "log.every=3", "log.trace=" + (d / "trace.json").string()}));
  std::ifstream in(d / "metrics.jsonl");
  nlohmann::json last;
  int records = 0;
  for (std::string line; std::getline(in, line);) {
    const auto rec = nlohmann::json::parse(line);
    if (!rec.contains("loss")) continue;
    ++records;
    ASSERT_TRUE(rec.contains("comm_ms") && rec["comm_ms"].contains("pipeline")) << line;
    EXPECT_GT(rec["comm_ms"]["pipeline"].get<double>(), 0) << line;
    ASSERT_TRUE(rec.contains("pipeline_bubble")) << line;
    EXPECT_GT(rec["pipeline_bubble"].get<double>(), 0) << line;
    EXPECT_LT(rec["pipeline_bubble"].get<double>(), 1) << line;
    ASSERT_EQ(rec["ranks"].size(), 2u) << line;
    EXPECT_NE(rec["ranks"][0]["model_state_bytes"], rec["ranks"][1]["model_state_bytes"]) << line;
    last = rec;
  }
  EXPECT_EQ(records, 4);  // steps 3, 6, 9, 12

  const auto summary = nlohmann::json::parse(std::ifstream(d / "summary.json"));
  EXPECT_EQ(summary["world"], 2);
  EXPECT_EQ(summary["final_step"], 12);
  EXPECT_EQ(summary["mesh"]["pipeline"], 2);
  EXPECT_DOUBLE_EQ(summary["final_loss"].get<double>(), r.final_loss);
  ASSERT_EQ(summary["ranks"].size(), 2u);
  ASSERT_EQ(summary["traces"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const auto& row = summary["ranks"][i];
    EXPECT_EQ(row["model_state_bytes"]["total"], last["ranks"][i]["model_state_bytes"]) << i;
    const double comm = row["comm_s"]["pipeline"].get<double>();
    EXPECT_GT(comm, 0) << i;
    EXPECT_LE(comm, summary["total_seconds"].get<double>()) << i;
    EXPECT_GT(row["pipeline_bubble"].get<double>(), 0) << i;
    EXPECT_TRUE(fs::exists(summary["traces"][i].get<std::string>())) << summary["traces"][i];
  }
  // Each rank's trace has a span per step.
  const auto trace = nlohmann::json::parse(std::ifstream(summary["traces"][1].get<std::string>()));
  int steps = 0;
  for (const auto& e : trace["traceEvents"])
    if (e.value("ph", "") == "X" && e.value("name", "").rfind("step ", 0) == 0) ++steps;
  EXPECT_EQ(steps, 12);

  std::ifstream yaml_in(d / "job.yaml");
  const std::string yaml{std::istreambuf_iterator<char>(yaml_in), std::istreambuf_iterator<char>()};
  const auto again = parse_job_string(yaml, "again", {}, numerics::all_plugins());
  EXPECT_EQ(again.spec.resolved, yaml);
  EXPECT_EQ(again.spec.name, "job");
  EXPECT_EQ(again.spec.mesh.size("pipeline"), 2);
}
