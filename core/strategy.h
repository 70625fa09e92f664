// The strategy-plugin interface.
//
// A strategy owns one mesh axis and hooks the phases of a training step. The trainer
// knows only this interface; plugins register their YAML section (SectionRegistry) and
// build their Strategy from the parsed config. Hooks default to doing nothing, so a
// strategy overrides only the phases it changes.
//
// The phases of one step, in order:
//   attach(state)            once, after the model exists and before the optimizer is
//                            built over state.params (broadcast, hooks; a pipeline keeps
//                            only its stage's layers and parameters)
//   forward_backward(step)   only the strategy that owns_forward_backward() (the
//                            pipeline): it runs the step's micro-batches itself and calls
//                            step.before_backward, which runs the others' hooks
//   before_backward(last)    before each micro-batch's backward; `last` ends the step
//   finish_gradients()       after the last backward: on return gradients are global
//   (clip — its norm summed over reduce_grad_norm_sq — optimizer step)
//
// Strategies attach in the mesh's axis order, outermost first (kAxisOrder: pipeline,
// then data), so that the data-parallel strategy sees the parameters the pipeline kept.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/data.h"
#include "core/job_spec.h"
#include "core/mesh.h"
#include "core/optim.h"
#include "core/report.h"
#include "core/safetensors.h"

namespace tetra::core {

// What a strategy may see and change. A strategy may replace `model` and `params` in
// attach (the pipeline keeps its stage's layers, named as in the whole model).
struct TrainState {
  const JobSpec& spec;
  torch::nn::Sequential& model;
  std::vector<NamedParam>& params;
  const Mesh* mesh;  // nullptr for a single process
  Trace& trace;
  const Dataset* data = nullptr;  // the job's data (the pipeline probes its shapes)
};

// One step's work, for the strategy that runs forward and backward itself.
struct StepInput {
  torch::Tensor indices;  // this data rank's samples of the global batch
  std::function<Batch(const torch::Tensor& indices)> load;  // reads samples
  // Runs the other strategies' before_backward(last): call it before each backward,
  // with last = true before the step's last backward on this rank.
  std::function<void(bool last)> before_backward;
  bool bf16 = false;  // CPU autocast for the forward
};

// What it reports back: the mean loss over `indices`, the same on every rank of its
// axis, and where the time went (seconds).
struct StepOutput {
  double loss = 0;
  double data_s = 0, forward_s = 0, backward_s = 0;
};

// Sums of one evaluation batch.
struct EvalSums {
  double loss_sum = 0;  // per-example loss summed over the batch
  int64_t correct = 0, predictions = 0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  // The mesh axis the strategy owns ("" for none); orders attach.
  virtual std::string axis() const { return ""; }
  virtual void attach(TrainState& state) {}
  // The pipeline replaces the trainer's loop over micro-batches.
  virtual bool owns_forward_backward() const { return false; }
  virtual StepOutput forward_backward(const StepInput& step) { return {}; }
  // A strategy that owns the forward evaluates a batch itself (every rank of its axis
  // returns the same sums); nullopt leaves it to the trainer's model->forward.
  virtual std::optional<EvalSums> evaluate(const Batch& batch, bool bf16) { return std::nullopt; }
  // The squared gradient norm of the whole model from this rank's part (a pipeline adds
  // up its stages'); identity when every rank holds every gradient.
  virtual double reduce_grad_norm_sq(double local) { return local; }
  // Checkpoints. Collective over the strategy's ranks: on return the checkpoint writer
  // (world rank 0) holds the tensors of the whole model in `tensors` under the names a
  // single process uses — so a checkpoint does not depend on the layout that wrote it.
  // On restore every rank reads the checkpoint and takes its own tensors by name.
  virtual void gather_state(TensorMap& tensors) {}
  virtual void before_backward(bool last_micro_batch) {}
  virtual void finish_gradients() {}
  // Seconds spent waiting on communication in finish_gradients over the run, and in
  // communication in all (for "how much did backward hide").
  virtual double wait_seconds() const { return 0; }
  virtual double comm_seconds() const { return 0; }
};

// What `train --dry-run` shows a strategy.
struct PlanInput {
  const JobSpec& spec;
  torch::nn::Sequential& model;  // the whole model, built from the job's seed
  const Dataset& data;
};

// A plugin section that builds a strategy.
struct StrategyConfig : PluginConfig {
  virtual std::unique_ptr<Strategy> build() const = 0;
  // Lines `train --dry-run` prints for this strategy ("" for none), computed on one
  // process without communicating.
  virtual std::string plan(const PlanInput& input) const { return ""; }
};

}  // namespace tetra::core
