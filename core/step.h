// One training step's forward and backward on one rank, and who runs it.
//
// Note [One step runner]
// The trainer always holds exactly one StepRunner. Core's LocalRunner runs the step's
// micro-batches one after the other on the whole model (train.accumulation_steps of them);
// a pipeline runs them through its stages in its schedule's order. Both take their
// micro-batches from MicroBatches, which is where the arithmetic they share is written
// once: each micro-batch's rows of this rank's slice, its dropout key (Note
// [Layout-invariant dropout]), its loss weighted by its share of the rows so that the
// weighted losses sum to the step's mean, the first micro-batch whose loss is not finite
// (train.on_nonfinite names it), and where the time went. The runner also runs the
// evaluation forward (it is the one that knows where the model's layers are).
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "collectives/communicator.h"
#include "core/data.h"
#include "core/random.h"
#include "core/telemetry.h"

namespace tetra::core {

// One step's work for this rank.
struct StepInput {
  torch::Tensor indices;  // this data rank's samples of the global batch
  std::function<Batch(const torch::Tensor& indices)> load;  // reads samples
  // Runs the strategies' before_backward(last): call it before each backward, with
  // last = true before the step's last backward on this rank.
  std::function<void(bool last)> before_backward;
  bool bf16 = false;  // bf16 autocast for the forward, on `device`
  torch::Device device = torch::kCPU;  // where the batches `load` returns live (Note [One device])
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

// Seconds between laps of a steady clock.
class Stopwatch {
 public:
  using Clock = std::chrono::steady_clock;
  Stopwatch() : t_(Clock::now()) {}
  // Seconds since the last lap (or the start), and a new lap begins.
  double lap() {
    const Clock::time_point now = Clock::now();
    const double s = std::chrono::duration<double>(now - t_).count();
    t_ = now;
    return s;
  }
  // Seconds since the last lap (or the start); no new lap.
  double elapsed() const { return std::chrono::duration<double>(Clock::now() - t_).count(); }

 private:
  Clock::time_point t_;
};

// A step's micro-batches on this rank (Note [One step runner]).
class MicroBatches {
 public:
  MicroBatches(const StepInput& step, int64_t count);
  int64_t count() const { return static_cast<int64_t>(indices_.size()); }
  const torch::Tensor& indices(int64_t i) const { return indices_.at(static_cast<size_t>(i)); }
  int64_t rows(int64_t i) const { return indices(i).size(0); }
  // Micro-batch i's samples; the time goes to data.
  Batch load(int64_t i);
  // The dropout key of micro-batch i's forward (and of its recompute).
  RandomContext random(int64_t i) const;
  // Its share of this rank's rows.
  double weight(int64_t i) const { return static_cast<double>(rows(i)) / static_cast<double>(n_); }
  // Its mean loss weighted by its share: what backward runs on.
  torch::Tensor weighted(int64_t i, const torch::Tensor& loss) const;
  // Adds micro-batch i's mean loss (unweighted) to the step's, and notes it when it is not
  // finite (the lowest such i is the one named).
  void add_loss(int64_t i, double loss);
  // The step's loss over this rank's rows (the weighted sum), with the times and the
  // non-finite micro-batch; the runner adds its forward and backward times to it.
  StepOutput& out() { return out_; }

 private:
  const StepInput& step_;
  int64_t n_ = 0;
  std::vector<torch::Tensor> indices_;
  StepOutput out_;
};

// The capability of running the step's forward and backward (Note [One step runner]).
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // The mean loss over step.indices, the same on every rank that ran a part of it.
  virtual StepOutput run(const StepInput& step) = 0;
  // The sums of one evaluation batch, the same on every rank that ran a part of it
  // (train mode is off; no gradient is kept).
  virtual EvalSums evaluate(const Batch& batch, bool bf16) = 0;
  // A pipeline's bubble, over the run: the seconds this rank waited on its neighbours
  // within its steps' schedules, out of the seconds those schedules ran ({0, 0} for a
  // runner without stages). The trainer reports wait/wall per logging interval.
  struct Idle {
    double wait_s = 0, wall_s = 0;
  };
  virtual Idle idle() const { return {}; }
};

// The training loss of a model's output against its targets, and its count of correct
// top-1 predictions: core's model_loss and count_correct, unless a strategy gives the
// output another form (tensor parallelism's logits split by vocabulary, Note
// [Vocabulary-parallel loss]) and sets its own at attach. Runners read it when they run.
struct ModelLoss {
  std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& targets)> loss;
  std::function<int64_t(const torch::Tensor& output, const torch::Tensor& targets)> correct;
};
ModelLoss cross_entropy_loss();  // model_loss and count_correct

// Core's runner: the micro-batches one after the other through the whole model, each
// one's gradients accumulated into the parameters' (gradient accumulation).
class LocalRunner final : public StepRunner {
 public:
  LocalRunner(torch::nn::Sequential& model, Trace& trace, int64_t micro_batches, const ModelLoss& loss)
      : model_(model), trace_(trace), micro_(micro_batches), loss_(loss) {}
  StepOutput run(const StepInput& step) override;
  EvalSums evaluate(const Batch& batch, bool bf16) override;

 private:
  torch::nn::Sequential& model_;
  Trace& trace_;
  int64_t micro_;
  const ModelLoss& loss_;
};

// What this rank saw of a step once its gradients are final (Note [One decision per step]).
struct StepSeen {
  double loss = 0;                     // the step's loss over the global batch
  int64_t nonfinite_micro_batch = -1;  // StepOutput's
  double nonfinite_loss = 0;
  int64_t nonfinite_param = -1;  // the model-order index of the first parameter whose gradient is not finite
  int stop = 0;                  // a stop request (core::stop_requested())
};

// What every rank decided from what each saw.
struct StepVerdict {
  bool nonfinite = false;  // the loss or a gradient is not finite somewhere
  std::string why;         // then: what, and where ("step 7 (epoch 1), data rank 1: the loss is nan; ...")
  int stop = 0;            // the largest stop request of any rank (0: none)
};

// Where the step is, for the words of a verdict.
struct StepPlace {
  int64_t step = 0, epoch = 0;  // 0-based
  int data_rank = 0, data_size = 1;
  int64_t micro_batches = 1;                     // per data rank and step
  const std::vector<std::string>* param_names;  // the whole model's, in model order
};

// Collective over `ranks` (every rank of the job; nullptr: one process): one allreduce.
StepVerdict agree_on_step(const StepSeen& seen, const StepPlace& place, collectives::Communicator* ranks);

}  // namespace tetra::core
