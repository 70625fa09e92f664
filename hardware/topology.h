// hardware::Topology: what a job runs on, as a value.
//
// Note [Topology sources]
// The host part (packages, NUMA nodes, cores, PUs, caches) comes from hwloc. GPUs and
// the links between them come from NVML, loaded with dlopen("libnvidia-ml.so.1") so that
// the build never needs CUDA and a machine without the driver simply has no GPUs
// (gpu_status "no driver"). The CUDA runtime and driver versions come the same way from
// libcudart and libcuda (cudaRuntimeGetVersion, cuDriverGetVersion). Nothing here links
// a GPU library. When hwloc cannot load the topology, discover_host() returns a degraded
// host built from host.h (one package, one NUMA node, host_cores() cores) and says why
// in `warnings`; it never throws for that.
//
// A Topology is plain data: every field round-trips through to_json/topology_from_json
// exactly (integers and strings only), so ranks can serialise their view, gather it and
// merge it (collectives/topology_gather.h does that over a Communicator).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tetra::hardware {

struct Package {
  int index = 0;       // hwloc logical index
  std::string model;   // "AMD EPYC 9654 96-Core Processor" ("" when unknown)
  std::string cpus;    // OS indexes of its PUs, "0-31,64-95"
  int cores = 0;
  int pus = 0;
  bool operator==(const Package& o) const;
};

struct NumaNode {
  int index = 0;             // hwloc logical index
  int os_index = 0;          // the kernel's node number (numactl -N)
  int package = -1;          // the package holding all its PUs; -1 when it spans several or has none
  int64_t memory_bytes = 0;  // local memory
  std::string cpus;          // "" for a CPU-less (memory only) node
  bool operator==(const NumaNode& o) const;
};

struct Core {
  int index = 0;     // hwloc logical index
  int package = -1;  // Package::index
  int numa = -1;     // NumaNode::index; -1 when unknown
  std::string pus;   // OS indexes of its hardware threads, "0,64"
  bool operator==(const Core& o) const;
};

// One kind of cache: all instances of a level and type with the same size and sharing.
struct Cache {
  std::string name;         // "L1d", "L1i", "L2", "L3"
  int level = 0;
  int64_t size_bytes = 0;   // of one instance
  int line_bytes = 0;
  int instances = 0;        // on the host
  int pus_per_instance = 0; // sharing: 1 = private to a PU, 2 = per core with SMT2, ...
  bool operator==(const Cache& o) const;
};

struct Gpu {
  int index = 0;              // NVML index (CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID)
  std::string name;           // "NVIDIA H100 80GB HBM3"
  std::string uuid;
  std::string pci_bus_id;     // "00000000:3B:00.0", as NVML and nvidia-smi print it
  int64_t memory_bytes = 0;
  int compute_major = 0, compute_minor = 0;
  int numa_node = -1;         // from sysfs; -1 when the platform does not say
  std::string cpu_affinity;   // PUs close to it, "0-31"
  bool operator==(const Gpu& o) const;
};

// How two GPUs reach each other (nvidia-smi topo -m).
struct GpuLink {
  std::string pcie;  // "X" (self), "PIX", "PXB", "PHB", "NODE", "SYS", or "" when unknown
  int nvlinks = 0;   // bonded NVLinks between the pair (through NVSwitch: the links per GPU)
  bool p2p = false;  // peer access (NVML P2P read status OK)
  // What nvidia-smi prints: "X", "NV4", else the PCIe path.
  std::string label() const;
  bool operator==(const GpuLink& o) const;
};

struct HostTopology {
  std::string hostname;
  std::vector<Package> packages;
  std::vector<NumaNode> numa_nodes;
  std::vector<Core> cores;
  int pus = 0;                 // logical CPUs on the host
  std::string allowed_cpus;    // PUs this host lets processes use (cgroup cpuset), "0-1"
  std::vector<Cache> caches;   // by level, then type
  int64_t memory_bytes = 0;    // the OS's total (sysconf); NUMA nodes may report less in a VM
  std::vector<Gpu> gpus;
  std::vector<std::vector<GpuLink>> gpu_links;  // gpus.size() x gpus.size()
  std::string gpu_status;      // "no driver" | "ok" | "NVML: <why>"
  std::string driver_version;  // NVIDIA driver, "550.54.15" ("" without a driver)
  std::string cuda_driver;     // CUDA version the driver supports, "12.4" ("" = none)
  std::string cuda_runtime;    // libcudart found at run time, "13.0" ("" = none)
  std::string hwloc_version;   // "2.9.0" ("" when hwloc failed)
  std::vector<std::string> warnings;  // what could not be discovered, and why

  // cores.size(), or the packages' counts when a hand-written document lists no cores.
  int core_count() const;
  bool operator==(const HostTopology& o) const;
};

struct RankPlacement {
  int rank = 0;
  std::string host;       // HostTopology::hostname
  int local_rank = 0;     // -1 = unknown (assign_local_ranks fills it)
  std::string cpus;       // the rank's CPU affinity, "0-1"
  std::string device;     // "cpu" or "cuda:0" ("" = unknown, assign_local_ranks fills it)
  bool operator==(const RankPlacement& o) const;
};

struct Topology {
  std::vector<HostTopology> hosts;  // in order of their lowest rank
  std::vector<RankPlacement> ranks; // sorted by rank

  int hosts_count() const { return static_cast<int>(hosts.size()); }
  int ranks_count() const { return static_cast<int>(ranks.size()); }
  // nullptr when the host is not in the topology.
  const HostTopology* host(const std::string& hostname) const;
  // The host of `rank`; throws std::out_of_range when the rank is unknown.
  const HostTopology& host_of(int rank) const;
  // Ranks on `hostname`, ascending.
  std::vector<int> ranks_on(const std::string& hostname) const;
  // Largest number of ranks on any one host (0 when there are no ranks).
  int max_ranks_per_host() const;
  int total_cores() const;
  int total_gpus() const;
  bool operator==(const Topology& o) const;
};

// This host, from hwloc (+ NVML, libcudart, libcuda when present). Never throws for a
// missing or failing library: see Note [Topology sources].
HostTopology discover_host();

// What discover_host() returns when hwloc fails: host.h's view (one package, one NUMA
// node with all the memory, host_cores() cores of one PU each, no caches), `why` in warnings.
HostTopology degraded_host(const std::string& why);

// The CPUs the calling thread may run on (sched_getaffinity), "0-1".
std::string affinity_cpus();

// "cuda:<local_rank % gpus>" when the host has GPUs, else "cpu".
std::string default_device(const HostTopology& host, int local_rank);

// This process's view: its host and one placement. An empty device picks default_device.
Topology local_topology(int rank, int local_rank, const std::string& device = "");
Topology local_topology(const HostTopology& host, int rank, int local_rank,
                        const std::string& device = "");

// Compact JSON (indent < 0) or pretty-printed with `indent` spaces.
std::string to_json(const Topology& topology, int indent = -1);
std::string to_json(const HostTopology& host, int indent = -1);
// Inverse of to_json: topology_from_json(to_json(t)) == t. Throws std::invalid_argument
// naming the field when the document is not a topology.
Topology topology_from_json(const std::string& json);

// Combines per-rank documents (each usually one host and one rank, as local_topology
// makes): hosts deduplicated by hostname, in order of their lowest rank; ranks sorted.
// Two documents claiming the same rank are a std::invalid_argument. Then fills unknown
// local ranks and devices (assign_local_ranks).
Topology merge(const std::vector<std::string>& per_rank_json);
Topology merge(const std::vector<Topology>& parts);

// Local rank -1 becomes the rank's position among the ranks on its host; device "" becomes
// default_device.
void assign_local_ranks(Topology& topology);

// The readable report: per host a tree (package -> NUMA node (memory) -> cores/PUs) with
// its caches; then its GPUs and their link matrix in nvidia-smi topo -m's legend when it
// has GPUs; then the rank table.
std::string format_table(const Topology& topology);
std::string format_host(const HostTopology& host);
// Only the GPU matrix and legend ("" when the host has no GPUs).
std::string format_gpu_matrix(const HostTopology& host);
std::string format_ranks(const Topology& topology);

// CPU lists in the kernel's format: {0,1,2,5} <-> "0-2,5".
std::string format_cpu_list(const std::vector<int>& cpus);
std::vector<int> parse_cpu_list(const std::string& list);
// How format_bytes writes a size. Each output reads its own way and tests and tools read
// the text, so the styles stay as their callers had them; the unit arithmetic is written once.
enum class ByteDigits {
  kExact,  // "512 B", "1.5 KiB", "32 GiB": whole where the size is, else a tenth (hardware sizes)
  kWhole,  // "854 KiB", "312 MiB", "1.5 GiB": whole KiB and MiB, a tenth of a GiB, never B (messages)
  kThree,  // "512 B", "854 KiB", "1.67 MiB": three significant digits (tables whose rows differ by a few KiB)
};
// 1536 -> "1.5 KiB", 34359738368 -> "32 GiB" (kExact); the one formatter of sizes in bytes.
std::string format_bytes(int64_t bytes, ByteDigits digits = ByteDigits::kExact);

}  // namespace tetra::hardware
