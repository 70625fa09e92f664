// A job's data with one poisoned training sample, for the tests of train.on_nonfinite:
// the sample at `position` of the global batch of `step` (1-based) reads as NaN, so only
// the rank, micro-batch and pipeline stage that read it see it — the way a corrupt record
// shows up in a real run. Used by tests/core/test_faults.cpp (one process) and
// tests/zero/test_faults.cpp (every strategy).
#pragma once

#include <torch/torch.h>

#include <limits>
#include <memory>

#include "core/data.h"
#include "core/job_spec.h"

namespace tetra::testing_faults {

class PoisonedData : public core::Dataset {
 public:
  PoisonedData(const core::JobSpec& spec, int64_t step, int64_t position)
      : base_(core::make_dataset(spec.data, spec.train.seed)) {
    core::BatchPlan plan(base_->size(core::Split::kTrain), spec.data.batch_size, spec.train.seed, spec.data.shuffle);
    const int64_t spe = plan.steps_per_epoch();
    sample_ = plan.global_batch((step - 1) / spe, (step - 1) % spe)[position].item<int64_t>();
  }
  const core::DataInfo& info() const override { return base_->info(); }
  int64_t size(core::Split split) const override { return base_->size(split); }
  core::Batch get(core::Split split, const torch::Tensor& indices) const override {
    core::Batch b = base_->get(split, indices);
    if (split != core::Split::kTrain) return b;
    b.inputs = b.inputs.clone();
    for (int64_t i = 0; i < indices.size(0); ++i)
      if (indices[i].item<int64_t>() == sample_) b.inputs[i].fill_(std::numeric_limits<float>::quiet_NaN());
    return b;
  }

 private:
  std::unique_ptr<core::Dataset> base_;
  int64_t sample_ = -1;
};

}  // namespace tetra::testing_faults
