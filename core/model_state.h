// Who keeps the model state — parameters, gradients, optimizer state — and steps it.
//
// Note [One owner of the model state]
// The trainer always holds exactly one ModelStateOwner. When nothing shards, it is core's
// ReplicatedState: this rank's parameters held whole (the whole model, or a pipeline
// stage's layers) and the Optimizer over them. When ZeRO shards the state over the data
// axis, it is ZeRO's. The trainer zeroes, clips, checks, steps, saves and loads through
// the one interface and never asks which owner it has.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/checkpoint.h"
#include "core/job_spec.h"
#include "core/optim.h"
#include "core/placement.h"
#include "core/safetensors.h"

namespace tetra::core {

// The bytes of model state one rank holds (deduplicated by storage): what ZeRO shards.
struct ModelStateBytes {
  int64_t parameters = 0, gradients = 0, optimizer = 0;
  int64_t buffers = 0;  // communication buffers, and (ZeRO-3) layers gathered at the moment
  int64_t total() const { return parameters + gradients + optimizer + buffers; }
};

// The capability of keeping the model state (Note [One owner of the model state]). Under
// a sharding owner the parameters' values exist only where its layout keeps them (under
// ZeRO-3 only while a layer runs): nothing else reads them directly. Every method that
// communicates is collective over the owner's group (ZeRO's: the data axis).
class ModelStateOwner {
 public:
  virtual ~ModelStateOwner() = default;
  virtual void zero_grad() = 0;
  // This rank's part of the squared global gradient norm: every element of the model
  // counted by exactly one rank of its group (Strategy::reduce_grad_norm_sq adds them up).
  virtual double grad_norm_sq() = 0;
  virtual void scale_gradients(double factor) = 0;
  // After finish_gradients: the names of the parameters whose gradient, in the part this
  // rank owns, holds a NaN or an infinity (empty when all are finite: the common case, and
  // a cheap one). The trainer agrees on them over every rank (train.on_nonfinite).
  virtual std::vector<std::string> nonfinite_gradients() = 0;
  // One optimizer step at `lr`; on return the parameters hold the new values (as far as
  // this layout keeps them at all).
  virtual void step(double lr) = 0;
  // Collective: adds this rank's parameters ("model/<name>") and optimizer state
  // ("optim/<name>.exp_avg", ...; "optim/__step__" whole) — a sharding owner its slices.
  virtual void save_state(Checkpoint& ckpt) = 0;
  // Takes this rank's part of the parameters and optimizer state from any checkpoint,
  // whatever layout wrote it. Checks every shape before changing anything.
  virtual void load_state(const CheckpointReader& reader) = 0;
  // Collective: the whole parameters of this rank's model (its pipeline stage) under
  // their single-process names, on the group's rank 0 at least.
  virtual void gather_parameters(TensorMap& out) = 0;
  virtual ModelStateBytes memory() const = 0;
};

// Core's owner when nothing shards: the parameters this rank holds, whole, and the
// Optimizer over them.
class Materializer;

// The parameter a model-state key holds (or holds part of): "model/<name>", the optimizer's
// "optim/<name>.<slot>", or an export's "<name>" — the keys ReplicatedState writes.
std::string parameter_of_key(const std::string& key);

class ReplicatedState final : public ModelStateOwner {
 public:
  // `parts`, under tensor parallelism: where each parameter this rank holds part of lies in
  // the whole (Note [Placements]); `tensor_index` this rank's place in its tensor group.
  // A parameter every tensor rank holds whole counts in the gradient norm on index 0 only;
  // a checkpoint holds whole tensors (the tensor strategy assembles them), and a part is
  // read as its elements of the whole, whatever degree wrote it.
  ReplicatedState(const OptimizerSpec& spec, std::vector<NamedParam> params, const Materializer* parts = nullptr,
                  int tensor_index = 0);
  void zero_grad() override { optimizer_.zero_grad(); }
  double grad_norm_sq() override;
  void scale_gradients(double factor) override;
  std::vector<std::string> nonfinite_gradients() override;
  void step(double lr) override { optimizer_.step(lr); }
  void save_state(Checkpoint& ckpt) override;
  void load_state(const CheckpointReader& reader) override;
  void gather_parameters(TensorMap& out) override;
  ModelStateBytes memory() const override;

 private:
  const std::vector<NamedParam>& params() const { return optimizer_.params(); }
  const Placement* part(const std::string& name) const;
  Optimizer optimizer_;
  const Materializer* parts_;
  int tensor_index_;
};

// The names of the parameters whose gradient holds a NaN or an infinity. One sum over
// each gradient first (the common, finite case costs one pass); a sum that overflows
// from finite values is cleared by the exact pass.
std::vector<std::string> nonfinite_gradients(const std::vector<NamedParam>& params);

}  // namespace tetra::core
