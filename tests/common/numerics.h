// The numerics-contract harness, shared by every strategy's tests: run a job on one
// process, run it again laid out over ranks (thread-ranks over the `local` backend as
// the processes, each with the replica threads its `replicate` section asks for), and
// check that the second follows the first — the loss of every step within a relative
// tolerance and every parameter of the whole model at the end.
//
// Every strategy is a re-arrangement of the same arithmetic (DESIGN.md), so one harness
// serves them all; a test states the layout in `--set` keys (mesh.data=2,
// zero.stage=1, replicate.replicas=3, ...) and its tolerance.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "tests/common/job.h"
#include "data_parallel/data_parallel.h"
#include "pipeline/pipeline.h"
#include "replicate/replicate.h"
#include "tensor_parallel/tensor_parallel.h"
#include "zero/zero.h"

namespace tetra::numerics {

// Every built-in plugin, as the train tool registers them.
inline core::SectionRegistry all_plugins() {
  core::SectionRegistry plugins;
  data_parallel::register_data_parallel(plugins);
  pipeline::register_pipeline(plugins);
  zero::register_zero(plugins);
  replicate::register_replicate(plugins);
  tensor_parallel::register_tensor_parallel(plugins);
  return plugins;
}

inline core::JobSpec job(const std::string& yaml, std::vector<std::string> sets, const std::string& name = "job") {
  return job_without_run_folder(yaml, name, std::move(sets), all_plugins());
}

struct Outcome {
  core::TrainResult result;
  core::TensorMap weights;                    // the whole model, gathered on the writer
  std::vector<core::ModelStateBytes> memory;  // per rank (process-major, then replica)
  std::vector<int> data_ranks;                // per rank: the width of its data group
};

// One process, one rank, `threads` intra-op threads. `base`: the program's own model and
// data (TrainerOptions::model, ::data), when the job brings them.
inline Outcome run_single(const core::JobSpec& spec, const core::TrainerOptions& base = {}, int threads = 1) {
  core::set_threads(threads);
  core::Trainer t(spec, base);
  Outcome o;
  o.result = t.run();
  o.weights = t.weights();
  o.memory = {o.result.memory};
  o.data_ranks = {t.data_size()};
  return o;
}
inline Outcome run_single(const std::string& yaml, const std::vector<std::string>& sets = {}, int threads = 1) {
  return run_single(job(yaml, sets), {}, threads);
}

// The job on `processes` thread-ranks (each a process of the mesh in `sets`; with a
// replicate section each runs its replicas as threads). Returns rank 0's outcome and
// checks that every rank saw the same losses.
inline Outcome run_parallel(const core::JobSpec& spec, int processes, const core::TrainerOptions& base = {}) {
  core::set_threads(1);
  const int R = core::Plan(spec).replicas();
  const size_t ranks = static_cast<size_t>(processes * R);
  std::vector<core::TrainResult> results(ranks);
  std::vector<core::TensorMap> weights(ranks);
  std::vector<int> data_ranks(ranks);
  auto keep = [&](int p, int r, core::Trainer& t, core::TrainResult res) {
    const size_t k = static_cast<size_t>(p * R + r);
    results[k] = std::move(res);
    weights[k] = t.weights();
    data_ranks[k] = t.data_size();
  };
  collectives::run_local_ranks(processes, [&](int p, collectives::Communicator& world) {
    core::TrainerOptions o = base;
    o.world = world.shared_from_this();
    if (R > 1) {
      replicate::train(spec, o, [&](int r, core::Trainer& t, const core::TrainResult& res) { keep(p, r, t, res); });
    } else {
      core::Trainer t(spec, o);
      keep(p, 0, t, t.run());
    }
  });
  for (size_t k = 1; k < ranks; ++k) EXPECT_EQ(results[k].losses, results[0].losses) << "rank " << k;
  Outcome out;
  out.result = results[0];
  out.weights = weights[0];
  for (auto& r : results) out.memory.push_back(r.memory);
  out.data_ranks = data_ranks;
  return out;
}
inline Outcome run_parallel(const std::string& yaml, int processes, const std::vector<std::string>& sets) {
  return run_parallel(job(yaml, sets), processes);
}

// Two small jobs with dropout on and plain SGD, for the tests that hold a layout against one
// process (the dropout layouts, the zero-bubble schedules). kDropoutMlp: 8 layers, a
// dropout in each half: Flatten, (Linear, ReLU, Dropout) x 2, Linear. kDropoutGpt:
// embedding, 2 blocks, head: 7 dropouts (embedding; attention, projection, MLP per block);
// it wants data.path.
inline const char* const kDropoutMlp = R"(
model: {type: mlp, hidden: [32, 32], dropout: 0.3}
data: {type: synthetic, shape: [24], classes: 4, train_samples: 512, test_samples: 64, batch_size: 16}
optimizer: {type: sgd, lr: 0.2}
train: {max_steps: 6, seed: 3, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";
inline const char* const kDropoutGpt = R"(
model: {type: gpt, layers: 2, heads: 2, d_model: 16, d_ff: 32, dropout: 0.2}
data: {type: text, seq_len: 16, batch_size: 8, eval_samples: 16}
optimizer: {type: sgd, lr: 0.5}
train: {max_steps: 5, seed: 4, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

// A small text file for the gpt jobs (numbered lines of one sentence), written once under
// the test's temporary folder as `name`; its path.
inline std::string small_text(const std::string& name) {
  const std::string path = testing::TempDir() + "/" + name;
  if (!std::ifstream(path)) {
    std::ofstream f(path);
    for (int i = 0; i < 400; ++i) f << "the quick brown fox " << i << " jumps over the lazy dog. ";
  }
  return path;
}

// `got` follows `ref`: the loss of every step within `rel` (relative), and every
// parameter within `rel` of the largest magnitude in its tensor (at least 1).
inline void expect_follows(const Outcome& ref, const Outcome& got, double rel, const std::string& what) {
  ASSERT_EQ(ref.result.losses.size(), got.result.losses.size()) << what;
  for (size_t i = 0; i < ref.result.losses.size(); ++i)
    EXPECT_NEAR(got.result.losses[i], ref.result.losses[i], rel * std::abs(ref.result.losses[i]))
        << what << ": step " << i + 1;
  ASSERT_EQ(ref.weights.size(), got.weights.size()) << what;
  for (const auto& [name, w] : ref.weights) {
    auto it = got.weights.find(name);
    ASSERT_NE(it, got.weights.end()) << what << ": " << name;
    ASSERT_TRUE(it->second.sizes().equals(w.sizes())) << what << ": " << name;
    const double diff = (it->second.to(at::kDouble) - w.to(at::kDouble)).abs().max().item<double>();
    const double scale = w.abs().max().item<double>();
    EXPECT_LE(diff, rel * std::max(1.0, scale)) << what << ": parameter " << name << " differs by " << diff;
  }
}

// `rest` resumed from a checkpoint written after step `from` of the run that `whole` made
// uninterrupted: every step it took is whole's step there (loss within `rel`), and its
// final parameters are whole's (within `rel`, absolute).
inline void expect_resumed_follows(const Outcome& whole, const Outcome& rest, size_t from, double rel,
                                   const std::string& what) {
  ASSERT_EQ(rest.result.losses.size(), whole.result.losses.size() - from) << what;
  for (size_t i = 0; i < rest.result.losses.size(); ++i)
    EXPECT_NEAR(rest.result.losses[i], whole.result.losses[from + i], rel * whole.result.losses[from + i])
        << what << ": step " << from + i + 1;
  for (const auto& [name, w] : whole.weights)
    EXPECT_LE((rest.weights.at(name) - w).abs().max().item<double>(), rel) << what << ": " << name;
}

}  // namespace tetra::numerics
