// The environment variables tetra reads, each declared once, and the one place they are
// read from.
//
// Note [Knobs declared once]
// Every variable tetra reads or sets, its own (TETRA_*) and other tools' (the launchers',
// Open MPI's, Slurm's, CUDA's, ...), is a Knob defined in env.cpp: its name, its kind, its
// default, what it does, and whose it is. The handles below name them; the accessors take
// a handle, never a string, and a Knob can be made in env.cpp alone (its Key is complete
// there only), so a variable that is read is a variable that is declared, and `train
// --help-env` and README's table (generated from knobs(), held to it by a test) list every
// one. The accessors keep each variable's old reading: text() treats set-but-empty as
// unset, get() tells them apart where that matters (CUDA_VISIBLE_DEVICES="" hides every
// GPU), integer() falls back to the default on a value that is not a whole number, as
// every forgiving reader did; a reader whose bad value is an error (the launch's
// variables, TETRA_MPI_POLL) says so itself, naming the variable. flag() takes 1, on or
// true, as TETRA_COLLECTIVES_CHECK always has, for every flag (the malloc flags took 1
// alone).
//
// The lowest layer holds it because hardware/ reads variables too (TETRA_HOSTNAME,
// CUDA_HOME); collectives, core and the tools include it from here.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace tetra::env {

enum class Kind {
  kFlag,     // 1, on or true; anything else is off
  kInteger,  // a whole decimal number
  kText,     // any text
  kPath,     // a file or folder
  kList,     // several values, with the separator the description gives
};
const char* kind_name(Kind kind);  // "flag", "integer", ...

class Knob {
 public:
  struct Key;  // complete in env.cpp alone: no other file can declare a knob
  constexpr Knob(const Key&, const char* name_, Kind kind_, const char* tool_, const char* fallback_,
                 const char* what_)
      : name(name_), kind(kind_), tool(tool_), fallback(fallback_), what(what_) {}
  Knob(const Knob&) = delete;  // a knob is its one declaration: passed by reference
  Knob& operator=(const Knob&) = delete;

  const char* const name;      // "TETRA_MONITOR_PORT"
  const Kind kind;
  const char* const tool;      // whose variable it is: "tetra", or "Open MPI", "Slurm", ...
  const char* const fallback;  // what an unset variable reads as ("" where nothing: unset)
  const char* const what;      // what it does, in a sentence or two
  bool own() const;            // tetra's own (tool "tetra")
};

// Every declared knob: tetra's own first, then the other tools', each tool's together.
const std::vector<const Knob*>& knobs();

// ---- reading and setting --------------------------------------------------------------

// The value as set; nullopt when unset (set to "" is ""), for the reads where setting a
// variable to nothing means something.
std::optional<std::string> get(const Knob& knob);
bool is_set(const Knob& knob);
// The value, or the knob's default when it is unset or empty.
std::string text(const Knob& knob);
// A flag: on when the value (else the default) is 1, on or true.
bool flag(const Knob& knob);
// An integer: the value when it is a whole decimal number >= min, else the default (0
// where the knob has none).
int64_t integer(const Knob& knob, int64_t min = std::numeric_limits<int64_t>::min());
// The same without the default: nullopt unless the value is a whole number >= min (for a
// reader that tries several variables in turn).
std::optional<int64_t> integer_value(const Knob& knob, int64_t min = std::numeric_limits<int64_t>::min());
// Sets it for this process and the processes it starts; with overwrite false, only where
// it is unset.
void set(const Knob& knob, const std::string& value, bool overwrite = true);

// ---- documentation --------------------------------------------------------------------

// `train --help-env`: every knob with its kind, default and what it does, tetra's own
// first, then the other tools'.
std::string help_text();
// The same as README's two Markdown tables (between its env-table markers).
std::string markdown();

// ---- the knobs (declared in env.cpp, in this order) -----------------------------------

// tetra's own
extern const Knob kJobSecret, kCollectivesCheck, kFlightRecorderDir, kFlightRecorderEntries, kMonitorAddr,
    kMonitorPort, kMpiPoll, kCalibration, kHostname, kRank, kWorldSize, kLocalRank, kLocalWorldSize, kNoReexec,
    kMallocDefaults, kMallocMmap, kFuzzWriteSeeds;
// torchrun
extern const Knob kTorchRank, kTorchWorldSize, kTorchLocalRank, kTorchLocalWorldSize, kMasterAddr, kMasterPort,
    kTorchelasticUseAgentStore, kTorchelasticRestartCount;
// Open MPI
extern const Knob kOmpiRank, kOmpiSize, kOmpiLocalRank, kOmpiLocalSize, kOmpiMappingPolicy, kOmpiBindingPolicy,
    kOmpiJobId, kOmpiIallreduceAlgorithm, kOmpiAllowRunAsRoot, kOmpiAllowRunAsRootConfirm;
// PMIx, PMI and MPICH
extern const Knob kPmixRank, kPmixNamespace, kPmixLocalSize, kPmiRank, kMpiLocalNRanks;
// Slurm
extern const Knob kSlurmProcId, kSlurmNTasks, kSlurmStepId, kSlurmStepNumTasks, kSlurmLocalId, kSlurmNodeId,
    kSlurmStepTasksPerNode, kSlurmNTasksPerNode, kSlurmTasksPerNode, kSlurmStepNumNodes, kSlurmNNodes,
    kSlurmStepNodeList, kSlurmJobNodeList, kSlurmJobId, kSlurmMpiType;
// Gloo, CUDA, OpenMP, BLIS, the shell
extern const Knob kGlooSocketIfname, kCudaVisibleDevices, kCudaHome, kCudaPath, kOmpWaitPolicy, kBlisNumThreads,
    kPath;

}  // namespace tetra::env
