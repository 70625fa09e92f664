// The executor: runs this rank's part of a pipeline schedule (schedule.h), one handler per
// kind of instruction (Op), and the evaluation's forward through the stages (Note [How a
// pipeline step runs], pipeline.h). attach (pipeline.cpp) decides what it runs with, in
// RankStages, once; each step's state is the executor's own (executor.cpp).
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <utility>
#include <vector>

#include "collectives/communicator.h"
#include "core/job_spec.h"
#include "core/mesh.h"
#include "core/step.h"
#include "core/telemetry.h"
#include "pipeline/cut.h"
#include "pipeline/options.h"
#include "pipeline/partition.h"
#include "pipeline/pipeline.h"
#include "pipeline/schedule.h"

namespace tetra::pipeline {

// ---- links between neighbouring ranks -------------------------------------------------

// One direction of one kind between two ranks: a two-rank communicator whose rank 0
// sends and rank 1 receives. Its own progress thread keeps its transfers in order.
struct Link {
  collectives::CommunicatorPtr comm;
  int peer() const { return 1 - comm->rank(); }
};

// ---- this rank's stages ---------------------------------------------------------------

// What the executor runs on this rank: the schedule and the cut, what crosses each
// boundary, this rank's layers and its links to its neighbours. attach fills it in.
struct RankStages {
  Options opt;
  const core::JobSpec* spec = nullptr;
  core::Trace* trace = nullptr;
  int rank = 0;  // this rank's coordinate on the pipeline axis
  at::Device device = at::kCPU;  // Note [One device]
  collectives::Duration timeout = collectives::kDefaultTimeout;
  Schedule sched;
  Partition partition;
  std::vector<Boundary> boundaries;  // boundaries[i]: layer i's output
  std::vector<torch::nn::Sequential> chunks;      // cut from *model by chunk_ranges on first use
  std::vector<std::pair<int, int>> chunk_ranges;  // (first layer in the kept model, layers)
  torch::nn::Sequential* model = nullptr;         // the trainer's model (this rank's layers)
  const core::ModelLoss* loss = nullptr;          // the trainer's (TrainState::loss)
  collectives::CommunicatorPtr pp;
  collectives::CommunicatorPtr pp_host;  // the same ranks' host plane: the loss, norms, state (Note [Two planes])
  // This rank's links, by (from, to) pipeline rank: activations flow from stage s to s+1,
  // gradients back. Under ZBV's V both kinds flow both ways between neighbours.
  std::map<std::pair<int, int>, Link> act_links, grad_links;

  int stage(int chunk) const { return sched.stage_of(rank, chunk); }
  bool first(int chunk) const { return stage(chunk) == 0; }
  bool last(int chunk) const { return stage(chunk) == sched.total_stages() - 1; }
  // The input boundary of a stage (the previous stage's output).
  const Boundary& input_of(int chunk) const { return boundaries[partition.first(stage(chunk)) - 1]; }
  const Boundary& output_of(int chunk) const { return boundaries[partition.end(stage(chunk)) - 1]; }
  bool checkpointed(int micro) const {
    return opt.checkpoint == Recompute::kAlways ||
           (opt.checkpoint == Recompute::kExceptLast && micro != opt.micro_batches - 1);
  }
  // Neighbouring stages' ranks (this rank itself when they hand over locally).
  int prev_rank(int chunk) const { return sched.rank_of(stage(chunk) - 1); }
  int next_rank(int chunk) const { return sched.rank_of(stage(chunk) + 1); }
  int prev_chunk(int chunk) const { return sched.chunk_of(stage(chunk) - 1); }
  int next_chunk(int chunk) const { return sched.chunk_of(stage(chunk) + 1); }
  const Link& act_link(int from, int to) const { return act_links.at({from, to}); }
  const Link& grad_link(int from, int to) const { return grad_links.at({from, to}); }

  // The pipeline axis' communicators and this rank's links: one two-rank communicator
  // per direction and kind between each pair of ranks whose stages neighbour.
  void make_links(const core::Mesh& mesh);
  // Cuts the chunks from the trainer's model on first use (attach says why not sooner).
  void cut_chunks();
  // `t` from the last stage's rank to every pipeline rank, over the host plane.
  void broadcast_from_last(at::Tensor t) const;
};

// Runs one training step's schedule on this rank (train.accumulation_steps rounds of it),
// adding what it measured to `stats`; the step's loss reaches every pipeline rank.
core::StepOutput run_step(RankStages& st, const core::StepInput& step, PipelineStats& stats);
// The evaluation forward: the batch in pieces through every stage in order, the sums on
// every pipeline rank.
core::EvalSums run_evaluation(RankStages& st, const core::Batch& batch, bool bf16);

}  // namespace tetra::pipeline
