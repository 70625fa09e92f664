#include "collectives/backends.h"

#include "collectives/build_config.h"
#include "collectives/error.h"

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
  const BackendEntry& e = at(name);
  if (std::string why = e.unavailable ? e.unavailable() : ""; !why.empty())
    throw ConfigError("collectives backend \"" + name + "\" cannot run here: " + why);
  CommunicatorPtr world = e.create(launch, options);
  check_launch_agrees(launch, name, world->rank(), world->size());
  return world;
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
