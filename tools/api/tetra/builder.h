// The C++ composition API: the same plans as a job file, built in code.
//
//   tetra::PlanBuilder b("mine");
//   b.mesh({2, 2});                                   // pipeline 2 x data 2 processes (x tensor 1)
//   pipeline::Options pp;
//   pp.micro_batches = 4;
//   pp.schedule = pipeline::ScheduleKind::k1F1B;
//   b.pipeline(pp);
//   zero::Options z;
//   z.stage = 1;
//   b.zero(z);
//   core::JobSpec job = b.build();                    // or b.plan(): the core::Plan
//
// Each call takes the typed options of its section — the same structs the job file is
// parsed into (core/job_spec.h, and each plugin's Options), with enums for the settings that
// take a word. build() writes them as the job file they stand for (yaml()) and parses that
// with the same parser and plugins as `train`, so a job built in code is checked by the
// same rules, with the same messages; each message names the builder call that wrote the
// setting instead of a line:
//
//   PlanBuilder::data(): error: data.batch_size: data.batch_size 96 does not split into 5 ...
//
// Only settings that differ from their defaults are written. A later call for the same
// section replaces the earlier one.
#pragma once

#include <yaml-cpp/yaml.h>

#include <memory>
#include <string>
#include <vector>

#include "core/job_spec.h"
#include "core/plan.h"
#include "core/strategy.h"
#include "data_parallel/data_parallel.h"
#include "pipeline/pipeline.h"
#include "replicate/replicate.h"
#include "tensor_parallel/tensor_parallel.h"
#include "zero/zero.h"

namespace tetra {

// The processes of the job (mpirun -np pipeline x data); replicas are threads inside each
// (replicate).
struct MeshOptions {
  int pipeline = 1;
  int data = 1;
  int tensor = 1;  // tensor-parallel ranks (the gpt model's layers split over them)
};

class PlanBuilder {
 public:
  // `plugins`: the sections the job may have; nullptr = the built-in ones (data_parallel,
  // pipeline, zero, replicate, tensor). A registry passed in must outlive the builder.
  explicit PlanBuilder(std::string name = "job", const core::SectionRegistry* plugins = nullptr);

  // The sections every job has.
  PlanBuilder& model(const core::ModelSpec& spec);
  PlanBuilder& data(const core::DataSpec& spec);
  PlanBuilder& optimizer(const core::OptimizerSpec& spec);
  PlanBuilder& schedule(const core::ScheduleSpec& spec);
  PlanBuilder& train(const core::TrainSpec& spec);
  PlanBuilder& checkpoint(const core::CheckpointSpec& spec);  // dir "" = no checkpoints
  PlanBuilder& log(const core::LogSpec& spec);                // metrics "" = no metrics file
  PlanBuilder& collectives(const core::CollectivesSpec& spec);

  // The composition.
  PlanBuilder& mesh(const MeshOptions& mesh);
  PlanBuilder& data_parallel(const data_parallel::Options& options);
  PlanBuilder& pipeline(const pipeline::Options& options);  // its `stages` comes from mesh()
  PlanBuilder& zero(const zero::Options& options);
  PlanBuilder& replicate(const replicate::Options& options);
  PlanBuilder& tensor_parallel(const tensor_parallel::Options& options);  // its degree comes from mesh()
  // Another registered plugin's section, by name.
  PlanBuilder& strategy(const std::string& section, const core::StrategyConfig& options);

  // One key as `train --set` takes it ("optimizer.lr=3e-4"), applied after the sections.
  PlanBuilder& set(const std::string& assignment);

  // The job file these calls stand for (the --set ones not included).
  std::string yaml() const;
  // The parsed, validated job; throws tetra::ConfigError carrying every problem, each
  // naming its call.
  core::JobSpec build() const;
  // The validated composition of build()'s job.
  core::Plan plan() const { return core::Plan(build()); }

 private:
  struct Call {
    std::string call;     // "PlanBuilder::zero()"
    std::string section;  // "zero"
    YAML::Node values;    // a mapping
  };
  PlanBuilder& add(std::string call, std::string section, YAML::Node values);
  // The document, and the call that wrote each of its lines (index = line - 1).
  std::string write(std::vector<std::string>* line_calls) const;

  std::string name_;
  const core::SectionRegistry* plugins_;
  std::shared_ptr<core::SectionRegistry> builtin_;
  std::vector<Call> calls_;
  std::vector<std::string> sets_;
};

}  // namespace tetra
