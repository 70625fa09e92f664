// Note [One device]
// train.device (cpu | cuda) names where the framework's tensors live: the model's
// parameters and every shard of them, gradient buckets and pools, ZeRO's gathered units,
// a pipeline's inboxes, the batches. The trainer resolves it once per rank (rank_device)
// and hands it to everything that creates a tensor through one path: TrainState::device
// for the strategies, the Materializer for the model, StepInput for the runner's batches.
// No second code path exists for GPUs: a strategy creates with options().device(device)
// what it creates on the CPU today.
//
// cuda: a rank's GPU is its local rank (replica threads: local rank x replicas +
// replica), modulo the GPUs it sees (CUDA_VISIBLE_DEVICES narrows them, as everywhere);
// bf16 is CUDA autocast. On a machine where it cannot run (a LibTorch built without CUDA,
// or no GPU visible), device_problem says what is missing and the job ends with exit 2
// before anything trains.
#pragma once

#include <c10/core/Device.h>

#include <string>

#include "core/job_spec.h"

namespace tetra::core {

// What stops train.device from being used on this machine ("" when nothing does).
std::string device_problem(const JobSpec& spec);

// Whether a tensor made in host memory is already on `device`: the plain CPU. Any other
// device takes it by a copy (the one path of Note [One device]): cuda, and the pretend
// device cpu:0 that the two-planes test trains on, which tells its tensors from host
// memory by where they were made (tests/tools/test_two_planes.cpp, Note [Pretend device]).
inline bool in_host_memory(const c10::Device& device) { return device == c10::Device(c10::kCPU); }

// This rank's device: kCPU, or the GPU of Note [One device]. `local_rank` is the
// process's rank on its host, `replica` its replica thread of `replicas`.
c10::Device rank_device(const JobSpec& spec, int local_rank, int replica = 0, int replicas = 1);

}  // namespace tetra::core
