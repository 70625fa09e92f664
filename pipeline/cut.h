// The cut: which of the model's layers each pipeline stage holds, by pipeline.balance and
// within pipeline.memory_gb, from what each layer costs; and what crosses each boundary
// between stages. partition.h solves a cut over numbers alone; this measures the model to
// give it those numbers, and holds the memory a stage needs (Note [Stage memory]).
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "core/job_spec.h"
#include "core/strategy.h"
#include "pipeline/options.h"
#include "pipeline/partition.h"
#include "pipeline/schedule.h"

namespace tetra::pipeline {

// The model's layers with their parameter counts, output sizes for one micro-batch and
// (when `time` is set) forward and backward seconds measured on a micro-batch of
// `micro_batch` examples from `data`. Used by attach (by_time) and --dry-run.
//
// Note [Layer costs]: the output sizes come from one sample's probe (core::probe_layers:
// at most 64 tokens, scaled), never from a whole micro-batch. The times come from the
// micro-batch itself while its forward is at most `max_timed_flops` (a run's by_time cut
// times the real thing); above it, as a dry run of a billion-parameter model asks (24
// layers x 4 timed passes of a 4 x 1024-token micro-batch would take this machine most of
// an hour), each layer is timed on the probe's sample and its times scaled by the layer's
// FLOPs on the micro-batch over its FLOPs on the sample (core::forward_flops; by the
// elements for a layer with no matmul), and LayerCost::scaled says so. Small inputs run
// below a core's peak, so scaled times lean high; the balance they give is what matters.
// Layers of one signature (core::layer_signature: a transformer's repeated blocks) are timed
// once. A layer built as shapes is created for its timing and freed after. `probe`: the
// plan's probe of the model at this precision, when one was taken (else it is taken here).
std::vector<LayerCost> measure_layers(torch::nn::Sequential& model, const core::Dataset& data,
                                      int64_t micro_batch, bool bf16, bool time,
                                      double max_timed_flops = std::numeric_limits<double>::infinity(),
                                      const core::LayerProbe* probe = nullptr);
// The budget a dry run gives measure_layers: a micro-batch whose forward is more FLOPs than
// this is timed on one sample and scaled (about a second of this machine's time for the
// 4 timed passes of forward and backward at the full size).
constexpr double kDryRunTimedFlops = 5e9;

// The cut a run makes from its layers' costs (partition.h; measure_layers): by the
// balance, and under pipeline.memory_gb with balance by_time the fastest cut whose every
// stage fits (Note [Stage memory]); when none fits, the one that needs least.
Partition cut_stages(const Options& opt, const std::vector<LayerCost>& costs, const core::JobSpec& spec);
// The stages of `part` over pipeline.memory_gb, one issue each, naming the stage, its rank,
// its layers and its bytes (none when memory_gb is 0).
std::vector<core::PlanIssue> memory_issues(const Options& opt, const Partition& part, const std::vector<LayerCost>& costs,
                                           const core::JobSpec& spec);

// ---- within the plugin: attach, the executor, plan and estimate ------------------------

// Layer i of a model.
inline torch::nn::AnyModule& layer(torch::nn::Sequential& model, int i) { return *(model->begin() + i); }

// cut_stages from `costs`, or (empty: a cut that needs no timing) the model's sizes.
Partition partition_for(const Options& opt, torch::nn::Sequential& model, std::vector<LayerCost> costs,
                        const core::JobSpec& spec);

// What flows out of each layer for one example: shape without the batch dimension, dtype.
struct Boundary {
  std::vector<int64_t> tail;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape(int64_t n) const {
    std::vector<int64_t> s{n};
    s.insert(s.end(), tail.begin(), tail.end());
    return s;
  }
  int64_t bytes(int64_t n) const {
    int64_t b = n * static_cast<int64_t>(c10::elementSize(dtype));
    for (int64_t d : tail) b *= d;
    return b;
  }
};

// Runs the whole model on one example (no grad, the run's precision) and records each
// layer's output: every rank computes the same table, so the boundaries need no header.
std::vector<Boundary> probe_boundaries(torch::nn::Sequential& model, const core::Dataset& data, bool bf16);

// Note [Stage memory]
// What a rank holds at its peak for one of its stages, as pipeline.memory_gb counts it:
// the stage's parameters with their gradients and optimizer state (fp32 and replicated:
// ZeRO over the data group holds less, so the cap errs safe), and the activations its
// schedule keeps. Every micro-batch in flight (forward run, backward or B not yet) keeps
// the stage's layer outputs — under checkpointing only its input, plus one micro-batch
// being recomputed — and under a zero-bubble schedule every micro-batch between its B and
// its W keeps the inputs of the stage's layers with parameters (what the weight gradients
// multiply: the paper's M_W). The counts of micro-batches come from the simulator, per
// rank (simulate's peak_in_flight and peak_weight_pending). With v chunks on a rank, each
// stage gets 1/v of the rank's cap.
class StageMemoryModel {
 public:
  StageMemoryModel(const Options& o, const std::vector<LayerCost>& costs, const core::JobSpec& spec);
  struct Bytes {
    int64_t state = 0, activations = 0;
    int in_flight = 0, weight_pending = 0;  // the micro-batches counted
    int64_t total() const { return state + activations; }
  };
  Bytes operator()(int stage, int first, int end) const;
  // The cap on one stage: the rank's share for one of its chunks (0: no cap).
  double cap() const { return opt_.memory_gb * 1073741824.0 / opt_.virtual_stages; }
  // The schedule the counts come from, and its simulation (plan and estimate use them too).
  const Schedule& schedule() const { return sched_; }
  const Simulation& simulation() const { return sim_; }

 private:
  const Options& opt_;
  const std::vector<LayerCost>& costs_;
  Schedule sched_;
  Simulation sim_;
  int64_t slots_;
  std::vector<int64_t> params_, acts_, weight_inputs_;  // prefix sums over the layers
};

}  // namespace tetra::pipeline
