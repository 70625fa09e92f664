#include "core/device.h"

#include <torch/types.h>

#include <ATen/Context.h>
#include <torch/cuda.h>

#include "core/plan.h"
#include "hardware/env.h"

namespace tetra::core {

std::string device_problem(const JobSpec& spec) {
  if (spec.train.device != DeviceKind::kCuda) return "";
  if (!at::hasCUDA())
    return "train.device: cuda, but this tetra is built against a LibTorch without CUDA (a CPU build); "
           "set train.device=cpu, or build tetra against PyTorch's CUDA LibTorch";
  if (torch::cuda::device_count() == 0) {
    const std::optional<std::string> visible = env::get(env::kCudaVisibleDevices);  // "" hides every GPU
    return std::string("train.device: cuda, but no GPU is visible to this process") +
           (visible ? " (CUDA_VISIBLE_DEVICES=\"" + *visible + "\")" : std::string("")) +
           "; set train.device=cpu, or run it where a GPU is";
  }
  // Replica threads reduce through the local backend, whose thread ranks read each other's
  // memory through host pointers (Note [Two planes]): not a GPU's.
  if (const int replicas = Plan(spec).replicas(); replicas > 1)
    return "train.device: cuda with replicate.replicas " + std::to_string(replicas) +
           ": replica threads share host memory only (the local backend), not GPUs; run one process per GPU "
           "(mpirun -np / torchrun --nproc_per_node) and set replicate.replicas=1";
  // A GPU rank's tensors travel between processes by NCCL, or by Gloo (c10d's Gloo takes
  // CUDA tensors in its collectives, not in its sends: no pipeline over it); MPI here
  // takes CPU tensors only.
  const int world = spec.mesh.world_size();
  const std::string backend = backend_of(spec);
  if (world > 1 && backend != "nccl" && backend != "gloo")
    return "train.device: cuda over " + std::to_string(world) + " processes needs collectives.backend: nccl (or gloo; " +
           backend + " takes CPU tensors); set collectives.backend=nccl";
  if (world > 1 && backend == "gloo" && spec.mesh.size("pipeline") > 1)
    return "train.device: cuda with mesh.pipeline " + std::to_string(spec.mesh.size("pipeline")) +
           " needs collectives.backend: nccl (gloo sends CPU tensors only, and pipeline stages send activations); "
           "set collectives.backend=nccl";
  return "";
}

torch::Device rank_device(const JobSpec& spec, int local_rank, int replica, int replicas) {
  if (spec.train.device != DeviceKind::kCuda) return torch::Device(torch::kCPU);
  const int count = static_cast<int>(torch::cuda::device_count());
  const int index = count > 0 ? (local_rank * replicas + replica) % count : 0;
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

}  // namespace tetra::core
