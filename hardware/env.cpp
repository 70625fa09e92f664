#include "hardware/env.h"

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace tetra::env {

// Note [Knobs declared once]: the key that only this file can hand a Knob's constructor.
struct Knob::Key {};

namespace {
constexpr Knob::Key key{};
}  // namespace

// Each knob once: name, kind, whose, default, what it does. knobs() lists them in this
// order, and a test counts the definitions here against it.

// ---- tetra's own ----------------------------------------------------------------------

constexpr Knob kJobSecret{key, "TETRA_JOB_SECRET", Kind::kText, "tetra", "",
                          "The job's secret key (any text) that the monitor's handshake proves (Note [Job "
                          "secret]); set on every process, it never travels. Unset: rank 0 draws one and gives it "
                          "to the ranks over the launcher's channel; set on some ranks and not others, it is an "
                          "error."};
constexpr Knob kCollectivesCheck{key, "TETRA_COLLECTIVES_CHECK", Kind::kFlag, "tetra", "0",
                                 "Whether each group agrees on every op (op, dtype, shape, sequence number) before it "
                                 "runs, when the job leaves collectives.check unset (Note [Health checks]). The test "
                                 "suite runs with 1."};
constexpr Knob kFlightRecorderDir{key, "TETRA_FLIGHT_RECORDER_DIR", Kind::kPath, "tetra", "",
                                  "Where the flight recorder writes its dumps until a run names its own folder "
                                  "(train: the flight folder of log.dir); for programs on the C++ API that run "
                                  "no job. Unset: no dumps before then."};
constexpr Knob kFlightRecorderEntries{key, "TETRA_FLIGHT_RECORDER_ENTRIES", Kind::kInteger, "tetra", "4096",
                                      "The ops each rank's flight recorder keeps, the oldest giving way (Note [Flight "
                                      "recorder]). A value that is not a positive integer keeps the default."};
constexpr Knob kMonitorAddr{key, "TETRA_MONITOR_ADDR", Kind::kText, "tetra", "",
                            "The address (a name or an IPv4 address) the ranks reach rank 0's monitor at; an IPv4 "
                            "address of rank 0's host is also the only one the monitor listens on. Unset: the ranks "
                            "are told rank 0's hostname and each of its IPv4 addresses (loopback alone on one host)."};
constexpr Knob kMonitorPort{key, "TETRA_MONITOR_PORT", Kind::kInteger, "tetra", "0",
                            "The port rank 0's monitor listens on; 0 or unset: any free one."};
constexpr Knob kMpiPoll{key, "TETRA_MPI_POLL", Kind::kList, "tetra", "100,5000,50,20",
                        "How the mpi backend tests a request, in microseconds: spin,yield,sleep,background_spin "
                        "(Note [Awaited and background polls]); a negative last field polls every op as awaited. A "
                        "malformed value is named on stderr and the default kept."};
constexpr Knob kCalibration{key, "TETRA_CALIBRATION", Kind::kPath, "tetra", "",
                            "The calibration file (bench-collectives --calibrate; or gpu-cluster) that train --dry-run "
                            "and --tune price a step with when --calibration is not given. Unset: this machine's, "
                            "measured."};
constexpr Knob kHostname{key, "TETRA_HOSTNAME", Kind::kText, "tetra", "",
                         "This host's name as the job knows it, as Horovod's HOROVOD_HOSTNAME: containers that share "
                         "a machine, or several hosts on one machine for a test. Unset or empty: the kernel's "
                         "hostname."};
constexpr Knob kRank{key, "TETRA_RANK", Kind::kInteger, "tetra", "",
                     "This process's rank, overriding every launcher's variables (with TETRA_WORLD_SIZE; one "
                     "without the other is an error)."};
constexpr Knob kWorldSize{key, "TETRA_WORLD_SIZE", Kind::kInteger, "tetra", "",
                          "The number of processes, with TETRA_RANK."};
constexpr Knob kLocalRank{key, "TETRA_LOCAL_RANK", Kind::kInteger, "tetra", "0",
                          "With TETRA_RANK: this process's rank among those of its host."};
constexpr Knob kLocalWorldSize{key, "TETRA_LOCAL_WORLD_SIZE", Kind::kInteger, "tetra", "1",
                               "With TETRA_RANK: the number of processes on this host."};
constexpr Knob kNoReexec{key, "TETRA_NO_REEXEC", Kind::kFlag, "tetra", "",
                         "Set (to anything): a tetra binary does not re-execute itself with OMP_WAIT_POLICY=PASSIVE "
                         "(Note [Thread pools and spinning]). tetra sets it to 1 when it does, so that it does so "
                         "once."};
constexpr Knob kMallocDefaults{key, "TETRA_MALLOC_DEFAULTS", Kind::kFlag, "tetra", "0",
                               "On: keep glibc's malloc defaults and no cache of big blocks, to measure what tetra's "
                               "tuning buys (Note [Big blocks])."};
constexpr Knob kMallocMmap{key, "TETRA_MALLOC_MMAP", Kind::kFlag, "tetra", "0",
                           "On: map and unmap every big block (no cache of big blocks), and let malloc map what it "
                           "serves above 32 MiB."};
constexpr Knob kFuzzWriteSeeds{key, "TETRA_FUZZ_WRITE_SEEDS", Kind::kPath, "tetra", "",
                               "fuzz-safetensors and fuzz-checkpoint-meta write their seed inputs into this folder "
                               "and exit, instead of fuzzing."};

// ---- torchrun ---------------------------------------------------------------------------

constexpr Knob kTorchRank{key, "RANK", Kind::kInteger, "torchrun", "",
                          "This process's rank; with WORLD_SIZE (and no TETRA_RANK) the launch is torchrun's."};
constexpr Knob kTorchWorldSize{key, "WORLD_SIZE", Kind::kInteger, "torchrun", "",
                               "The number of processes, with RANK."};
constexpr Knob kTorchLocalRank{key, "LOCAL_RANK", Kind::kInteger, "torchrun", "0",
                               "This process's rank among those of its host."};
constexpr Knob kTorchLocalWorldSize{key, "LOCAL_WORLD_SIZE", Kind::kInteger, "torchrun", "1",
                                    "The processes on this host: the launch's local ranks, and whom this host's cores "
                                    "are shared among for train.threads."};
constexpr Knob kMasterAddr{key, "MASTER_ADDR", Kind::kText, "torchrun", "",
                           "The host of the gloo backend's rendezvous (rank 0's store, or torchrun's agent's), under "
                           "torchrun or srun."};
constexpr Knob kMasterPort{key, "MASTER_PORT", Kind::kInteger, "torchrun", "",
                           "The port of the gloo backend's rendezvous. Under srun without it: a port from SLURM_JOB_ID "
                           "and SLURM_STEP_ID (Note [Slurm port])."};
constexpr Knob kTorchelasticUseAgentStore{key, "TORCHELASTIC_USE_AGENT_STORE", Kind::kText, "torchrun", "",
                                          "True: torchrun's agent already serves the store at "
                                          "MASTER_ADDR:MASTER_PORT, and every rank is its client."};
constexpr Knob kTorchelasticRestartCount{key, "TORCHELASTIC_RESTART_COUNT", Kind::kInteger, "torchrun", "0",
                                         "With the agent's store: this restart, whose key prefix the ranks use."};

// ---- Open MPI ---------------------------------------------------------------------------

constexpr Knob kOmpiRank{key, "OMPI_COMM_WORLD_RANK", Kind::kInteger, "Open MPI", "",
                         "This process's rank under mpirun; it also makes the mpi backend carry the host tensors "
                         "under srun or TETRA_RANK."};
constexpr Knob kOmpiSize{key, "OMPI_COMM_WORLD_SIZE", Kind::kInteger, "Open MPI", "",
                         "The number of processes under mpirun; names the mpi world when no job id is set."};
constexpr Knob kOmpiLocalRank{key, "OMPI_COMM_WORLD_LOCAL_RANK", Kind::kInteger, "Open MPI", "0",
                              "This process's rank among those of its host."};
constexpr Knob kOmpiLocalSize{key, "OMPI_COMM_WORLD_LOCAL_SIZE", Kind::kInteger, "Open MPI", "1",
                              "The processes on this host: the launch's local ranks, and whom this host's cores are "
                              "shared among for train.threads."};
constexpr Knob kOmpiMappingPolicy{key, "OMPI_MCA_rmaps_base_mapping_policy", Kind::kText, "Open MPI", "",
                                  "mpirun's --map-by as the ranks see it, shown in the launch's description."};
constexpr Knob kOmpiBindingPolicy{key, "OMPI_MCA_hwloc_base_binding_policy", Kind::kText, "Open MPI", "",
                                  "mpirun's --bind-to as the ranks see it; tetra never re-binds a rank mpirun placed."};
constexpr Knob kOmpiJobId{key, "OMPI_MCA_ess_base_jobid", Kind::kText, "Open MPI", "",
                          "Open MPI's job id: names the mpi world's group when PMIX_NAMESPACE is unset."};
constexpr Knob kOmpiIallreduceAlgorithm{key, "OMPI_MCA_coll_libnbc_iallreduce_algorithm", Kind::kInteger, "Open MPI",
                                        "1",
                                        "libnbc's non-blocking allreduce; tetra sets 1 (the ring) before MPI_Init "
                                        "unless it is set: the default on fewer than 4 ranks runs at about half the "
                                        "speed."};
constexpr Knob kOmpiAllowRunAsRoot{key, "OMPI_ALLOW_RUN_AS_ROOT", Kind::kFlag, "Open MPI", "",
                                   "Lets mpirun run as root (with OMPI_ALLOW_RUN_AS_ROOT_CONFIRM); bench-replicate "
                                   "sets 1 for the mpirun it starts."};
constexpr Knob kOmpiAllowRunAsRootConfirm{key, "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", Kind::kFlag, "Open MPI", "",
                                          "The confirmation OMPI_ALLOW_RUN_AS_ROOT needs; bench-replicate sets 1 as "
                                          "well."};

// ---- PMIx, PMI and MPICH ----------------------------------------------------------------

constexpr Knob kPmixRank{key, "PMIX_RANK", Kind::kInteger, "PMIx", "",
                         "This process's rank under a PMIx launcher (prterun, srun --mpi=pmix), which Open MPI's "
                         "MPI_Init finds its peers through; without it srun's tasks cannot use the mpi backend."};
constexpr Knob kPmixNamespace{key, "PMIX_NAMESPACE", Kind::kText, "PMIx", "",
                              "The job's namespace: names the mpi world's group, the same on every rank."};
constexpr Knob kPmixLocalSize{key, "PMIX_LOCAL_SIZE", Kind::kInteger, "PMIx", "",
                              "The processes on this host, whom its cores are shared among for train.threads."};
constexpr Knob kPmiRank{key, "PMI_RANK", Kind::kInteger, "PMI", "",
                        "This process's rank under a PMI-1 or PMI-2 launcher (srun --mpi=pmi2, MPICH's hydra): "
                        "under srun or TETRA_RANK, the mpi backend then carries the host tensors."};
constexpr Knob kMpiLocalNRanks{key, "MPI_LOCALNRANKS", Kind::kInteger, "MPICH", "",
                               "The processes on this host (MPICH's hydra), whom its cores are shared among for "
                               "train.threads."};

// ---- Slurm ------------------------------------------------------------------------------

constexpr Knob kSlurmProcId{key, "SLURM_PROCID", Kind::kInteger, "Slurm", "",
                            "This task's rank; with SLURM_STEP_ID the launch is srun's (Note [Slurm]), without it a "
                            "batch script, one process."};
constexpr Knob kSlurmNTasks{key, "SLURM_NTASKS", Kind::kInteger, "Slurm", "",
                            "The allocation's tasks: the world size when SLURM_STEP_NUM_TASKS is unset."};
constexpr Knob kSlurmStepId{key, "SLURM_STEP_ID", Kind::kInteger, "Slurm", "0",
                            "The step's id: marks a task of an srun step, and picks the gloo port beside "
                            "SLURM_JOB_ID."};
constexpr Knob kSlurmStepNumTasks{key, "SLURM_STEP_NUM_TASKS", Kind::kInteger, "Slurm", "",
                                  "The step's tasks: the world size."};
constexpr Knob kSlurmLocalId{key, "SLURM_LOCALID", Kind::kInteger, "Slurm", "0",
                             "This task's rank among those of its node."};
constexpr Knob kSlurmNodeId{key, "SLURM_NODEID", Kind::kInteger, "Slurm", "0",
                            "This node's index in the step: which entry of the tasks per node is this node's."};
constexpr Knob kSlurmStepTasksPerNode{key, "SLURM_STEP_TASKS_PER_NODE", Kind::kList, "Slurm", "",
                                      "The step's tasks on each node, as 2(x3),1: the local world size."};
constexpr Knob kSlurmNTasksPerNode{key, "SLURM_NTASKS_PER_NODE", Kind::kInteger, "Slurm", "",
                                   "The tasks on each node, when the step's are not given; also whom a node's cores "
                                   "are shared among for train.threads."};
constexpr Knob kSlurmTasksPerNode{key, "SLURM_TASKS_PER_NODE", Kind::kList, "Slurm", "",
                                  "The allocation's tasks on each node (2(x3),1), the last resort for the local world "
                                  "size."};
constexpr Knob kSlurmStepNumNodes{key, "SLURM_STEP_NUM_NODES", Kind::kInteger, "Slurm", "",
                                  "The step's nodes: the hosts of the launch."};
constexpr Knob kSlurmNNodes{key, "SLURM_NNODES", Kind::kInteger, "Slurm", "",
                            "The allocation's nodes, when the step's are not given."};
constexpr Knob kSlurmStepNodeList{key, "SLURM_STEP_NODELIST", Kind::kList, "Slurm", "",
                                  "The step's nodes (node[01-03],login1): the first is the gloo rendezvous's host "
                                  "when MASTER_ADDR is unset."};
constexpr Knob kSlurmJobNodeList{key, "SLURM_JOB_NODELIST", Kind::kList, "Slurm", "",
                                 "The allocation's nodes, when the step's are not given."};
constexpr Knob kSlurmJobId{key, "SLURM_JOB_ID", Kind::kText, "Slurm", "",
                           "The job's id: the gloo rendezvous's port when MASTER_PORT is unset, the mpi world's name "
                           "without PMIx, and --tune's trials start with srun inside an allocation."};
constexpr Knob kSlurmMpiType{key, "SLURM_MPI_TYPE", Kind::kText, "Slurm", "",
                             "srun's --mpi plugin, named when a step without PMIx asks for the mpi backend."};

// ---- Gloo, CUDA, OpenMP, BLIS, the shell ------------------------------------------------

constexpr Knob kGlooSocketIfname{key, "GLOO_SOCKET_IFNAME", Kind::kList, "Gloo", "",
                                 "The interfaces the gloo backend connects the ranks over (eth0,eth1), as in "
                                 "torch.distributed. Unset: the address this host's name resolves to."};
constexpr Knob kCudaVisibleDevices{key, "CUDA_VISIBLE_DEVICES", Kind::kList, "CUDA", "",
                                   "The GPUs this process sees; named when train.device is cuda and it sees none."};
constexpr Knob kCudaHome{key, "CUDA_HOME", Kind::kPath, "CUDA", "",
                         "A CUDA toolkit whose lib64/libcudart.so topo asks for the runtime's version."};
constexpr Knob kCudaPath{key, "CUDA_PATH", Kind::kPath, "CUDA", "", "The same as CUDA_HOME, tried after it."};
constexpr Knob kOmpWaitPolicy{key, "OMP_WAIT_POLICY", Kind::kText, "OpenMP", "PASSIVE",
                              "Whether idle OpenMP threads spin. Unset: a tetra binary re-executes itself once with "
                              "PASSIVE, as spinning pools cost 2.3x on two cores (Note [Thread pools and spinning])."};
constexpr Knob kBlisNumThreads{key, "BLIS_NUM_THREADS", Kind::kInteger, "BLIS", "",
                               "BLIS's threads, where its API is hidden (Debian's libblas.so.3). Unset: tetra sets "
                               "train.threads' count before the first matrix product."};
constexpr Knob kPath{key, "PATH", Kind::kList, "the shell", "",
                     "The folders report --png looks for rsvg-convert in (colon-separated)."};

namespace {

// A function's static, so that a reader during another file's static initialisation finds
// the list made.
const std::vector<const Knob*>& all() {
  static const std::vector<const Knob*> list = {
      &kJobSecret, &kCollectivesCheck, &kFlightRecorderDir, &kFlightRecorderEntries, &kMonitorAddr, &kMonitorPort,
      &kMpiPoll, &kCalibration, &kHostname, &kRank, &kWorldSize, &kLocalRank, &kLocalWorldSize, &kNoReexec,
      &kMallocDefaults, &kMallocMmap, &kFuzzWriteSeeds,
      // torchrun
      &kTorchRank, &kTorchWorldSize, &kTorchLocalRank, &kTorchLocalWorldSize, &kMasterAddr, &kMasterPort,
      &kTorchelasticUseAgentStore, &kTorchelasticRestartCount,
      // Open MPI
      &kOmpiRank, &kOmpiSize, &kOmpiLocalRank, &kOmpiLocalSize, &kOmpiMappingPolicy, &kOmpiBindingPolicy, &kOmpiJobId,
      &kOmpiIallreduceAlgorithm, &kOmpiAllowRunAsRoot, &kOmpiAllowRunAsRootConfirm,
      // PMIx, PMI and MPICH
      &kPmixRank, &kPmixNamespace, &kPmixLocalSize, &kPmiRank, &kMpiLocalNRanks,
      // Slurm
      &kSlurmProcId, &kSlurmNTasks, &kSlurmStepId, &kSlurmStepNumTasks, &kSlurmLocalId, &kSlurmNodeId,
      &kSlurmStepTasksPerNode, &kSlurmNTasksPerNode, &kSlurmTasksPerNode, &kSlurmStepNumNodes, &kSlurmNNodes,
      &kSlurmStepNodeList, &kSlurmJobNodeList, &kSlurmJobId, &kSlurmMpiType,
      // Gloo, CUDA, OpenMP, BLIS, the shell
      &kGlooSocketIfname, &kCudaVisibleDevices, &kCudaHome, &kCudaPath, &kOmpWaitPolicy, &kBlisNumThreads, &kPath};
  return list;
}

// A kind-specific accessor used on a knob of another kind is tetra's bug, not the user's.
void require(const Knob& knob, Kind kind) {
  if (knob.kind != kind)
    throw std::logic_error(std::string("env: ") + knob.name + " is a " + kind_name(knob.kind) + ", not a " +
                           kind_name(kind));
}

// A whole decimal number >= min (strtoll's reading: leading blanks allowed, nothing after).
std::optional<int64_t> whole_number(const std::string& text, int64_t min) {
  if (text.empty()) return std::nullopt;
  char* end = nullptr;
  const long long n = std::strtoll(text.c_str(), &end, 10);
  if (!end || *end != '\0' || n < min) return std::nullopt;
  return static_cast<int64_t>(n);
}

bool on(const std::string& v) { return v == "1" || v == "on" || v == "true"; }

}  // namespace

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kFlag: return "flag";
    case Kind::kInteger: return "integer";
    case Kind::kText: return "text";
    case Kind::kPath: return "path";
    case Kind::kList: return "list";
  }
  return "?";
}

bool Knob::own() const { return std::strcmp(tool, "tetra") == 0; }

const std::vector<const Knob*>& knobs() { return all(); }

std::optional<std::string> get(const Knob& knob) {
  if (const char* v = std::getenv(knob.name)) return std::string(v);
  return std::nullopt;
}

bool is_set(const Knob& knob) { return std::getenv(knob.name) != nullptr; }

std::string text(const Knob& knob) {
  const char* v = std::getenv(knob.name);
  return v && *v ? std::string(v) : std::string(knob.fallback);
}

bool flag(const Knob& knob) {
  require(knob, Kind::kFlag);
  return on(text(knob));
}

std::optional<int64_t> integer_value(const Knob& knob, int64_t min) {
  require(knob, Kind::kInteger);
  const char* v = std::getenv(knob.name);
  return v ? whole_number(v, min) : std::nullopt;
}

int64_t integer(const Knob& knob, int64_t min) {
  if (std::optional<int64_t> n = integer_value(knob, min)) return *n;
  return whole_number(knob.fallback, std::numeric_limits<int64_t>::min()).value_or(0);
}

void set(const Knob& knob, const std::string& value, bool overwrite) {
  ::setenv(knob.name, value.c_str(), overwrite ? 1 : 0);
}

// ---- documentation ------------------------------------------------------------------------

namespace {

// `text` in lines of at most `width` columns, each after `indent` spaces.
std::string wrapped(const std::string& text, size_t indent, size_t width) {
  std::istringstream words(text);
  std::string out, line;
  for (std::string w; words >> w;) {
    if (!line.empty() && indent + line.size() + 1 + w.size() > width) {
      out += std::string(indent, ' ') + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + w;
  }
  if (!line.empty()) out += std::string(indent, ' ') + line + "\n";
  return out;
}

std::string default_text(const Knob& knob) { return *knob.fallback ? knob.fallback : "unset"; }

}  // namespace

std::string help_text() {
  std::string out =
      "Environment variables: tetra's own, then those of other tools that tetra reads (a few it sets, where\n"
      "it says). Under mpirun pass one to every rank with -x NAME=value; export it before srun or torchrun.\n";
  for (const bool own : {true, false}) {
    out += own ? "\ntetra's own\n" : "\nOther tools', which tetra reads\n";
    for (const Knob* k : knobs()) {
      if (k->own() != own) continue;
      // The names in a column, but for the few long ones (Open MPI's MCA parameters).
      const std::string name = k->name;
      out += "  " + name + std::string(name.size() < 30 ? 32 - name.size() : 2, ' ') + kind_name(k->kind);
      if (!own) out += std::string(", ") + k->tool + "'s";
      if (own || *k->fallback) out += ", default " + default_text(*k);
      out += "\n" + wrapped(k->what, 6, 100);
    }
  }
  return out;
}

std::string markdown() {
  std::string out = "tetra's own:\n\n| variable | type | default | what it does |\n|---|---|---|---|\n";
  for (const Knob* k : knobs())
    if (k->own())
      out += std::string("| `") + k->name + "` | " + kind_name(k->kind) + " | " + default_text(*k) + " | " + k->what +
             " |\n";
  out += "\nOther tools' variables that tetra reads (a few it sets, where it says):\n\n"
         "| variable | whose | type | default | what tetra does with it |\n|---|---|---|---|---|\n";
  for (const Knob* k : knobs())
    if (!k->own())
      out += std::string("| `") + k->name + "` | " + k->tool + " | " + kind_name(k->kind) + " | " + default_text(*k) +
             " | " + k->what + " |\n";
  return out;
}

}  // namespace tetra::env
