// The training loop: data, runner, owner, records. Each step reads this rank's part of
// the global batch; the step runner (Note [One step runner], core/step.h) runs its
// forward and backward; the strategies synchronise the gradients; the model state's
// owner (Note [One owner of the model state], core/model_state.h) clips and steps; the
// run's records (core/records.h) note it. Evaluation, checkpoints (core/identity.h,
// core/resume.h) and preemption hang off the same loop. The trainer never asks which
// strategy is attached (Note [Capabilities], core/strategy.h).
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/data.h"
#include "core/init.h"
#include "core/job_spec.h"
#include "core/models.h"
#include "core/optim.h"
#include "core/identity.h"
#include "core/model_state.h"
#include "core/plan.h"
#include "core/records.h"
#include "core/step.h"
#include "core/strategy.h"
#include "core/telemetry.h"
#include "collectives/communicator.h"

namespace tetra::core {

class Trainer;

struct TrainerOptions {
  std::FILE* out = stdout;  // progress and summary (rank 0's)
  // The world of this job (nullptr: one process). The trainer lays it out as the job's
  // mesh and hands the strategies their groups.
  collectives::CommunicatorPtr world;
  // The world's host plane when `world` carries device tensors only (Note [Two planes],
  // collectives/backends.h: nccl's host tensors over mpi or gloo), over the same processes
  // in the same order; nullptr: `world` carries both. Every host tensor of the job (loss
  // averages, records, checkpoint checksums, the step's one decision) goes over it.
  collectives::CommunicatorPtr host;
  // Where this rank's tensors live, when the program decides (its own launcher's GPU);
  // unset: train.device, resolved per rank (Note [One device], core/device.h).
  std::optional<c10::Device> device;
  // This thread's replica group when the job runs replicas as threads (replicate): the
  // process's R replicas over shared memory, this one at rank() of it. `world` (and
  // `host`) is then this replica's own communicator over the processes (one per replica
  // index), and the data axis becomes data processes x R (Mesh). nullptr: one rank per
  // process.
  collectives::CommunicatorPtr replica;
  // The job's data, when it is built elsewhere: one copy shared by a process's replicas
  // (its methods are const and keep no state). nullptr: the trainer reads data.* itself.
  std::shared_ptr<const Dataset> data;
  // The model, when the program brings its own (the C++ API): called once per rank with
  // the data's shape, after the torch generator is seeded with train.seed. Its layers are
  // what a pipeline cuts into stages and what ZeRO-3 gathers one at a time. Built of
  // torch::nn layers it comes with its values (every rank builds the whole model; the
  // replicating strategies start from the first rank's); built of tetra's layers
  // (core/layers.h) it is shapes, and each rank creates only what it holds, as the zoo's
  // (Note [Layout-invariant initialisation]). nullptr: the trainer builds model.* itself.
  std::function<torch::nn::Sequential(const DataInfo&)> model;
  // Called once at the start of run(), on every rank (check writer() to print once).
  std::function<void(const Trainer&)> on_start;
  // Called after each step with (step, loss) — a skipped one too, with its non-finite
  // loss; tests use it to stop a run.
  std::function<void(int64_t, double)> on_step;
};

class Trainer {
 public:
  explicit Trainer(JobSpec spec, TrainerOptions options = {});
  ~Trainer();

  // Trains to the last step. Collective over the world. A step whose loss or gradients
  // are not finite throws tetra::Error on every rank under train.on_nonfinite: stop. A stop
  // request (core::request_stop, SIGTERM/SIGINT under tetra::run; Note [Stop requests]) ends
  // the run after the step every rank agrees on, with that step's checkpoint written, by
  // throwing PreemptedError on every rank.
  TrainResult run();
  EvalResult evaluate();

  // This rank's model: the whole model, or the layers of its pipeline stages.
  torch::nn::Sequential& model() { return model_; }
  // The whole model's parameter count, whatever this rank keeps of it.
  int64_t model_parameters() const { return model_parameters_; }
  const Dataset& dataset() const { return *data_; }
  // Where this rank's tensors live (train.device; Note [One device], core/device.h).
  torch::Device device() const { return device_; }
  const JobSpec& spec() const { return spec_; }
  const Plan& job_plan() const { return plan_; }
  int64_t total_steps() const { return total_steps_; }
  int data_rank() const { return data_rank_; }
  int data_size() const { return data_size_; }
  // Rank 0 of the world (its replica 0) prints, logs and writes checkpoints.
  bool writer() const { return !ranks_ || ranks_->rank() == 0; }
  const std::vector<std::unique_ptr<Strategy>>& strategies() const { return strategies_; }
  // The job's mesh of groups (nullptr for one process): tests read its axes' traffic.
  const Mesh* mesh() const { return mesh_.get(); }
  // The model state this rank holds now (parameters, gradients, optimizer state and the
  // communication buffers of a strategy that owns the state), counted by storage.
  ModelStateBytes memory() const;
  // Collective over the world: the whole model's parameters under their single-process
  // names on the writer (empty elsewhere), whatever the layout (pipeline stages, ZeRO-3).
  TensorMap weights();

 private:
  struct Loop;  // one run()'s outputs and counters (trainer.cpp)
  void restore(const CheckpointReader& ckpt);
  // Note [A finished run stays]: "" to train on; what to say when there is nothing to
  // train. Throws ConfigError when training would write over the folder's finished run.
  // Collective over every rank.
  std::string finished_run() const;
  std::string save_checkpoint(int64_t step, int64_t epoch, int64_t step_in_epoch);
  // What one step did (Note [One decision per step], core/step.cpp).
  struct StepOutcome {
    double loss = 0;
    bool skipped = false;  // not finite, and train.on_nonfinite: skip
    std::string why;       // when skipped: what was not finite, and where
    int stop = 0;          // a stop request on some rank (core::stop_requested()'s value)
    double grad_norm = -1;  // the global gradient norm before clipping; -1 without clipping
  };
  StepOutcome train_step(const torch::Tensor& indices);
  // The model-order index of the first parameter whose gradient this rank holds (in part,
  // under ZeRO) is not finite; -1 when every one is finite.
  int64_t first_nonfinite_gradient();
  // Averages a scalar over the data-parallel ranks (identity on one).
  double data_average(double v);
  // This rank's counters for the records, with `m` its memory() now (the caller has it).
  RankState rank_state(const ModelStateBytes& m) const;
  // A batch on this rank's device (Note [One device]): the one place batches move.
  Batch on_device(Batch b) const;

  Plan plan_;  // validated on construction: a broken composition never starts
  const JobSpec& spec_;  // plan_'s
  TrainerOptions options_;
  std::shared_ptr<const Dataset> data_;
  torch::nn::Sequential model_{nullptr};
  std::vector<NamedParam> params_;
  // The whole model's parameter names in model order, whatever this rank keeps: the
  // index the ranks agree on for "the first parameter whose gradient is not finite".
  std::vector<std::string> param_names_;
  std::map<std::string, int64_t> param_index_;
  int64_t model_parameters_ = 0;
  torch::Device device_ = torch::kCPU;  // this rank's (Note [One device], core/device.h)
  std::unique_ptr<RunIdentity> identity_;  // what checkpoints and exports say of the run
  std::string resume_changes_;             // the settings that differ from the resumed checkpoint's
  std::string init_note_;  // Note [Weights from elsewhere]: what the run started from ("" when drawn)
  int64_t skipped_steps_ = 0;  // this run's
  std::unique_ptr<LrSchedule> schedule_;
  std::unique_ptr<BatchPlan> batches_;
  int64_t total_steps_ = 0;
  int64_t step_ = 0, epoch_ = 0, step_in_epoch_ = 0;
  std::optional<double> best_accuracy_;
  std::string resumed_from_;
  Trace trace_;
  std::unique_ptr<Mesh> mesh_;
  // Host tensors go over the host plane (Note [Two planes]):
  collectives::CommunicatorPtr ranks_;  // every rank: the world, x replicas (nullptr: one)
  collectives::CommunicatorPtr data_group_;  // the data axis (nullptr: one process)
  int data_rank_ = 0, data_size_ = 1;
  std::vector<std::unique_ptr<Strategy>> strategies_;
  std::unique_ptr<Materializer> weights_;  // creates the tensors of the model built as shapes
  std::unique_ptr<TrainState> state_;
  // Note [Capabilities]: exactly one runner and one owner, a strategy's or core's.
  StepRunner* runner_ = nullptr;
  std::unique_ptr<LocalRunner> local_runner_;
  ModelStateOwner* owner_ = nullptr;
  std::unique_ptr<ReplicatedState> replicated_;
  std::vector<StateGatherer*> gatherers_;
  TrainResult::Phases phases_;
};

// Note [Ranks a plan makes]
// Replication is a step of the plan like the others, applied in composition order: its
// section (a StrategyConfig that is also a RankMaker) makes the ranks the job trains as,
// beside those the launcher made (replicate: R threads in each process, each a Trainer
// over its replica group), and core::train asks the plan for one rather than a tool
// branching on which section is there.
class RankMaker {
 public:
  virtual ~RankMaker() = default;
  // Runs on each rank once its run ended (collective calls such as Trainer::weights()
  // are allowed).
  using AfterRun = std::function<void(int rank, Trainer& trainer, const TrainResult& result)>;
  // Trains `spec` on the ranks it makes, each a Trainer with its own options (its world,
  // its replica group) made from `options`. Returns its first rank's result.
  virtual TrainResult train(const JobSpec& spec, TrainerOptions options, const AfterRun& after) const = 0;
};

// Trains the job on this process: on the ranks the plan's RankMaker makes when it has an
// active one, else as one Trainer. Collective over options.world.
TrainResult train(const JobSpec& spec, TrainerOptions options, const RankMaker::AfterRun& after = {});

}  // namespace tetra::core
