// The pipeline strategy (GPipe, DESIGN.md): the model's layer sequence cut into stages
// on the ranks of the mesh's `pipeline` axis, each step's batch split into
// micro-batches that flow through the stages at the same time.
//
// Note [How a pipeline step runs]
// attach() keeps this rank's stages of the model (the whole model is built first, from
// the job's seed, so every layer starts exactly as in one process) and names their
// parameters as one process names them. The step is a schedule (schedule.h): per rank,
// a list of forward/backward/send/recv instructions that the executor runs in order.
// Activations travel forward and their gradients backward over point-to-point links
// between neighbouring pipeline ranks, one two-rank communicator per direction and
// kind, so a send of activations never queues behind a receive of gradients on the same
// progress thread. Shapes are agreed once: every rank probes the whole model on one
// example at attach, so each boundary's [n, ...] shape and dtype are known on both
// sides and messages carry bare tensor bytes. The last stage computes the loss of each
// micro-batch weighted by its share of the batch, so the gradients that accumulate over
// the micro-batches are those of the whole batch: one step equals the full-batch step.
// The loss reaches every pipeline rank by a broadcast from the last one.
//
// Composition. The pipeline owns forward and backward; before each backward it calls
// the step's before_backward hook, which runs the other strategies' hooks (the data-
// parallel strategy then allreduces this stage's gradients over its data group as the
// last micro-batch's backward produces them). It never reaches into them.
//
// Checkpoints. gather_state() sends every stage's tensors to the writer under the names
// one process uses, so a checkpoint does not depend on the layout that wrote it: a run
// saved with 2 stages resumes on 1, on 4, or with another balance.
#pragma once

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/job_spec.h"
#include "core/strategy.h"
#include "pipeline/options.h"
#include "pipeline/partition.h"
#include "pipeline/schedule.h"

namespace tetra::pipeline {

// What a run measured, per rank (for benchmarks and the closing summary).
struct PipelineStats {
  int64_t steps = 0;
  double busy_s = 0;   // forward + backward compute (including recomputation)
  double wait_s = 0;   // blocked on a neighbour: receives, and the step's last sends
  double wall_s = 0;   // from the step's first instruction to its last send's end
  // Idle fraction of this rank over the steps: the time it waited for its neighbours
  // (the rest is its own work: compute, loading its data, the loss).
  double bubble() const { return wall_s > 0 ? wait_s / wall_s : 0.0; }
};

// The cut a run makes from its layers' costs (partition.h; measure_layers): by the
// balance, and under pipeline.memory_gb with balance by_time the fastest cut whose every
// stage fits (Note [Stage memory]); when none fits, the one that needs least.
Partition cut_stages(const Options& opt, const std::vector<LayerCost>& costs, const core::JobSpec& spec);
// The stages of `part` over pipeline.memory_gb, one issue each, naming the stage, its rank,
// its layers and its bytes (none when memory_gb is 0).
std::vector<core::PlanIssue> memory_issues(const Options& opt, const Partition& part, const std::vector<LayerCost>& costs,
                                           const core::JobSpec& spec);

// The strategy object, for code that wants its stats (dynamic_cast from Strategy).
class PipelineStrategy : public core::Strategy {
 public:
  virtual const PipelineStats& stats() const = 0;
  virtual const Partition& partition() const = 0;
  virtual const Schedule& schedule() const = 0;
};

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

}  // namespace tetra::pipeline
