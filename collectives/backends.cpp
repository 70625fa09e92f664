#include "collectives/backends.h"

#include "collectives/build_config.h"
#include "collectives/error.h"
#include "hardware/env.h"

#if TETRA_HAVE_MPI
#include "collectives/mpi.h"
#endif
#if TETRA_HAVE_NCCL
#include "collectives/nccl.h"
#endif
#if TETRA_HAVE_GLOO
#include "collectives/gloo.h"
#endif

namespace tetra::collectives {

void BackendRegistry::add(BackendEntry entry) {
  if (entries_.count(entry.name)) throw Error("collectives backend \"" + entry.name + "\" registered twice");
  std::string name = entry.name;
  entries_.emplace(std::move(name), std::move(entry));
}

bool BackendRegistry::contains(const std::string& name) const { return entries_.count(name) != 0; }

std::vector<std::string> BackendRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [n, e] : entries_) out.push_back(n);
  return out;
}

const BackendEntry& BackendRegistry::at(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    std::string known;
    for (const auto& n : names()) known += (known.empty() ? "" : ", ") + n;
    throw ConfigError("collectives backend \"" + name + "\" is not known (this build has: " + known + ")");
  }
  return it->second;
}

CommunicatorPtr BackendRegistry::create_world(const std::string& name, const LaunchInfo& launch,
                                              const WorldOptions& options) const {
  return create_planes(name, launch, options).data;
}

Planes BackendRegistry::create_planes(const std::string& name, const LaunchInfo& launch,
                                      const WorldOptions& options) const {
  const BackendEntry& e = at(name);
  if (std::string why = e.unavailable ? e.unavailable() : ""; !why.empty())
    throw ConfigError("collectives backend \"" + name + "\" cannot run here: " + why);
  Planes planes;
  if (!e.carries_host) {
    const std::string host = host_backend_for(launch);
    if (!contains(host))
      throw ConfigError("collectives backend \"" + name + "\" carries device tensors only, and the host tensors' backend " +
                        host + " is not in this build");
    planes.host = create_planes(host, launch, options).host;
  }
  planes.data = e.create(launch, options, planes.host);
  check_launch_agrees(launch, name, planes.data->rank(), planes.data->size());
  if (!planes.host) planes.host = planes.data;
  return planes;
}

std::string Planes::describe() const {
  if (!data) return "none";
  return shared() ? data->backend() : data->backend() + " (host tensors over " + host->backend() + ")";
}

std::string host_backend_for(const LaunchInfo& launch) {
  // srun with a PMI plugin, or TETRA_RANK's override inside an mpirun job, can start MPI too.
  const bool mpi_env = env::is_set(env::kOmpiRank) || env::is_set(env::kPmixRank) || env::is_set(env::kPmiRank);
  const bool mpi = launch.launcher == "mpirun" || launch.launcher == "pmix" ||
                   ((launch.launcher == "slurm" || launch.launcher == "override") && mpi_env);
  return mpi || !TETRA_HAVE_GLOO ? "mpi" : "gloo";
}

void register_builtin_backends(BackendRegistry& registry) {
#if TETRA_HAVE_MPI
  register_mpi_backend(registry);
#endif
#if TETRA_HAVE_NCCL
  register_nccl_backend(registry);
#endif
#if TETRA_HAVE_GLOO
  register_gloo_backend(registry);
#endif
}

}  // namespace tetra::collectives
