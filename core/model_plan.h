// A job's model on paper: its data, its layers as shapes, one probe of a sample through
// them, and what the strategies make of them (Note [Model plan], model_plan.cpp).
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/checkpoint.h"
#include "core/data.h"
#include "core/init.h"
#include "core/job_spec.h"
#include "core/models.h"
#include "core/plan.h"
#include "core/strategy_config.h"

namespace tetra::core {

// The program's own model, built from the data's shape (TrainerOptions::model).
using ModelFactory = std::function<torch::nn::Sequential(const DataInfo&)>;

// The job's data: `given` when the program brings its own, else data.* (a DataError
// names data.path, the key to change).
std::shared_ptr<const Dataset> load_data(const JobSpec& spec, std::shared_ptr<const Dataset> given);

// The job's model: the program's own (`own`, drawn from the job's seed), else model.*
// built as shapes (no storage) for tensor rank `tensor_rank`'s parts of the split layers,
// shaped by the plan's strategies and with train.recompute set. A ConfigError when it has
// no layer.
torch::nn::Sequential build_job_model(const Plan& plan, const DataInfo& data, const ModelFactory& own, int tensor_rank);

// The whole model's parameter count (a part counts as the whole tensor it is part of),
// whatever `model` keeps of it.
int64_t whole_parameters(torch::nn::Sequential& model, const Materializer& weights);

// Note [Weights from elsewhere] (trainer.cpp): checkpoint.init_from checked against the
// whole model before any tensor exists. Nothing when the job has no init_from or resumes a
// checkpoint of its own; else its reader and what the run starts from, in one line. A
// ConfigError lists every mismatch.
struct WeightsFrom {
  std::shared_ptr<CheckpointReader> source;
  std::string note;
};
std::optional<WeightsFrom> weights_from_elsewhere(const CheckpointSpec& ck, torch::nn::Sequential& model,
                                                  const Materializer& weights);

class ModelPlan {
 public:
  // Builds the data and the model (as tensor rank 0's), and checks checkpoint.init_from.
  explicit ModelPlan(JobSpec spec, ModelFactory model = {}, std::shared_ptr<const Dataset> data = {});
  ModelPlan(const ModelPlan&) = delete;
  ModelPlan& operator=(const ModelPlan&) = delete;

  const Plan& plan() const { return plan_; }
  const JobSpec& spec() const { return plan_.spec(); }
  const Dataset& dataset() const { return *data_; }
  std::shared_ptr<const Dataset> data() const { return data_; }
  // Its layers: probing and timing run them, hence not const.
  torch::nn::Sequential& model() { return model_; }
  bool own_model() const { return own_model_; }
  int64_t parameters() const { return parameters_; }  // the whole model's
  int64_t total_steps() const { return total_steps_; }
  const std::string& init_note() const { return init_note_; }

  // One training sample through the model at the job's precision (probe_layers, with what
  // each layer keeps for its backward: Note [Kept bytes]), taken on first use and kept.
  const LayerProbe& probe();
  // What the strategies see of the job, or of a variant of it with other layouts and
  // knobs but the same model (the tuner's JobPricer: `plan` must outlive the input).
  PlanInput input() { return input(plan_); }
  PlanInput input(const Plan& plan);
  // The strategies' --dry-run lines (their StrategyConfig::plan).
  std::string strategies_text();
  // Throws ConfigError carrying every strategy's model_issues (`train --check`).
  void check();
  // Every process rank's model state, activations and bytes per axis per step (Note
  // [Per-rank estimate]).
  std::vector<RankEstimate> estimate();

 private:
  Plan plan_;
  std::shared_ptr<const Dataset> data_;
  torch::nn::Sequential model_{nullptr};
  bool own_model_ = false;
  int64_t parameters_ = 0;
  int64_t total_steps_ = 0;
  std::string init_note_;
  std::optional<LayerProbe> probe_;
};

}  // namespace tetra::core
