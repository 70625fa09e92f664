// ZeRO (DeepSpeed's Zero Redundancy Optimizer, DESIGN.md): the model state sharded over
// the ranks of the mesh's `data` axis instead of replicated on each.
//
// Note [Flat units and shards]
// The parameters this rank trains (its pipeline stage's, or the whole model's) are laid
// out in units, FSDP's flat parameters: stages 1 and 2 cut them into buckets of about
// bucket_mb in reverse order (backward's order, so a unit's reduce-scatter can start as
// soon as backward has produced it); stage 3 makes one unit per layer of the model's
// sequence (what is gathered before that layer runs). A unit is its parameters back to
// back in one flat buffer, padded with zeros to a multiple of N x 16 elements (N data
// ranks), so each rank owns exactly 1/N of every unit — the same number of elements on
// every rank, not whole parameters (PyTorch's ZeroRedundancyOptimizer assigns whole
// parameters greedily and ends up uneven). A rank's shard is its chunk of every unit;
// the optimizer state (one fused pass per unit chunk, core::fused_update) exists for
// the shard only.
//
//   stage 1: parameters and gradients whole (gradients as views of the unit buffers, as
//            in data parallelism); after backward each unit is reduce-scattered (average)
//            and the rank steps its chunk; the updated chunks are all-gathered.
//   stage 2: gradients sharded too: when backward has produced a unit's gradients they
//            are copied into a pooled buffer, freed, and reduce-scattered into the rank's
//            gradient shard while backward goes on; only the shard lives until the step.
//   stage 3: parameters sharded too: each layer of the sequence is wrapped; its unit is
//            all-gathered just before its forward and freed after it, gathered again when
//            its output's gradient arrives (an autograd function on the layer's output)
//            and freed once its gradients are taken. The next `prefetch` layers' gathers
//            are issued ahead, on a communicator of their own, so they overlap compute.
//            Freeing keeps each parameter's shape and drops its storage's bytes (FSDP's
//            storage resize), so autograd's saved references see the values again once
//            the unit is gathered for backward.
//
// Micro-batches that only accumulate (train.accumulation_steps, pipeline micro-batches)
// communicate nothing: their gradients accumulate whole in each parameter's .grad, and
// only the step's last backward reduce-scatters. During such a step a rank holds the
// whole gradients (4 bytes per parameter in fp32) as stage 0 does; stage 2 and 3 save
// them only between the step's last backward and the next step.
//
// Checkpoints: each rank writes its slices of the parameters and of the optimizer state
// under the single-process names; any layout reads back the ranges it needs (another N,
// stage, pipeline cut, or one process).
#pragma once

#include <memory>
#include <string>

#include "core/job_spec.h"
#include "core/strategy.h"

namespace tetra::zero {

struct Options : core::StrategyConfig {
  int stage = 0;            // 0 (off: data_parallel allreduces) | 1 | 2 | 3
  double bucket_mb = 25;    // stages 1 and 2: size of a unit (reduce-scatter bucket), MiB
  bool overlap = true;      // reduce-scatter each unit as backward produces it
  int prefetch = 1;         // stage 3: layers gathered ahead of the one running
  std::unique_ptr<core::Strategy> build() const override;
  core::StrategyRole role(const core::JobSpec& job) const override;
  std::string plan(const core::PlanInput& input) const override;
  void estimate(const core::PlanInput& input, core::RankEstimate& rank) const override;
  YAML::Node to_yaml() const override;
};

// Registers the `zero` section. It owns no mesh axis: it shards over `data`, and when its
// stage is >= 1 it, not the data_parallel allreduce, synchronises that axis's gradients.
void register_zero(core::SectionRegistry& registry);

// Note [ZeRO's parts]
// A stage names which parts of the model state are sharded over the one flat-unit layout:
// the optimizer state (stage 1), the gradients too (2: reduce-scattered into a pooled
// shard as backward produces them, instead of kept whole and sliced), the parameters too
// (3: each layer's unit gathered around its forward and its backward). Everything below
// the parse asks the parts, never the stage's number; the estimate (Note [One memory
// model] in zero.cpp) is the same function of the parts and the layout for every stage.
struct Parts {
  bool optimizer = false;
  bool gradients = false;
  bool parameters = false;
  static Parts of(int stage);
  // "the optimizer state, the gradients, the parameters"
  std::string what() const;
};

}  // namespace tetra::zero
