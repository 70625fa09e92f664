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
// On each mesh axis exactly one strategy synchronises gradients (gradient_axis()). When
// two do, the one that owns the model state (ModelStateOwner: ZeRO, which reduce-scatters
// into its shards) takes the axis and the plan leaves the other (the data-parallel
// allreduce) out; two owners, or two plain synchronisers, are a ConfigError (core/plan.h).
//
// Strategies attach in the plan's composition order, outermost first (kCompositionOrder:
// pipeline, replica, data), so that the data-parallel strategy sees the parameters the
// pipeline kept.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "collectives/communicator.h"
#include "core/checkpoint.h"
#include "core/data.h"
#include "core/init.h"
#include "core/job_spec.h"
#include "core/mesh.h"
#include "core/models.h"
#include "core/optim.h"
#include "core/plan.h"
#include "core/random.h"
#include "core/report.h"
#include "core/safetensors.h"

namespace tetra::core {

// What a strategy may see and change. A strategy may replace `model` and `params` in
// attach (the pipeline keeps its stage's layers, named as in the whole model).
//
// The model arrives as shapes (Note [Layout-invariant initialisation], core/init.h):
// parameters on the meta device, except in a program's own model built with its values.
// A strategy that decides what this rank holds creates it through `weights` (ZeRO its
// chunks); one that needs the parameters whole (data parallelism) creates them whole with
// weights->create_all before it reads or hooks them; the trainer creates whatever is still
// a shape after the last attach. Nothing else creates a parameter.
struct TrainState {
  const JobSpec& spec;
  torch::nn::Sequential& model;
  std::vector<NamedParam>& params;
  const Mesh* mesh;  // nullptr for a single process
  Trace& trace;
  const Dataset* data = nullptr;  // the job's data (the pipeline probes its shapes)
  const Materializer* weights = nullptr;  // the one place that creates the model's tensors
};

// One step's work, for the strategy that runs forward and backward itself.
struct StepInput {
  torch::Tensor indices;  // this data rank's samples of the global batch
  std::function<Batch(const torch::Tensor& indices)> load;  // reads samples
  // Runs the other strategies' before_backward(last): call it before each backward,
  // with last = true before the step's last backward on this rank.
  std::function<void(bool last)> before_backward;
  bool bf16 = false;  // CPU autocast for the forward
  // The dropout key of row 0 of `indices` (Note [Layout-invariant dropout]): a forward of
  // the rows from r on runs under random.offset(r).
  RandomContext random;
};

// What it reports back: the mean loss over `indices`, the same on every rank of its
// axis, and where the time went (seconds).
struct StepOutput {
  double loss = 0;
  double data_s = 0, forward_s = 0, backward_s = 0;
  // The first micro-batch of this rank (0-based, in order) whose loss was not finite, and
  // that loss; -1 when every loss this rank computed was finite (or it computes none: a
  // pipeline's loss lives on its last stage). The trainer names it when it stops.
  int64_t nonfinite_micro_batch = -1;
  double nonfinite_loss = 0;
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
  // The mesh axis over which this strategy synchronises gradients ("" for none).
  virtual std::string gradient_axis() const { return ""; }
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
  // Seconds spent waiting on communication in finish_gradients over the run (how much
  // backward did not hide). The time each mesh axis was in use is the axis
  // communicator's busy_seconds() (Note [Traffic counters]).
  virtual double wait_seconds() const { return 0; }
  // A pipeline's bubble, over the run: the seconds this rank waited on its neighbours
  // within its steps' schedules, out of the seconds those schedules ran ({0, 0} for a
  // strategy without stages). The trainer reports wait/wall per logging interval.
  struct Idle {
    double wait_s = 0, wall_s = 0;
  };
  virtual Idle idle() const { return {}; }
  // What it decided on attaching that the job spec alone does not say (hierarchical
  // allreduce turned on because the data group spans hosts, say), for the run's opening
  // lines; "" when there is nothing to say.
  virtual std::string decision() const { return ""; }
};

// The bytes of model state one rank holds (deduplicated by storage): what ZeRO shards.
struct ModelStateBytes {
  int64_t parameters = 0, gradients = 0, optimizer = 0;
  int64_t buffers = 0;  // communication buffers, and (ZeRO-3) layers gathered at the moment
  int64_t total() const { return parameters + gradients + optimizer + buffers; }
};

// Note [Per-rank estimate]
// What one rank of the plan will hold and send, worked out on one process without
// communicating (train --dry-run, and the test that holds it to a real run). Core starts
// every rank as the whole model on one rank: fp32 parameters, their gradients, the
// optimizer's slots (sgd 0, or 1 with momentum; adamw 2), no buffers, the activations of
// one micro-batch, and the trainer's own traffic (the step's loss averaged over the data
// axis). Then each active strategy refines it in composition order
// (StrategyConfig::estimate): the pipeline keeps its stage's layers and parameters and
// sets the activations by schedule and checkpointing, ZeRO shards and adds its buffers,
// data parallelism adds its allreduce. Model state counts what ModelStateBytes counts,
// by the same layout code the strategies run, so the two agree to the byte; traffic is
// one step's, per mesh axis, in the convention of Note [Traffic counters].
struct RankEstimate {
  int rank = 0;                      // the process (its replica threads, if any, estimate alike)
  std::map<std::string, int> coord;  // its coordinate on each axis of the plan's processes
  std::vector<int> layers;           // the model's layers this rank runs, in its order
  // Every layer's parameters (the whole model's tensors, named as one process names them),
  // by layer index; a rank trains those of `layers`.
  std::vector<std::vector<NamedParam>> layer_params;
  // The parameters this rank trains: those of `layers`, in order.
  std::vector<NamedParam> params() const;
  ModelStateBytes state;
  int64_t activations = 0;  // saved for backward at the peak (an estimate: not measured)
  std::map<std::string, collectives::Traffic> traffic;  // per mesh axis, one step
  std::vector<std::string> notes;                       // what an estimate assumed
  // Parameters, gradients and optimizer slots of `params` held whole, as the trainer's
  // own optimizer holds them (buffers untouched).
  void replicated_state(const JobSpec& spec);
};

// An optional capability (its own interface, not "not supported" methods on Strategy): a
// strategy that keeps the model state in its own layout — ZeRO shards the parameters,
// gradients and optimizer state over the data axis — and therefore steps the optimizer,
// clips and checkpoints that state itself. The trainer then builds no Optimizer of its
// own and never reads the parameters' values directly (under ZeRO-3 they exist only while
// a layer runs). Every method that communicates is collective over the data group.
class ModelStateOwner {
 public:
  virtual ~ModelStateOwner() = default;
  virtual void zero_grad() = 0;
  // This rank's part of the squared global gradient norm: every element of the model
  // counted by exactly one rank of the data group (reduce_grad_norm_sq adds them up).
  virtual double grad_norm_sq() = 0;
  virtual void scale_gradients(double factor) = 0;
  // After finish_gradients: the names of the parameters whose gradient, in the part this
  // rank owns, holds a NaN or an infinity (empty when all are finite: the common case, and
  // a cheap one). The trainer agrees on them over every rank (train.on_nonfinite).
  virtual std::vector<std::string> nonfinite_gradients() = 0;
  // One optimizer step at `lr`; on return the parameters hold the new values (as far as
  // this layout keeps them at all).
  virtual void step(double lr) = 0;
  // Collective: adds this rank's slices of the parameters ("model/<name>") and optimizer
  // state ("optim/<name>.exp_avg", ...) and, on data rank 0, the whole "optim/__step__".
  virtual void save_state(Checkpoint& ckpt) = 0;
  // Takes this rank's part of the parameters and optimizer state from any checkpoint,
  // whatever layout wrote it. Checks every shape before changing anything.
  virtual void load_state(const CheckpointReader& reader) = 0;
  // Collective: the whole parameters of this rank's model (its pipeline stage) under
  // their single-process names, on data rank 0 (others leave `out` unchanged).
  virtual void gather_parameters(TensorMap& out) = 0;
  virtual ModelStateBytes memory() const = 0;
};

// For strategies that replicate or shard the model over a group (data parallelism, ZeRO):
// every rank of `group` must train the same model on the same job — a cheap fingerprint
// of the parameter shapes and of the settings that change the arithmetic, compared
// across the group; a difference is a ConfigError naming the rank (`who` names the
// strategy in it). Collective.
void check_same_job(collectives::Communicator& group, const TrainState& state, const std::string& who);
// Parameters and buffers start as group rank 0's, when the model came with its values
// (Materializer::given: a program's own, built whole on each rank). Drawn weights are
// every rank's already (Note [Layout-invariant initialisation]): then it does nothing.
// Collective.
void broadcast_from_first(collectives::Communicator& group, TrainState& state);

// What `train --dry-run` shows a strategy.
struct PlanInput {
  const Plan& plan;
  const JobSpec& spec;
  torch::nn::Sequential& model;  // the whole model, as shapes (nothing created)
  const Dataset& data;
  // One training sample run through the model at the job's precision (probe_layers), taken
  // once for everything the plan works out.
  const LayerProbe& probe;
};

// A plugin section that builds a strategy.
struct StrategyConfig : PluginConfig {
  virtual std::unique_ptr<Strategy> build() const = 0;
  // What the section does to the plan: its axis, its place, the ranks and batch pieces
  // it adds (core/plan.h). `job` is the spec the section was parsed with.
  virtual StrategyRole role(const JobSpec& job) const = 0;
  // Lines `train --dry-run` prints for this strategy ("" for none), computed on one
  // process without communicating.
  virtual std::string plan(const PlanInput& input) const { return ""; }
  // Refines this rank's estimate (Note [Per-rank estimate]), on one process without
  // communicating. A strategy that changes nothing a rank holds or sends leaves it.
  virtual void estimate(const PlanInput& input, RankEstimate& rank) const {}
  // The section as the keys its parser reads, leaving out those at their defaults: the C++
  // Plan builder writes it and parses it back, so a job built in code passes the same
  // checks, with the same messages, as a file.
  virtual YAML::Node to_yaml() const = 0;
};

// Every process rank's estimate: core's start, refined by the active strategies in
// composition order.
std::vector<RankEstimate> estimate_ranks(const PlanInput& input);
// The --dry-run table (one row per rank) with the convention it counts bytes in.
std::string estimate_table(const Plan& plan, const std::vector<RankEstimate>& ranks);
// The same for --json: an array of per-rank objects.
nlohmann::json estimate_json(const std::vector<RankEstimate>& ranks);

}  // namespace tetra::core
