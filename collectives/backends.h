// Backends by name: the registry the job's `collectives.backend` is looked up in.
//
// Each backend registers a factory that builds the world communicator of this process
// from the launch information, and a predicate that says whether it can run here (and
// why not). Built-ins are registered explicitly by register_builtin_backends() — the one
// place that knows which optional backends this build has.
//
// Note [Two planes]
// A job's tensors live in two places: its device tensors (gradients, ZeRO's units,
// pipeline activations, tensor-parallel sums) where train.device puts them, and its host
// tensors (loss and metric averages, the records, checkpoint checksums, fingerprints, the
// step's one decision, barriers, the monitor's handshake) in host memory. A backend says
// which it carries (Communicator::refuses): nccl only CUDA tensors, Debian's Open MPI only
// host memory, gloo and local both. So a job has two planes, as PyTorch's
// `cpu:gloo,cuda:nccl`: the data plane, the backend of collectives.backend, and beside it,
// when that backend carries no host tensors, the host plane: mpi under mpirun or srun with
// PMI, gloo otherwise (torchrun), built first, since the data plane bootstraps over it
// (NCCL's unique id is a broadcast). When the data plane carries host tensors too (every CPU
// job), the two are one communicator and nothing is built twice. The mesh hands each
// strategy both groups of its axis (Mesh::axis for device tensors, Mesh::host for host
// tensors) and core the host plane's; nothing else picks a communicator.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/launch.h"

namespace tetra::collectives {

struct WorldOptions {
  Duration timeout = kDefaultTimeout;  // for set-up and as the default op timeout
};

struct BackendEntry {
  std::string name;
  std::string description;  // "Open MPI 4.1.4"
  // Whether its ops take host tensors (Note [Two planes]); one that does not serves the
  // data plane only, and a host backend is built beside it.
  bool carries_host = true;
  // "" when usable here, else why not ("no CUDA device", "built without NCCL").
  std::function<std::string()> unavailable;
  // `host`: the host plane built beside a backend that does not carry host tensors (its
  // bootstrap); nullptr for one that does.
  std::function<CommunicatorPtr(const LaunchInfo&, const WorldOptions&, const CommunicatorPtr& host)> create;
};

// A job's two planes (Note [Two planes]). `host` is `data` itself when the data plane's
// backend carries host tensors.
struct Planes {
  CommunicatorPtr data;  // device tensors
  CommunicatorPtr host;  // host tensors: the control plane
  bool shared() const { return data == host; }
  // "nccl (host tensors over mpi)", or the one backend's name.
  std::string describe() const;
};

// The backend that carries the host plane of this launch: mpi under mpirun, PMIx, or srun
// with a PMI plugin (and TETRA_RANK's override inside such a job); gloo otherwise
// (torchrun, srun without PMI) when this build has it.
std::string host_backend_for(const LaunchInfo& launch);

class BackendRegistry {
 public:
  void add(BackendEntry entry);  // a duplicate name is a tetra::Error
  bool contains(const std::string& name) const;
  // Unknown names are a tetra::ConfigError listing the known ones.
  const BackendEntry& at(const std::string& name) const;
  std::vector<std::string> names() const;
  // Builds the world; an unavailable backend is a ConfigError saying why; the world's
  // rank and size are checked against the launcher's (check_launch_agrees).
  // For a backend that carries no host tensors this is the data plane of create_planes.
  CommunicatorPtr create_world(const std::string& name, const LaunchInfo& launch,
                               const WorldOptions& options = {}) const;
  // Both planes with `name` the data plane's backend: the host plane (host_backend_for the
  // launch) first when that backend carries no host tensors, else one world for both.
  Planes create_planes(const std::string& name, const LaunchInfo& launch, const WorldOptions& options = {}) const;

 private:
  std::map<std::string, BackendEntry> entries_;
};

// mpi, nccl (when built), gloo (when built). `local` is not a world backend: it makes N
// thread-ranks inside one process (collectives/local.h).
void register_builtin_backends(BackendRegistry& registry);

}  // namespace tetra::collectives
