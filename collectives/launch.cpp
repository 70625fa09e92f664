#include "collectives/launch.h"

#include <cstdlib>
#include <sstream>

#include "collectives/error.h"

extern char** environ;

namespace tetra::collectives {

namespace {

using Env = std::map<std::string, std::string>;

const std::string* get(const Env& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

int parse_int(const Env& env, const char* name, int fallback, int min) {
  const std::string* v = get(env, name);
  if (!v) return fallback;
  char* end = nullptr;
  long n = std::strtol(v->c_str(), &end, 10);
  if (!end || *end != '\0' || n < min || n > 1 << 24)
    throw ConfigError(std::string("launch: ") + name + "=" + *v + " is not " +
                      (min == 0 ? "a non-negative" : "a positive") + " integer");
  return static_cast<int>(n);
}

// SLURM_NTASKS_PER_NODE may read "4" or "4(x2)".
int parse_leading_int(const Env& env, const char* name, int fallback) {
  const std::string* v = get(env, name);
  if (!v) return fallback;
  int n = std::atoi(v->c_str());
  return n > 0 ? n : fallback;
}

}  // namespace

LaunchInfo detect_launch() {
  Env env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return detect_launch(env);
}

LaunchInfo detect_launch(const Env& env) {
  LaunchInfo l;
  auto take = [&](const char* launcher, const char* rank, const char* size, const char* local_rank,
                  const char* local_size) {
    l.launcher = launcher;
    l.rank = parse_int(env, rank, 0, 0);
    l.world_size = size ? parse_int(env, size, 0, 1) : 0;
    l.local_rank = local_rank ? parse_int(env, local_rank, 0, 0) : 0;
    l.local_world_size = local_size ? parse_int(env, local_size, 1, 1) : 1;
    std::ostringstream ev;
    ev << rank << "=" << *get(env, rank);
    if (size && get(env, size)) ev << " " << size << "=" << *get(env, size);
    l.evidence = ev.str();
  };
  if (get(env, "TETRA_RANK") || get(env, "TETRA_WORLD_SIZE")) {
    if (!get(env, "TETRA_RANK") || !get(env, "TETRA_WORLD_SIZE"))
      throw ConfigError("launch: set both TETRA_RANK and TETRA_WORLD_SIZE, or neither");
    take("override", "TETRA_RANK", "TETRA_WORLD_SIZE", "TETRA_LOCAL_RANK", "TETRA_LOCAL_WORLD_SIZE");
  } else if (get(env, "RANK") && get(env, "WORLD_SIZE")) {
    take("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    if (auto a = get(env, "MASTER_ADDR")) l.master_addr = *a;
    l.master_port = parse_int(env, "MASTER_PORT", 0, 0);
    if (auto a = get(env, "TORCHELASTIC_USE_AGENT_STORE"); a && *a == "True") {
      l.agent_store = true;
      l.restart = parse_int(env, "TORCHELASTIC_RESTART_COUNT", 0, 0);
    }
  } else if (get(env, "OMPI_COMM_WORLD_RANK")) {
    take("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE");
    if (auto m = get(env, "OMPI_MCA_rmaps_base_mapping_policy")) l.map_by = *m;
    if (auto b = get(env, "OMPI_MCA_hwloc_base_binding_policy")) l.bind_to = *b;
  } else if (get(env, "PMIX_RANK")) {
    take("pmix", "PMIX_RANK", nullptr, nullptr, nullptr);
  } else if (get(env, "SLURM_PROCID") && get(env, "SLURM_NTASKS")) {
    take("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr);
    l.local_world_size = parse_leading_int(env, "SLURM_NTASKS_PER_NODE", 1);
  }
  if (l.world_size > 0 && l.rank >= l.world_size)
    throw ConfigError("launch: rank " + std::to_string(l.rank) + " is not below the world size " +
                      std::to_string(l.world_size) + " (" + l.evidence + ")");
  if (l.local_rank >= l.local_world_size && l.launcher != "pmix")
    l.local_world_size = l.local_rank + 1;
  return l;
}

void check_launch_agrees(const LaunchInfo& launch, const std::string& backend, int rank, int world_size) {
  if (launch.launcher == "single" && world_size == 1) return;
  if ((launch.world_size != 0 && launch.world_size != world_size) || launch.rank != rank) {
    std::ostringstream os;
    os << "the launcher (" << launch.launcher << ": " << launch.evidence << ") says rank "
       << launch.rank << " of " << launch.world_size << ", the " << backend << " backend has rank "
       << rank << " of " << world_size;
    if (launch.launcher == "single")
      os << " (was this started under a launcher that the " << backend << " backend does not know?)";
    throw CommError(os.str());
  }
}

std::string describe(const LaunchInfo& l) {
  if (l.launcher == "single") return "1 process";
  std::ostringstream os;
  os << l.launcher << ", world " << l.world_size << ", local ranks " << l.local_world_size;
  if (l.launcher == "torchrun") {
    os << " (RANK, WORLD_SIZE";
    if (!l.master_addr.empty() || l.master_port)
      os << "; store at " << (l.master_addr.empty() ? "127.0.0.1" : l.master_addr) << ":" << l.master_port
         << (l.agent_store ? ", torchrun's agent's" : ", rank 0's");
    os << ")";
  } else if (l.launcher == "mpirun") {
    os << " (OMPI_COMM_WORLD_RANK, _SIZE";
    if (!l.map_by.empty() || !l.bind_to.empty()) os << ";";
    if (!l.map_by.empty()) os << " --map-by " << l.map_by;
    if (!l.bind_to.empty()) os << " --bind-to " << l.bind_to;
    os << ")";
  } else if (l.launcher == "slurm") {
    os << " (SLURM_PROCID, SLURM_NTASKS)";
  } else if (l.launcher == "pmix") {
    os << " (PMIX_RANK)";
  } else if (l.launcher == "override") {
    os << " (TETRA_RANK, TETRA_WORLD_SIZE)";
  }
  return os.str();
}

}  // namespace tetra::collectives
