// The data-parallel strategy: the same model on every rank of the mesh's `data` axis,
// each on its own slice of the global batch, gradients averaged by allreduce.
//
// Note [Buckets and overlap]
// Parameters are grouped into buckets of about bucket_mb, in reverse order of
// definition (the order backward produces their gradients). A hook on each parameter
// sees its gradient as autograd computes it; on the last micro-batch of a step it copies
// the step's whole gradient (what .grad already accumulated plus this one) into the
// parameter's slot of its bucket, and the moment a bucket's last slot is filled its
// allreduce is issued on the data axis's communicator. That communicator runs it on its
// own progress thread while backward goes on computing the next layers. Before the
// optimizer step, finish_gradients() waits for every bucket and copies the averages into
// .grad. Micro-batches that only accumulate communicate nothing. With overlap off, one
// pass after backward packs every gradient and allreduces bucket by bucket.
//
// Compression (fp16 | bf16) casts a bucket to 16 bits before the allreduce and back
// after: half the bytes on the wire, at the cost of the 16-bit sum's rounding (about
// 1e-3 relative for fp16, 1e-2 for bf16 — loss curves then follow the fp32 run only to
// that tolerance, and fp16 can overflow past 65504).
//
// Hierarchical (Horovod's hierarchical allreduce) reduces inside each host, allreduces
// across hosts among ranks with the same local rank, and gathers inside the host:
// reduce_scatter (host) -> allreduce (across) -> allgather (host). `auto` picks it when
// the data axis spans more than one host with more than one rank on each.
#pragma once

#include <memory>
#include <string>

#include "core/job_spec.h"
#include "core/strategy.h"

namespace tetra::data_parallel {

struct Options : core::StrategyConfig {
  double bucket_mb = 25;           // bucket size in MiB; > 0
  bool overlap = true;             // allreduce during backward
  std::string compression = "none";  // none | fp16 | bf16
  std::string hierarchical = "auto";  // auto | on | off
  // For tests: how many consecutive data ranks count as one host (0 = ask the launcher).
  int ranks_per_host = 0;
  // For benchmarks only: skip the gradient allreduce (the compute-only ceiling of a run;
  // the ranks' models then drift apart).
  bool skip_allreduce = false;
  std::unique_ptr<core::Strategy> build() const override;
};

// Registers the `data_parallel` section (owner of the `data` mesh axis).
void register_data_parallel(core::SectionRegistry& registry);

}  // namespace tetra::data_parallel
