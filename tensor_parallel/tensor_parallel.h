// The tensor-parallel strategy (Megatron-LM's): the fifth mesh axis, innermost, over which
// each transformer block's matrices are split — attention's query/key/value projection
// column-parallel by heads and its output projection row-parallel, the MLP's first
// matmul column- and second row-parallel, the token embedding and the output layer
// vocabulary-parallel with a loss that never gathers the logits (Note [Tensor-parallel
// maps] and Note [Vocabulary-parallel loss], core/tensor_group.h). Each rank builds and
// creates only its parts (Note [Placements], core/placement.h), drawn as one process
// draws those elements, so the run follows one process.
//
//   mesh: {data: 2, tensor: 2}      # 4 ranks: two data slices of two tensor ranks each
//   tensor: {sequence_parallel: true}   # optional: mesh.tensor > 1 turns the strategy on
//
// Sequence parallelism (Korthikanti et al.) runs the norms, the dropouts and the residual
// stream on this rank's block of the sequence: each block's allreduces become an
// all-gather before the column-parallel layer and a reduce-scatter after the row-parallel
// one (the same bytes), activations outside attention and the MLP shrink by T, and each
// replicated parameter's gradient (the norms', the positions', the row layers' biases),
// now a sum over the blocks, is summed over the tensor group as it is computed.
//
// It composes after the pipeline and before the data axis (kCompositionOrder): data
// parallelism averages each part over the ranks that hold the same part. Checkpoints and
// exports hold whole tensors under their single-process names (the strategy assembles
// them on the writer), so a checkpoint resumes onto any tensor degree.
#pragma once

#include <memory>
#include <vector>

#include "core/strategy.h"

namespace tetra::tensor_parallel {

struct Options : core::StrategyConfig {
  bool sequence_parallel = false;  // tensor.sequence_parallel
  // tensor.overlap: a column-parallel Linear's backward sums its input gradient while it
  // computes its weight gradient (Note [Overlapped input gradient], mappings.cpp).
  bool overlap = true;

  std::unique_ptr<core::Strategy> build() const override;
  void shape_model(core::TensorSlot& slot) const override;
  std::string plan(const core::PlanInput& input) const override;
  void estimate(const core::PlanInput& input, core::RankEstimate& rank) const override;
  core::StrategyRole role(const core::JobSpec& job) const override;
  std::vector<core::PlanIssue> issues(const core::JobSpec& job) const override;
  YAML::Node to_yaml() const override;
};

// Registers the `tensor` section (owner of the mesh's tensor axis).
void register_tensor_parallel(core::SectionRegistry& registry);

}  // namespace tetra::tensor_parallel
