// The trainer end to end, in process, on real data: the loss falls and accuracy passes a
// threshold; a run stopped after a checkpoint and resumed follows the uninterrupted run.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <numeric>

#include "collectives/error.h"
#include "core/job_spec.h"
#include "core/runtime.h"
#include "core/safetensors.h"
#include "core/trainer.h"
#include "tests/common/job.h"

using namespace tetra::core;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::path(testing::TempDir()) / ("tetra_train_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

JobSpec job(const std::string& yaml, std::vector<std::string> sets = {}) {
  return tetra::numerics::job_without_run_folder(yaml, "test", std::move(sets), SectionRegistry{});
}

double mean(const std::vector<double>& v, size_t b, size_t e) {
  return std::accumulate(v.begin() + b, v.begin() + e, 0.0) / static_cast<double>(e - b);
}

struct Interrupt {};

const char* kMlp = R"(
model: {type: mlp, hidden: [128]}
data: {type: fashion-mnist, batch_size: 128, eval_samples: 2000}
optimizer: {type: adamw, lr: 2.0e-3, weight_decay: 0.01}
schedule: {type: cosine, warmup_steps: 20}
train: {max_steps: 300, seed: 7, threads: 1}
log: {progress: off, every: 1}
)";

}  // namespace

TEST(Trainer, FashionMnistLossFallsAndAccuracyPasses) {
  set_threads(1);
  fs::path d = fresh_dir("fmnist");
  JobSpec spec = job(kMlp, {"checkpoint.dir=" + (d / "ckpt").string(),
                            "log.metrics=" + (d / "m.jsonl").string()});
  Trainer t(spec);
  TrainResult r = t.run();
  ASSERT_EQ(r.steps, 300);
  EXPECT_LT(mean(r.losses, 280, 300), 0.6 * mean(r.losses, 0, 20));
  ASSERT_TRUE(r.final_eval && r.final_eval->accuracy);
  EXPECT_GT(*r.final_eval->accuracy, 0.80);
  EXPECT_EQ(r.final_eval->samples, 2000);
  EXPECT_FALSE(r.checkpoint.empty());
  // Metrics: one JSON object per line, train records with the documented keys.
  std::ifstream in(d / "m.jsonl");
  std::string line;
  int train = 0, eval = 0;
  while (std::getline(in, line)) {
    auto rec = nlohmann::json::parse(line);
    if (rec.value("eval", false)) {
      ++eval;
      EXPECT_TRUE(rec.contains("test_loss") && rec.contains("test_accuracy"));
    } else {
      ++train;
      for (const char* k : {"step", "epoch", "loss", "lr", "samples_per_s", "time_s"})
        EXPECT_TRUE(rec.contains(k)) << k;
    }
  }
  EXPECT_EQ(train, 300);
  EXPECT_GE(eval, 1);
}

TEST(Trainer, StoppedAndResumedRunFollowsTheUninterruptedOne) {
  set_threads(1);
  fs::path d = fresh_dir("resume");
  const std::string yaml = std::string(kMlp) + "checkpoint: {every_steps: 10}\n";
  std::vector<std::string> common = {"train.max_steps=40", "data.eval_samples=500",
                                     "model.dropout=0.1"};  // dropout: the masks must resume too
  auto with = [&](const std::string& dir) {
    auto s = common;
    s.push_back("checkpoint.dir=" + (d / dir).string());
    s.push_back("log.metrics=");
    return job(yaml, s);
  };
  TrainResult whole = Trainer(with("a")).run();
  ASSERT_EQ(whole.losses.size(), 40u);

  TrainerOptions stop_at_25;
  stop_at_25.on_step = [](int64_t step, double) {
    if (step == 25) throw Interrupt{};
  };
  EXPECT_THROW(Trainer(with("b"), stop_at_25).run(), Interrupt);
  TrainResult rest = Trainer(with("b")).run();
  EXPECT_EQ(rest.resumed_from, (d / "b" / "step-00000020").string());
  ASSERT_EQ(rest.losses.size(), 20u);
  for (size_t i = 0; i < 20; ++i) EXPECT_EQ(rest.losses[i], whole.losses[20 + i]) << "step " << 21 + i;
  ASSERT_TRUE(rest.final_eval && whole.final_eval);
  EXPECT_EQ(rest.final_eval->test_loss, whole.final_eval->test_loss);
}

TEST(Trainer, AccumulationFollowsTheFullBatch) {
  set_threads(1);
  std::vector<std::string> base = {"train.max_steps=20", "checkpoint.dir=", "log.metrics=",
                                   "data.eval_samples=200"};
  auto a = base, b = base;
  b.push_back("train.accumulation_steps=4");
  TrainResult one = Trainer(job(kMlp, a)).run();
  TrainResult four = Trainer(job(kMlp, b)).run();
  ASSERT_EQ(one.losses.size(), four.losses.size());
  for (size_t i = 0; i < one.losses.size(); ++i)
    EXPECT_NEAR(four.losses[i], one.losses[i], 1e-5 * std::abs(one.losses[i])) << "step " << i + 1;
  // Plain SGD without clipping, parameters as well as losses: a gradient summed over the
  // micro-batches instead of averaged is a 4x step, which AdamW's normalisation hides
  // (with AdamW alone this test stayed green when MicroBatches stopped weighting).
  auto sgd = base;
  sgd.insert(sgd.end(), {"optimizer.type=sgd", "optimizer.lr=0.05", "optimizer.weight_decay=0"});
  auto sgd4 = sgd;
  sgd4.push_back("train.accumulation_steps=4");
  Trainer whole(job(kMlp, sgd)), split(job(kMlp, sgd4));
  const TrainResult w = whole.run(), s = split.run();
  ASSERT_EQ(w.losses.size(), s.losses.size());
  for (size_t i = 0; i < w.losses.size(); ++i)
    EXPECT_NEAR(s.losses[i], w.losses[i], 1e-5 * std::abs(w.losses[i])) << "sgd: step " << i + 1;
  const TensorMap wa = whole.weights(), wb = split.weights();
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) {
    const double diff = (wb.at(name) - t).abs().max().item<double>();
    EXPECT_LE(diff, 1e-5 * std::max(1.0, t.abs().max().item<double>())) << "sgd: parameter " << name;
  }
}

TEST(Trainer, Bf16TrainsToo) {
  set_threads(1);
  TrainResult r = Trainer(job(kMlp, {"train.precision=bf16", "train.max_steps=150",
                                     "checkpoint.dir=", "log.metrics="}))
                      .run();
  EXPECT_LT(mean(r.losses, 130, 150), 0.7 * mean(r.losses, 0, 20));
  ASSERT_TRUE(r.final_eval && r.final_eval->accuracy);
  EXPECT_GT(*r.final_eval->accuracy, 0.7);
}

TEST(Trainer, GptLearnsText) {
  set_threads(1);
  fs::path d = fresh_dir("gpt");
  // A real text: the GPL as Debian ships it, else this repository's README.
  std::string text = "/usr/share/common-licenses/GPL-3";
  if (!fs::exists(text)) text = std::string(TETRA_SOURCE_DIR) + "/README.md";
  JobSpec spec = job(R"(
model: {type: gpt, layers: 2, heads: 2, d_model: 64}
data: {type: text, seq_len: 64, batch_size: 16, eval_samples: 64}
optimizer: {type: adamw, lr: 3.0e-3}
train: {max_steps: 120, seed: 1, threads: 1}
log: {progress: off}
)", {"data.path=" + text, "checkpoint.dir=", "log.metrics="});
  TrainResult r = Trainer(spec).run();
  EXPECT_LT(mean(r.losses, 100, 120), 0.7 * mean(r.losses, 0, 10));
  ASSERT_TRUE(r.final_eval && r.final_eval->perplexity);
  EXPECT_LT(*r.final_eval->perplexity, 40.0);  // 256 for a uniform guess
}

TEST(Trainer, SafetensorsExportHoldsTheWeights) {
  set_threads(1);
  fs::path d = fresh_dir("export");
  JobSpec spec = job(kMlp, {"train.max_steps=3", "checkpoint.dir=", "log.metrics=",
                            "checkpoint.safetensors=" + (d / "w.safetensors").string()});
  Trainer t(spec);
  t.run();
  TensorMap w = load_safetensors((d / "w.safetensors").string());
  for (const auto& p : t.model()->named_parameters()) {
    ASSERT_TRUE(w.count(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(w[p.key()], p.value())) << p.key();
  }
}
