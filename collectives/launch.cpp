#include "collectives/launch.h"

#include <cstdint>
#include <cstdlib>
#include <sstream>

#include "collectives/error.h"
#include "hardware/env.h"

namespace tetra::collectives {

namespace {

// The launch's variables by name: the declared ones this process has (detect_launch()), or
// a test's. Read by knob, so that a name read here is a name declared (Note [Knobs
// declared once]).
using Env = std::map<std::string, std::string>;
using env::Knob;

// nullptr when unset or empty.
const std::string* get(const Env& vars, const Knob& knob) {
  auto it = vars.find(knob.name);
  return it == vars.end() || it->second.empty() ? nullptr : &it->second;
}

int parse_int(const Env& vars, const Knob& knob, int fallback, int min) {
  const std::string* v = get(vars, knob);
  if (!v) return fallback;
  char* end = nullptr;
  long n = std::strtol(v->c_str(), &end, 10);
  if (!end || *end != '\0' || n < min || n > 1 << 24)
    throw ConfigError(std::string("launch: ") + knob.name + "=" + *v + " is not " +
                      (min == 0 ? "a non-negative" : "a positive") + " integer");
  return static_cast<int>(n);
}

// "abc[01-03,7]def" style: one name with its bracket groups, into `out`.
void expand_name(const std::string& list, const std::string& name, std::vector<std::string>& out) {
  const auto open = name.find('[');
  if (open == std::string::npos) {
    if (name.find(']') != std::string::npos) throw ConfigError("host list '" + list + "': a ']' without its '['");
    out.push_back(name);
    return;
  }
  const auto close = name.find(']', open);
  if (close == std::string::npos) throw ConfigError("host list '" + list + "': a '[' without its ']'");
  const std::string head = name.substr(0, open), tail = name.substr(close + 1);
  std::stringstream ranges(name.substr(open + 1, close - open - 1));
  std::string range;
  bool any = false;
  while (std::getline(ranges, range, ',')) {
    const auto dash = range.find('-');
    const std::string lo_s = range.substr(0, dash), hi_s = dash == std::string::npos ? lo_s : range.substr(dash + 1);
    auto number = [&](const std::string& t) {
      if (t.empty() || t.size() > 9 || t.find_first_not_of("0123456789") != std::string::npos)
        throw ConfigError("host list '" + list + "': '" + range + "' is not a number or a range of numbers");
      return std::stol(t);
    };
    const long lo = number(lo_s), hi = number(hi_s);
    if (hi < lo || hi - lo >= 1 << 20)
      throw ConfigError("host list '" + list + "': the range '" + range + "' runs backwards or is too long");
    for (long n = lo; n <= hi; ++n) {
      std::string digits = std::to_string(n);
      if (digits.size() < lo_s.size()) digits.insert(0, lo_s.size() - digits.size(), '0');
      expand_name(list, head + digits + tail, out);
    }
    any = true;
  }
  if (!any) throw ConfigError("host list '" + list + "': an empty '[]'");
}

// Note [Slurm port]: the gloo rendezvous port when the job script does not export
// MASTER_PORT. Every task of a step computes it from the ids they share; two steps of one
// job (run side by side with `srun ... &`) differ by the step id, two jobs on one node by
// the job id. The range 10000-29999 stays below Linux's ephemeral ports (32768-60999),
// where an outgoing connection could hold it. Two jobs whose ids meet modulo 20000 on one
// node would still collide: rank 0 then fails to bind it, and the message says to export
// MASTER_PORT.
int slurm_port(uint64_t job, uint64_t step) { return 10000 + static_cast<int>((job * 7 + step) % 20000); }

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list) {
  std::vector<std::string> out;
  int depth = 0;
  std::string item;
  auto flush = [&] {
    if (item.empty()) throw ConfigError("host list '" + list + "': an empty name");
    expand_name(list, item, out);
    item.clear();
  };
  for (char c : list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (depth < 0 || depth > 1) throw ConfigError("host list '" + list + "': unbalanced or nested brackets");
    if (c == ',' && depth == 0) {
      flush();
    } else if (c != ' ') {
      item += c;
    }
  }
  if (depth != 0) throw ConfigError("host list '" + list + "': a '[' without its ']'");
  flush();
  return out;
}

std::vector<int> expand_tasks_per_node(const std::string& counts) {
  std::vector<int> out;
  if (!counts.empty() && counts.back() == ',') throw ConfigError("task counts '" + counts + "' end in a comma");
  std::stringstream in(counts);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long n = std::strtol(item.c_str(), &end, 10);
    long times = 1;
    if (end && *end == '(') {
      char* e2 = nullptr;
      if (end[1] != 'x') throw ConfigError("task counts '" + counts + "': '" + item + "' is not N or N(xK)");
      times = std::strtol(end + 2, &e2, 10);
      end = (e2 && *e2 == ')') ? e2 + 1 : nullptr;
    }
    if (!end || *end != '\0' || n < 1 || times < 1 || times > 1 << 20 || end == item.c_str())
      throw ConfigError("task counts '" + counts + "': '" + item + "' is not N or N(xK)");
    out.insert(out.end(), static_cast<size_t>(times), static_cast<int>(n));
  }
  if (out.empty()) throw ConfigError("task counts '" + counts + "' are empty");
  return out;
}

LaunchInfo detect_launch() {
  Env vars;
  for (const Knob* k : env::knobs())
    if (std::optional<std::string> v = env::get(*k)) vars[k->name] = std::move(*v);
  return detect_launch(vars);
}

namespace {

// A task of an srun step (Note [Slurm]).
void slurm_step(const Env& vars, LaunchInfo& l) {
  l.launcher = "slurm";
  const Knob& size = get(vars, env::kSlurmStepNumTasks) ? env::kSlurmStepNumTasks : env::kSlurmNTasks;
  if (!get(vars, size)) throw ConfigError("launch: SLURM_PROCID is set without SLURM_STEP_NUM_TASKS or SLURM_NTASKS");
  l.rank = parse_int(vars, env::kSlurmProcId, 0, 0);
  l.world_size = parse_int(vars, size, 0, 1);
  l.local_rank = parse_int(vars, env::kSlurmLocalId, 0, 0);
  l.evidence = "SLURM_PROCID=" + *get(vars, env::kSlurmProcId) + " " + size.name + "=" + *get(vars, size);
  if (get(vars, env::kPmixRank)) l.evidence += " PMIX_RANK=" + *get(vars, env::kPmixRank);
  const Knob& per_node = get(vars, env::kSlurmStepTasksPerNode) ? env::kSlurmStepTasksPerNode
                         : get(vars, env::kSlurmNTasksPerNode)  ? env::kSlurmNTasksPerNode
                                                                 : env::kSlurmTasksPerNode;
  if (auto v = get(vars, per_node)) {
    const std::vector<int> counts = expand_tasks_per_node(*v);
    const int node = parse_int(vars, env::kSlurmNodeId, 0, 0);
    l.local_world_size = counts[static_cast<size_t>(node) < counts.size() ? static_cast<size_t>(node) : 0];
  }
  l.hosts = parse_int(vars, get(vars, env::kSlurmStepNumNodes) ? env::kSlurmStepNumNodes : env::kSlurmNNodes, 0, 0);
  // gloo's rendezvous
  const Knob& nodes = get(vars, env::kSlurmStepNodeList) ? env::kSlurmStepNodeList : env::kSlurmJobNodeList;
  std::string addr_from, port_from;
  if (auto a = get(vars, env::kMasterAddr)) {
    l.master_addr = *a;
    addr_from = "MASTER_ADDR";
  } else if (auto list = get(vars, nodes)) {
    l.master_addr = expand_hostlist(*list).front();
    addr_from = std::string("the first node of ") + nodes.name;
  }
  if (get(vars, env::kMasterPort)) {
    l.master_port = parse_int(vars, env::kMasterPort, 0, 1);
    port_from = "MASTER_PORT";
  } else if (get(vars, env::kSlurmJobId)) {
    // Job ids run past parse_int's bound on busy clusters (up to 2^26 and more).
    const std::string& job_text = *get(vars, env::kSlurmJobId);
    if (job_text.find_first_not_of("0123456789") != std::string::npos || job_text.size() > 19)
      throw ConfigError("launch: SLURM_JOB_ID=" + job_text + " is not a job id");
    const uint64_t job = std::stoull(job_text);
    const int step = parse_int(vars, env::kSlurmStepId, 0, 0);
    l.master_port = slurm_port(job, static_cast<uint64_t>(step));
    port_from = "a port from SLURM_JOB_ID " + std::to_string(job) + " step " + std::to_string(step);
  }
  l.master_source = addr_from + (addr_from.empty() || port_from.empty() ? "" : ", ") + port_from;
}

}  // namespace

LaunchInfo detect_launch(const Env& vars) {
  LaunchInfo l;
  auto take = [&](const char* launcher, const Knob& rank, const Knob* size, const Knob* local_rank,
                  const Knob* local_size) {
    l.launcher = launcher;
    l.rank = parse_int(vars, rank, 0, 0);
    l.world_size = size ? parse_int(vars, *size, 0, 1) : 0;
    l.local_rank = local_rank ? parse_int(vars, *local_rank, 0, 0) : 0;
    l.local_world_size = local_size ? parse_int(vars, *local_size, 1, 1) : 1;
    std::ostringstream ev;
    ev << rank.name << "=" << *get(vars, rank);
    if (size && get(vars, *size)) ev << " " << size->name << "=" << *get(vars, *size);
    l.evidence = ev.str();
  };
  if (get(vars, env::kRank) || get(vars, env::kWorldSize)) {
    if (!get(vars, env::kRank) || !get(vars, env::kWorldSize))
      throw ConfigError("launch: set both TETRA_RANK and TETRA_WORLD_SIZE, or neither");
    take("override", env::kRank, &env::kWorldSize, &env::kLocalRank, &env::kLocalWorldSize);
  } else if (get(vars, env::kTorchRank) && get(vars, env::kTorchWorldSize)) {
    take("torchrun", env::kTorchRank, &env::kTorchWorldSize, &env::kTorchLocalRank, &env::kTorchLocalWorldSize);
    if (auto a = get(vars, env::kMasterAddr)) l.master_addr = *a;
    l.master_port = parse_int(vars, env::kMasterPort, 0, 0);
    if (auto a = get(vars, env::kTorchelasticUseAgentStore); a && *a == "True") {
      l.agent_store = true;
      l.restart = parse_int(vars, env::kTorchelasticRestartCount, 0, 0);
    }
  } else if (get(vars, env::kOmpiRank)) {
    take("mpirun", env::kOmpiRank, &env::kOmpiSize, &env::kOmpiLocalRank, &env::kOmpiLocalSize);
    if (auto m = get(vars, env::kOmpiMappingPolicy)) l.map_by = *m;
    if (auto b = get(vars, env::kOmpiBindingPolicy)) l.bind_to = *b;
  } else if (get(vars, env::kSlurmProcId) && get(vars, env::kSlurmStepId) &&
             (!get(vars, env::kPmixRank) || *get(vars, env::kPmixRank) == *get(vars, env::kSlurmProcId))) {
    slurm_step(vars, l);
  } else if (get(vars, env::kPmixRank)) {
    take("pmix", env::kPmixRank, nullptr, nullptr, nullptr);
  } else if (get(vars, env::kSlurmProcId) && get(vars, env::kSlurmNTasks)) {
    // The batch script of an allocation, not a task of a step (Note [Slurm]).
    l.evidence = "a Slurm batch step: SLURM_NTASKS=" + *get(vars, env::kSlurmNTasks) + ", no SLURM_STEP_ID";
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
    if (launch.launcher == "slurm" && backend == "mpi" && world_size == 1)
      os << " (under srun, Open MPI finds its peers through PMIx: srun --mpi=pmix, or MpiDefault=pmix in "
            "slurm.conf)";
    throw CommError(os.str());
  }
}

std::string describe(const LaunchInfo& l) {
  if (l.launcher == "single") return l.evidence.empty() ? "1 process" : "1 process (" + l.evidence + ")";
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
    const bool step_size = l.evidence.find("SLURM_STEP_NUM_TASKS") != std::string::npos;
    os << " (srun: SLURM_PROCID, " << (step_size ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS")
       << (l.evidence.find("PMIX_RANK") != std::string::npos ? "; PMIx" : "") << ")";
  } else if (l.launcher == "pmix") {
    os << " (PMIX_RANK)";
  } else if (l.launcher == "override") {
    os << " (TETRA_RANK, TETRA_WORLD_SIZE)";
  }
  return os.str();
}

}  // namespace tetra::collectives
