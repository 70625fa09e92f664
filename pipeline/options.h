// The `pipeline:` section of a job: its keys as the job file takes them and what each
// means (Options), read and checked once (register_pipeline, options.cpp) and written
// back (Options::to_yaml). What the options build — the strategy, its plan and its
// estimate — is pipeline.cpp's.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/job_spec.h"
#include "core/strategy.h"

namespace tetra::pipeline {

// pipeline.schedule, in the order of schedule_kinds() (the words the job file takes).
enum class ScheduleKind { kGPipe, k1F1B, kInterleaved1F1B, kZBH1, kZBV };
// pipeline.balance: how layers are cut into stages (a list in the file: kExplicit).
enum class Balance { kUniform, kByParams, kByTime, kExplicit };
const std::vector<std::string>& balance_names();  // uniform by_params by_time explicit
// pipeline.checkpoint: which micro-batches recompute their forward in backward.
enum class Recompute { kNever, kExceptLast, kAlways };
const std::vector<std::string>& recompute_names();  // never except_last always
const std::string& to_string(ScheduleKind kind);
const std::string& to_string(Balance balance);
const std::string& to_string(Recompute recompute);

struct Options : core::StrategyConfig {
  int stages = 1;                  // mesh.pipeline (P); set from the mesh when parsed
  ScheduleKind schedule = ScheduleKind::k1F1B;
  int micro_batches = 0;           // m; 0 = 4 x P
  int virtual_stages = 1;          // v: chunks per rank (interleaved_1f1b)
  Balance balance = Balance::kUniform;
  std::vector<int64_t> balance_counts;  // balance kExplicit: [4, 3, ...] (P x v counts)
  Recompute checkpoint = Recompute::kNever;
  // Each rank's memory for its stages in GiB (Note [Stage memory]); 0 = no cap. With
  // balance by_time the cut is the fastest whose every stage fits; any other balance's cut
  // must fit. A cut that does not is a `train --check` error naming the stage and bytes.
  double memory_gb = 0;
  // Receives posted on each link before the schedule needs them. Posting ahead overlaps
  // a transfer with compute, but the link's progress thread then polls for it beside
  // the compute thread: on a CPU with a core per rank that cost more than it hid
  // (the 784-512x8-10 MLP, 1f1b, m = 8, 2 ranks x 1 thread on 2 cores: 5419 samples/s
  // with 0, 4953 with 1, 5017 with 2). Raise
  // it where communication has cores of its own (GPUs).
  int prefetch = 0;
  std::unique_ptr<core::Strategy> build() const override;
  core::StrategyRole role(const core::JobSpec& job) const override;
  std::string plan(const core::PlanInput& input) const override;
  void estimate(const core::PlanInput& input, core::RankEstimate& rank) const override;
  std::vector<core::PlanIssue> issues(const core::JobSpec& job) const override;
  std::vector<core::PlanIssue> model_issues(const core::PlanInput& input) const override;
  YAML::Node to_yaml() const override;
};

// Registers the `pipeline` section (owner of the `pipeline` mesh axis).
void register_pipeline(core::SectionRegistry& registry);

}  // namespace tetra::pipeline
