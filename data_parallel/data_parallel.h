// The data-parallel strategy: the same model on every rank of the mesh's `data` axis,
// each on its own slice of the global batch, gradients averaged by allreduce.
//
// Note [Buckets and overlap]
// Parameters are grouped into buckets of about bucket_mb, in reverse order of
// definition (the order backward produces their gradients). Each parameter's .grad is a
// view of its slot in a flat bucket buffer (PyTorch DDP's gradient_as_bucket_view), so
// autograd accumulates every micro-batch's gradient straight into the buffer that the
// allreduce sends, and the averaged result lands where the optimizer reads it: no copy
// into the bucket, none out of it. With overlap on, a post hook on each parameter's
// AccumulateGrad node marks the slot ready on the last micro-batch of a step; the moment
// a bucket's last slot is ready its allreduce is issued on the data axis's communicator,
// which runs it on its own progress thread while backward goes on computing the next
// layers. Before the optimizer step, finish_gradients() issues what is left (parameters
// that got no gradient contribute zeros) and waits for every bucket. Micro-batches that
// only accumulate communicate nothing. With overlap off, every bucket is issued after
// backward. Something that replaces a .grad (rather than writing into it) is noticed
// and the slot is re-bound, at the cost of one copy.
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
#include <vector>

#include "core/job_spec.h"
#include "core/strategy.h"

namespace tetra::data_parallel {

// data_parallel.compression: the gradients' type on the wire.
enum class Compression { kNone, kFp16, kBf16 };
const std::vector<std::string>& compression_names();  // none fp16 bf16
// data_parallel.hierarchical: reduce inside each host, allreduce across hosts, broadcast
// inside (auto: when the data group spans hosts with several ranks each).
enum class Hierarchy { kAuto, kOn, kOff };
const std::vector<std::string>& hierarchy_names();  // auto on off

struct Options : core::StrategyConfig {
  double bucket_mb = 25;           // bucket size in MiB; > 0
  bool overlap = true;             // allreduce during backward
  Compression compression = Compression::kNone;
  Hierarchy hierarchical = Hierarchy::kAuto;
  // Not a job-spec key (never parsed or written): a benchmark's switch through the C++ API
  // (tools/bench_train.cpp) that skips the gradient allreduce, for the compute-only ceiling
  // of a run. The ranks drift apart.
  bool compute_only = false;
  std::unique_ptr<core::Strategy> build() const override;
  core::StrategyRole role(const core::JobSpec& job) const override;
  void estimate(const core::PlanInput& input, core::RankEstimate& rank) const override;
  YAML::Node to_yaml() const override;
};

// Registers the `data_parallel` section (owner of the `data` mesh axis). Hosts are the
// mesh's (core::Mesh::hosts: hardware::hostname, TETRA_HOSTNAME where the launcher or the
// user names them).
void register_data_parallel(core::SectionRegistry& registry);

}  // namespace tetra::data_parallel
