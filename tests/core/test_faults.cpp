// The training loop's faults on one process: a NaN that one sample brings in at a chosen
// step stops the run naming the step, the micro-batch and the parameter, or is skipped
// without touching the parameters or the optimizer state (train.on_nonfinite); a stop
// request ends the run after its step with that step's checkpoint, which resumes exactly;
// and the signal handlers behind it (Note [Stop requests]). The same faults under every
// strategy, where the flag must travel between ranks: tests/zero/test_faults.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include "collectives/error.h"
#include "core/checkpoint.h"
#include "core/job_spec.h"
#include "core/runtime.h"
#include "core/trainer.h"
#include "tests/core/poisoned_data.h"
#include "tests/common/job.h"

using namespace tetra::core;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::path(testing::TempDir()) / ("tetra_faults_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

const char* kJob = R"(
model: {type: mlp, hidden: [32, 16]}
data: {type: synthetic, shape: [12], classes: 4, train_samples: 2048, test_samples: 64, batch_size: 64}
optimizer: {type: adamw, lr: 1.0e-2}
train: {max_steps: 6, seed: 5, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

JobSpec job(std::vector<std::string> sets = {}) {
  return tetra::numerics::job_without_run_folder(kJob, "faults", std::move(sets), SectionRegistry{});
}

using tetra::testing_faults::PoisonedData;

TrainerOptions poisoned(const JobSpec& spec, int64_t step, int64_t position) {
  TrainerOptions o;
  o.data = std::make_shared<PoisonedData>(spec, step, position);
  return o;
}

std::string first_parameter(const JobSpec& spec) { return Trainer(spec).model()->named_parameters()[0].key(); }

void expect_same_tensors(const TensorMap& a, const TensorMap& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
  }
}

}  // namespace

TEST(Nonfinite, StopNamesTheStepTheMicroBatchAndTheFirstParameterBeforeAnyUpdate) {
  set_threads(1);
  // Position 51 of 64 in 4 micro-batches of 16: the fourth.
  const JobSpec spec = job({"train.accumulation_steps=4"});
  Trainer t(spec, poisoned(spec, 3, 51));
  try {
    t.run();
    FAIL() << "a NaN loss did not stop the run";
  } catch (const tetra::PreemptedError& e) {
    FAIL() << e.what();
  } catch (const tetra::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "step 3 (epoch 1), micro-batch 4 of 4: the loss is nan; first parameter whose gradient is not finite: " +
                  first_parameter(spec) +
                  " (train.on_nonfinite: stop; lower optimizer.lr, set optimizer.clip_grad_norm, or use skip)");
  }
  // It stopped before the update: the parameters are those after step 2.
  Trainer two(job({"train.accumulation_steps=4", "train.max_steps=2"}));
  two.run();
  expect_same_tensors(t.weights(), two.weights());
}

TEST(Nonfinite, SkipChangesNeitherTheParametersNorTheOptimizerState) {
  set_threads(1);
  fs::path d = fresh_dir("skip");
  // Step 3 is the last, and skipped: its run must end where the run of two steps ends.
  const JobSpec spec = job({"train.max_steps=3", "train.on_nonfinite=skip", "checkpoint.dir=" + (d / "a").string(),
                            "log.metrics=" + (d / "a.jsonl").string(), "log.every=1"});
  Trainer skipped(spec, poisoned(spec, 3, 10));
  const TrainResult a = skipped.run();
  Trainer two(job({"train.max_steps=2", "checkpoint.dir=" + (d / "b").string()}));
  const TrainResult b = two.run();
  EXPECT_EQ(a.skipped_steps, 1);
  EXPECT_EQ(a.final_step, 3);
  EXPECT_EQ(a.losses, b.losses);  // the skipped step's loss is not among them
  expect_same_tensors(skipped.weights(), two.weights());
  // The optimizer state too (AdamW's moments and its step count), as written to the checkpoints.
  CheckpointReader ca((d / "a").string()), cb((d / "b").string());
  EXPECT_EQ(ca.step(), 3);
  ASSERT_EQ(ca.names(), cb.names());
  for (const auto& name : ca.names()) {
    if (name.rfind("optim/", 0) == 0 || name.rfind("model/", 0) == 0) {
      EXPECT_TRUE(torch::equal(ca.read(name), cb.read(name))) << name;
    }
  }
  // The step records count it.
  std::ifstream in(d / "a.jsonl");
  std::string line;
  std::vector<nlohmann::json> recs;
  while (std::getline(in, line)) {
    auto rec = nlohmann::json::parse(line);
    if (!rec.value("eval", false)) recs.push_back(rec);
  }
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[1]["skipped_steps"], 0);
  EXPECT_EQ(recs[2]["skipped_steps"], 1);
  EXPECT_EQ(recs[2].value("skipped", false), true);
  EXPECT_TRUE(recs[2]["loss"].is_null()) << recs[2];  // NaN has no JSON number
}

// A skipped step is still a step: it consumes its batch and the schedule moves on, so the
// steps after it read the batches and use the learning rates they would have.
TEST(Nonfinite, ASkippedStepConsumesItsBatchAndTheScheduleMovesOn) {
  set_threads(1);
  fs::path d = fresh_dir("schedule");
  auto with = [&](const std::string& name, std::vector<std::string> sets) {
    sets.insert(sets.end(), {"schedule.type=cosine", "schedule.warmup_steps=2", "log.every=1",
                             "log.metrics=" + (d / (name + ".jsonl")).string()});
    return job(sets);
  };
  const JobSpec spec = with("skip", {"train.on_nonfinite=skip"});
  const TrainResult r = Trainer(spec, poisoned(spec, 3, 0)).run();
  const TrainResult clean = Trainer(with("clean", {})).run();
  EXPECT_EQ(r.final_step, 6);
  EXPECT_EQ(r.skipped_steps, 1);
  ASSERT_EQ(r.losses.size(), 5u);
  EXPECT_EQ(r.losses[0], clean.losses[0]);
  EXPECT_EQ(r.losses[1], clean.losses[1]);
  auto lrs = [](const fs::path& p) {
    std::vector<double> out;
    std::ifstream in(p);
    std::string line;
    while (std::getline(in, line)) {
      auto rec = nlohmann::json::parse(line);
      if (!rec.value("eval", false)) out.push_back(rec["lr"].get<double>());
    }
    return out;
  };
  EXPECT_EQ(lrs(d / "skip.jsonl"), lrs(d / "clean.jsonl"));
}

// Note [Stop requests], in process: a request during step 4 (from the program) ends the
// run after step 5 — the first step to read it — with step 5's checkpoint, and the
// same job resumes from it to the parameters of the run nobody stopped.
TEST(StopRequest, EndsTheRunAfterItsStepWithThatStepsCheckpointAndResumesExactly) {
  set_threads(1);
  fs::path d = fresh_dir("stop");
  auto with = [&](const std::string& dir) {
    return job({"train.max_steps=10", "model.dropout=0.1", "checkpoint.dir=" + (d / dir).string()});
  };
  Trainer whole(with("whole"));
  whole.run();

  TrainerOptions asks;
  asks.on_step = [](int64_t step, double) {
    if (step == 4) request_stop();
  };
  std::string folder;
  {
    Trainer t(with("stopped"), asks);
    try {
      t.run();
      ADD_FAILURE() << "a stop request did not stop the run";
    } catch (const tetra::PreemptedError& e) {
      folder = e.checkpoint();
      EXPECT_EQ(std::string(e.what()), "preempted at step 5 (a stop request from the program); checkpoint " + folder);
    }
  }
  clear_stop_request();
  EXPECT_EQ(folder, (d / "stopped" / "step-00000005").string());
  EXPECT_EQ(CheckpointReader(folder).step(), 5);
  Trainer resumed(with("stopped"));
  const TrainResult r = resumed.run();
  EXPECT_EQ(r.resumed_from, folder);
  EXPECT_EQ(r.steps, 5);
  expect_same_tensors(resumed.weights(), whole.weights());
}

TEST(StopRequest, WithoutACheckpointFolderItSaysNothingCouldBeSaved) {
  set_threads(1);
  request_stop();
  try {
    Trainer(job()).run();
    ADD_FAILURE() << "a stop request did not stop the run";
  } catch (const tetra::PreemptedError& e) {
    EXPECT_EQ(e.checkpoint(), "");
    EXPECT_EQ(std::string(e.what()),
              "preempted at step 1 (a stop request from the program); no checkpoint was written (checkpoint.dir is \"\"): "
              "a new run starts afresh");
  }
  clear_stop_request();
  // The last step is no reason to stop: the run is done.
  TrainerOptions at_the_end;
  at_the_end.on_step = [](int64_t step, double) {
    if (step == 5) request_stop();
  };
  const TrainResult r = Trainer(job(), at_the_end).run();
  clear_stop_request();
  EXPECT_EQ(r.final_step, 6);
}

// The handlers, in a child process each (they are process-wide): the first SIGTERM or
// SIGINT only asks; the second ends the process at once with 128 + the signal, or with
// the status the trainer sets once its checkpoint is written.
namespace {

int in_child(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace

TEST(StopRequest, TheFirstSignalAsksAndTheSecondExitsAtOnce) {
  EXPECT_EQ(in_child([] {
              install_stop_handlers();
              raise(SIGTERM);
              if (stop_requested() != SIGTERM) return 10;
              raise(SIGTERM);
              return 11;  // not reached
            }),
            128 + SIGTERM);
  EXPECT_EQ(in_child([] {
              install_stop_handlers();
              raise(SIGINT);
              if (stop_requested() != SIGINT) return 10;
              set_stop_exit_status(tetra::kExitPreempted);
              raise(SIGTERM);
              return 11;
            }),
            tetra::kExitPreempted);
  EXPECT_EQ(stop_requested(), 0);  // this process: untouched
  EXPECT_EQ(stop_reason(SIGTERM), "SIGTERM");
}
