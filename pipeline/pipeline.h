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
//
// The plugin, by what each part does: options.h reads and checks the `pipeline:` keys;
// cut.h decides which layers each stage holds (partition.h: the arithmetic of a cut);
// schedule.h writes the schedules as instruction lists and simulates them; executor.h
// runs them, one handler per instruction (split_backward.h: a backward as B and W); and
// pipeline.cpp is the strategy that attaches them to a run, with its plan and estimate.
#pragma once

#include <cstdint>

#include "core/job_spec.h"
#include "core/strategy.h"
#include "pipeline/cut.h"
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

// The strategy object, for code that wants its stats (dynamic_cast from Strategy).
class PipelineStrategy : public core::Strategy {
 public:
  virtual const PipelineStats& stats() const = 0;
  virtual const Partition& partition() const = 0;
  virtual const Schedule& schedule() const = 0;
};

}  // namespace tetra::pipeline
