// The strategy-plugin interface.
//
// A strategy owns one mesh axis (declared once, by its section's StrategyRole) and hooks
// the phases of a training step. The trainer knows only this interface and the
// capabilities of Note [Capabilities]; plugins register their YAML section
// (SectionRegistry) and build their Strategy from the parsed config. Hooks default to
// doing nothing, so a strategy overrides only the phases it changes.
//
// The phases of one step, in order:
//   attach(state)            once, after the model exists and before the model state's
//                            owner is made over state.params (broadcast, hooks; a
//                            pipeline keeps only its stage's layers and parameters)
//   runner.run(step)         the step runner (Note [One step runner]) runs the step's
//                            micro-batches; step.before_backward runs every strategy's
//   before_backward(last)    before each micro-batch's backward; `last` ends the step
//   finish_gradients()       after the last backward: on return gradients are global
//   (clip — its norm summed over reduce_grad_norm_sq — and the owner's optimizer step)
//
// On each mesh axis exactly one strategy synchronises gradients (StrategyRole). When
// two do, the one that owns the model state (ModelStateOwner: ZeRO, which reduce-scatters
// into its shards) takes the axis and the plan leaves the other (the data-parallel
// allreduce) out; two owners, or two plain synchronisers, are a ConfigError (core/plan.h).
//
// Strategies attach in the plan's composition order, outermost first (kCompositionOrder:
// pipeline, replica, data), so that the data-parallel strategy sees the parameters the
// pipeline kept.
#pragma once

#include <torch/nn/modules/container/sequential.h>

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
#include "core/model_state.h"
#include "core/models.h"
#include "core/optim.h"
#include "core/plan.h"
#include "core/strategy_config.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "core/step.h"
#include "core/telemetry.h"

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
  // Where this rank's tensors live (Note [One device], core/device.h): a strategy creates
  // its buffers with options().device(device).
  torch::Device device = torch::kCPU;
  // The loss the runners take of the model's output (tensor parallelism sets its own).
  ModelLoss loss = cross_entropy_loss();
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  virtual void attach(TrainState& state) {}
  // The squared gradient norm of the whole model from this rank's part (a pipeline adds
  // up its stages', ZeRO its shards'); identity when every rank holds every gradient.
  virtual double reduce_grad_norm_sq(double local) { return local; }
  virtual void before_backward(bool last_micro_batch) {}
  virtual void finish_gradients() {}
  // What it decided on attaching that the job spec alone does not say (hierarchical
  // allreduce turned on because the data group spans hosts, say), for the run's opening
  // lines; "" when there is nothing to say.
  virtual std::string decision() const { return ""; }
};

// Note [Capabilities]
// What only some strategies do is an interface of its own, which the strategy also
// derives from, and which the trainer looks for once, when it attaches the strategies:
//   ModelStateOwner (core/model_state.h)  keeps the parameters, gradients and optimizer
//                       state in its own layout and steps them (ZeRO); else core's
//                       ReplicatedState does
//   StepRunner (core/step.h)  runs the step's forward and backward and the evaluation
//                       forward (the pipeline); else core's LocalRunner does
//   StateGatherer       sends the tensors this rank holds of a model split across ranks
//                       to the checkpoint writer (the pipeline)
// A job has at most one owner and one runner besides core's (a ConfigError otherwise), so
// the trainer always holds exactly one of each and never asks which strategy is attached.
class StateGatherer {
 public:
  virtual ~StateGatherer() = default;
  // Checkpoints and exports. Collective over the strategy's ranks: on return the writer
  // (world rank 0) holds the tensors of the whole model in `tensors` under the names a
  // single process uses — so a checkpoint does not depend on the layout that wrote it.
  virtual void gather_state(TensorMap& tensors) = 0;
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

}  // namespace tetra::core
