// Backends by name: the registry the job's `collectives.backend` is looked up in.
//
// Each backend registers a factory that builds the world communicator of this process
// from the launch information, and a predicate that says whether it can run here (and
// why not). Built-ins are registered explicitly by register_builtin_backends() — the one
// place that knows which optional backends this build has.
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
  // "" when usable here, else why not ("no CUDA device", "built without NCCL").
  std::function<std::string()> unavailable;
  std::function<CommunicatorPtr(const LaunchInfo&, const WorldOptions&)> create;
};

class BackendRegistry {
 public:
  void add(BackendEntry entry);  // a duplicate name is a tetra::Error
  bool contains(const std::string& name) const;
  // Unknown names are a tetra::ConfigError listing the known ones.
  const BackendEntry& at(const std::string& name) const;
  std::vector<std::string> names() const;
  // Builds the world; an unavailable backend is a ConfigError saying why; the world's
  // rank and size are checked against the launcher's (check_launch_agrees).
  CommunicatorPtr create_world(const std::string& name, const LaunchInfo& launch,
                               const WorldOptions& options = {}) const;

 private:
  std::map<std::string, BackendEntry> entries_;
};

// mpi, nccl (when built), gloo (when built). `local` is not a world backend: it makes N
// thread-ranks inside one process (collectives/local.h).
void register_builtin_backends(BackendRegistry& registry);

}  // namespace tetra::collectives
