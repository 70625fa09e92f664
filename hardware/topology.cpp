// hardware::Topology's discovery (Note [Topology sources]) and value semantics. Its JSON
// is topology_json.cpp's, its readable report topology_report.cpp's; the members of each
// struct are listed once, in topology_fields.h (Note [Topology fields]).
#include "hardware/topology.h"

#include <dlfcn.h>
#include <hwloc.h>
#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include "hardware/env.h"
#include "hardware/host.h"
#include "hardware/topology_fields.h"

namespace tetra::hardware {

// ---- value semantics ------------------------------------------------------------------

namespace {

// operator==: every member its struct lists (Note [Topology fields]).
template <typename S>
struct Equal {
  static constexpr bool kReads = false;
  const S& a;
  const S& b;
  bool same = true;
  template <typename T>
  void field(const char*, T S::*member) {
    same = same && a.*member == b.*member;
  }
};

template <typename S>
bool equal(const S& a, const S& b) {
  Equal<S> e{a, b};
  Fields<S>::declare(e);
  return e.same;
}

}  // namespace

bool Package::operator==(const Package& o) const { return equal(*this, o); }
bool NumaNode::operator==(const NumaNode& o) const { return equal(*this, o); }
bool Core::operator==(const Core& o) const { return equal(*this, o); }
bool Cache::operator==(const Cache& o) const { return equal(*this, o); }
bool Gpu::operator==(const Gpu& o) const { return equal(*this, o); }
bool GpuLink::operator==(const GpuLink& o) const { return equal(*this, o); }
std::string GpuLink::label() const {
  if (pcie == "X") return "X";
  if (nvlinks > 0) return "NV" + std::to_string(nvlinks);
  return pcie.empty() ? "?" : pcie;
}
bool HostTopology::operator==(const HostTopology& o) const { return equal(*this, o); }
int HostTopology::core_count() const {
  if (!cores.empty()) return static_cast<int>(cores.size());
  int n = 0;
  for (const auto& p : packages) n += p.cores;
  return n;
}
bool RankPlacement::operator==(const RankPlacement& o) const { return equal(*this, o); }
bool Topology::operator==(const Topology& o) const { return equal(*this, o); }

const HostTopology* Topology::host(const std::string& hostname) const {
  for (const auto& h : hosts)
    if (h.hostname == hostname) return &h;
  return nullptr;
}

const HostTopology& Topology::host_of(int rank) const {
  for (const auto& r : ranks)
    if (r.rank == rank) {
      if (const HostTopology* h = host(r.host)) return *h;
      throw std::out_of_range("topology: rank " + std::to_string(rank) + " is on host \"" + r.host +
                              "\", which the topology does not describe");
    }
  throw std::out_of_range("topology: no rank " + std::to_string(rank) + " (it has " +
                          std::to_string(ranks.size()) + ")");
}

std::vector<int> Topology::ranks_on(const std::string& hostname) const {
  std::vector<int> out;
  for (const auto& r : ranks)
    if (r.host == hostname) out.push_back(r.rank);
  std::sort(out.begin(), out.end());
  return out;
}

int Topology::max_ranks_per_host() const {
  std::map<std::string, int> n;
  int best = 0;
  for (const auto& r : ranks) best = std::max(best, ++n[r.host]);
  return best;
}

int Topology::total_cores() const {
  int n = 0;
  for (const auto& h : hosts) n += h.core_count();
  return n;
}

int Topology::total_gpus() const {
  int n = 0;
  for (const auto& h : hosts) n += static_cast<int>(h.gpus.size());
  return n;
}

// ---- small helpers --------------------------------------------------------------------

std::string format_cpu_list(const std::vector<int>& cpus_in) {
  std::vector<int> cpus = cpus_in;
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> parse_cpu_list(const std::string& list) {
  std::vector<int> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(std::remove_if(item.begin(), item.end(), [](unsigned char c) { return std::isspace(c); }),
               item.end());
    if (item.empty()) continue;
    auto bad = [&] { return std::invalid_argument("CPU list \"" + list + "\": \"" + item + "\" is not N or N-M"); };
    size_t dash = item.find('-');
    try {
      size_t used = 0;
      int a = std::stoi(item.substr(0, dash), &used);
      if (used != (dash == std::string::npos ? item.size() : dash) || a < 0) throw bad();
      int b = a;
      if (dash != std::string::npos) {
        std::string rest = item.substr(dash + 1);
        b = std::stoi(rest, &used);
        if (used != rest.size() || b < a) throw bad();
      }
      for (int c = a; c <= b; ++c) out.push_back(c);
    } catch (const std::invalid_argument&) {
      throw bad();
    } catch (const std::out_of_range&) {
      throw bad();
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string format_bytes(int64_t bytes, ByteDigits digits) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  // The units each style uses: kWhole never writes B ("0 KiB") nor beyond GiB ("2048.0 GiB").
  const int lowest = digits == ByteDigits::kWhole ? 1 : 0;
  const int highest = digits == ByteDigits::kWhole ? 3 : digits == ByteDigits::kThree ? 4 : 5;
  double v = static_cast<double>(bytes);
  int u = 0;
  while (u < highest && (u < lowest || v >= 1024.0)) {
    v /= 1024.0;  // a power of two: exact, as dividing by the unit at once
    ++u;
  }
  char buf[32];
  switch (digits) {
    case ByteDigits::kExact:
      if (u == 0 || v == static_cast<double>(static_cast<int64_t>(v)))
        std::snprintf(buf, sizeof(buf), "%lld %s", static_cast<long long>(v), units[u]);
      else
        std::snprintf(buf, sizeof(buf), "%.1f %s", v, units[u]);
      break;
    case ByteDigits::kWhole:
      std::snprintf(buf, sizeof(buf), u == 3 ? "%.1f %s" : "%.0f %s", v, units[u]);
      break;
    case ByteDigits::kThree:
      if (u == 0)
        std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
      else
        std::snprintf(buf, sizeof(buf), v >= 100 ? "%.0f %s" : v >= 10 ? "%.1f %s" : "%.2f %s", v, units[u]);
      break;
  }
  return buf;
}

std::string affinity_cpus() {
  const int max_cpus = 8192;
  cpu_set_t* set = CPU_ALLOC(max_cpus);
  if (!set) return "";
  size_t size = CPU_ALLOC_SIZE(max_cpus);
  CPU_ZERO_S(size, set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, size, set) == 0)
    for (int c = 0; c < max_cpus; ++c)
      if (CPU_ISSET_S(c, size, set)) cpus.push_back(c);
  CPU_FREE(set);
  return format_cpu_list(cpus);
}

std::string default_device(const HostTopology& host, int local_rank) {
  if (host.gpus.empty()) return "cpu";
  int n = static_cast<int>(host.gpus.size());
  return "cuda:" + std::to_string(((local_rank % n) + n) % n);
}

namespace {

std::string read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) return "";
  while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
  return line;
}

// CUDA's version integers: 12040 -> "12.4".
std::string cuda_version_string(int v) {
  if (v <= 0) return "";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

// ---- hwloc ----------------------------------------------------------------------------

std::string bitmap_list(hwloc_const_bitmap_t set) {
  if (!set) return "";
  char* s = nullptr;
  if (hwloc_bitmap_list_asprintf(&s, set) < 0 || !s) return "";
  std::string out = s;
  std::free(s);
  return out;
}

// Fills the CPU part of `host` from hwloc; returns "" or why it could not.
std::string discover_cpus_hwloc(HostTopology& host) {
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) != 0) return "hwloc_topology_init failed";
  // The whole host, not only this process's cgroup; the allowed part is recorded apart.
  hwloc_topology_set_flags(topo, HWLOC_TOPOLOGY_FLAG_INCLUDE_DISALLOWED);
  hwloc_topology_set_icache_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_ALL);  // L1i too
  if (hwloc_topology_load(topo) != 0) {
    hwloc_topology_destroy(topo);
    return "hwloc_topology_load failed";
  }
  struct Guard {
    hwloc_topology_t t;
    ~Guard() { hwloc_topology_destroy(t); }
  } guard{topo};

  hwloc_obj_t root = hwloc_get_root_obj(topo);
  // The library's release ("2.9.0"), which hwloc records on the root; the API version
  // (hwloc_get_api_version) stays the same across releases of a series.
  if (const char* v = hwloc_obj_get_info_by_name(root, "hwlocVersion")) {
    host.hwloc_version = v;
  } else {
    unsigned api = hwloc_get_api_version();
    host.hwloc_version = "API " + std::to_string(api >> 16) + "." + std::to_string((api >> 8) & 0xff);
  }
  host.pus = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
  if (host.pus <= 0) return "hwloc found no PUs";
  host.allowed_cpus = bitmap_list(hwloc_topology_get_allowed_cpuset(topo));
  // The OS's total (MemTotal). The NUMA nodes' own figures may sum to less: a virtual
  // machine's hot-plugged or ballooned memory is not always counted in a node.
  host.memory_bytes = total_memory_bytes();
  if (host.memory_bytes <= 0) host.memory_bytes = static_cast<int64_t>(root->total_memory);

  auto count_in = [&](hwloc_const_cpuset_t set, hwloc_obj_type_t type) {
    return hwloc_get_nbobjs_inside_cpuset_by_type(topo, set, type);
  };

  std::vector<hwloc_obj_t> pkg_objs;
  for (int i = 0, n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE); i < n; ++i)
    pkg_objs.push_back(hwloc_get_obj_by_type(topo, HWLOC_OBJ_PACKAGE, static_cast<unsigned>(i)));
  if (pkg_objs.empty()) {
    host.warnings.push_back("hwloc reports no package; the machine is shown as one");
    pkg_objs.push_back(root);
  }
  for (size_t i = 0; i < pkg_objs.size(); ++i) {
    hwloc_obj_t o = pkg_objs[i];
    Package p;
    p.index = static_cast<int>(i);
    const char* model = hwloc_obj_get_info_by_name(o, "CPUModel");
    if (!model && o != root) model = hwloc_obj_get_info_by_name(root, "CPUModel");
    // As the kernel and hwloc give it: padded ("Processor             ") or with runs of
    // spaces inside ("Intel(R) Xeon(R) CPU           E5-2690"); shown with single spaces.
    for (const char* c = model ? model : ""; *c; ++c)
      if (!std::isspace(static_cast<unsigned char>(*c)))
        p.model += *c;
      else if (!p.model.empty() && p.model.back() != ' ')
        p.model += ' ';
    if (!p.model.empty() && p.model.back() == ' ') p.model.pop_back();
    p.cpus = bitmap_list(o->cpuset);
    p.cores = count_in(o->cpuset, HWLOC_OBJ_CORE);
    p.pus = count_in(o->cpuset, HWLOC_OBJ_PU);
    host.packages.push_back(std::move(p));
  }
  auto package_of = [&](hwloc_const_cpuset_t set) {
    if (!set || hwloc_bitmap_iszero(set)) return -1;
    for (size_t i = 0; i < pkg_objs.size(); ++i)
      if (hwloc_bitmap_isincluded(set, pkg_objs[i]->cpuset)) return static_cast<int>(i);
    return -1;
  };

  std::vector<hwloc_obj_t> numa_objs;
  for (int i = 0, n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE); i < n; ++i)
    numa_objs.push_back(hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i)));
  for (size_t i = 0; i < numa_objs.size(); ++i) {
    hwloc_obj_t o = numa_objs[i];
    NumaNode node;
    node.index = static_cast<int>(i);
    node.os_index = static_cast<int>(o->os_index);
    node.memory_bytes = static_cast<int64_t>(o->attr->numanode.local_memory);
    node.cpus = bitmap_list(o->cpuset);
    node.package = package_of(o->cpuset);
    host.numa_nodes.push_back(std::move(node));
  }
  if (host.numa_nodes.empty()) {
    NumaNode node;
    node.memory_bytes = host.memory_bytes;
    node.cpus = bitmap_list(root->cpuset);
    node.package = host.packages.size() == 1 ? 0 : -1;
    host.numa_nodes.push_back(node);
    host.warnings.push_back("hwloc reports no NUMA node; the machine is shown as one");
  }
  auto numa_of = [&](hwloc_const_cpuset_t set) {
    for (size_t i = 0; i < numa_objs.size(); ++i)
      if (!hwloc_bitmap_iszero(numa_objs[i]->cpuset) && hwloc_bitmap_isincluded(set, numa_objs[i]->cpuset))
        return static_cast<int>(i);
    return numa_objs.empty() ? 0 : -1;
  };

  int ncores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  hwloc_obj_type_t core_type = HWLOC_OBJ_CORE;
  if (ncores <= 0) {  // some virtual machines expose PUs only
    host.warnings.push_back("hwloc reports no cores; each PU is counted as a core");
    core_type = HWLOC_OBJ_PU;
    ncores = host.pus;
  }
  for (int i = 0; i < ncores; ++i) {
    hwloc_obj_t o = hwloc_get_obj_by_type(topo, core_type, static_cast<unsigned>(i));
    Core c;
    c.index = i;
    c.package = package_of(o->cpuset);
    if (c.package < 0 && pkg_objs.size() == 1) c.package = 0;
    c.numa = numa_of(o->cpuset);
    c.pus = bitmap_list(o->cpuset);
    host.cores.push_back(std::move(c));
  }

  if (core_type == HWLOC_OBJ_PU)  // the packages' core counts follow the PU-as-core fallback
    for (auto& p : host.packages)
      p.cores = static_cast<int>(std::count_if(host.cores.begin(), host.cores.end(),
                                               [&](const Core& c) { return c.package == p.index; }));
  if (host.numa_nodes.size() == 1 && host.numa_nodes[0].memory_bytes <= 0)
    host.numa_nodes[0].memory_bytes = host.memory_bytes;  // a backend that does not read node memory

  // Caches: one entry per (name, size, line, sharing), by level then L1d before L1i.
  struct Key {
    int level;
    int kind;  // 0 data, 1 instruction, 2 unified
    int64_t size;
    int line;
    int share;
    bool operator<(const Key& o) const {
      return std::tie(level, kind, size, line, share) < std::tie(o.level, o.kind, o.size, o.line, o.share);
    }
  };
  std::map<Key, int> caches;
  const hwloc_obj_type_t cache_types[] = {HWLOC_OBJ_L1CACHE,  HWLOC_OBJ_L1ICACHE, HWLOC_OBJ_L2CACHE,
                                          HWLOC_OBJ_L2ICACHE, HWLOC_OBJ_L3CACHE,  HWLOC_OBJ_L3ICACHE,
                                          HWLOC_OBJ_L4CACHE,  HWLOC_OBJ_L5CACHE};
  for (hwloc_obj_type_t t : cache_types) {
    for (int i = 0, n = hwloc_get_nbobjs_by_type(topo, t); i < n; ++i) {
      hwloc_obj_t o = hwloc_get_obj_by_type(topo, t, static_cast<unsigned>(i));
      const auto& a = o->attr->cache;
      int kind = a.type == HWLOC_OBJ_CACHE_DATA ? 0 : a.type == HWLOC_OBJ_CACHE_INSTRUCTION ? 1 : 2;
      Key k{static_cast<int>(a.depth), kind, static_cast<int64_t>(a.size), static_cast<int>(a.linesize),
            hwloc_bitmap_weight(o->cpuset)};
      ++caches[k];
    }
  }
  for (const auto& [k, n] : caches) {
    Cache c;
    c.level = k.level;
    c.name = "L" + std::to_string(k.level) + (k.kind == 0 ? "d" : k.kind == 1 ? "i" : "");
    c.size_bytes = k.size;
    c.line_bytes = k.line;
    c.instances = n;
    c.pus_per_instance = k.share;
    host.caches.push_back(std::move(c));
  }
  return "";
}

}  // namespace

// What host.h knows, when hwloc does not.
static void degraded_cpus(HostTopology& host) {
  int n = host_cores();
  std::vector<int> all(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) all[static_cast<size_t>(i)] = i;
  std::string cpus = format_cpu_list(all);
  host.packages = {Package{0, "", cpus, n, n}};
  host.memory_bytes = total_memory_bytes();
  host.numa_nodes = {NumaNode{0, 0, 0, host.memory_bytes, cpus}};
  host.cores.clear();
  for (int i = 0; i < n; ++i) host.cores.push_back(Core{i, 0, 0, std::to_string(i)});
  host.pus = n;
  host.allowed_cpus = cpus;
  host.caches.clear();
  host.warnings.push_back("each logical CPU is counted as a core, one package, one NUMA node");
}

HostTopology degraded_host(const std::string& why) {
  HostTopology host;
  host.hostname = hostname();
  host.warnings.push_back("hwloc: " + why + "; showing what the OS reports");
  degraded_cpus(host);
  return host;
}

namespace {

// ---- NVML, libcudart, libcuda (dlopen; see Note [Topology sources]) ------------------

using nvmlReturn_t = int;
struct nvmlDevice_st;
using nvmlDevice_t = nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr nvmlReturn_t kNvmlDriverNotLoaded = 9;
struct NvmlPciInfo {  // nvmlPciInfo_t
  char busIdLegacy[16];
  unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
};
struct NvmlMemory {  // nvmlMemory_t
  unsigned long long total, free, used;
};
// nvmlGpuTopologyLevel_t
const std::map<int, std::string> kTopologyLevel = {
    {0, "PIX"}, {10, "PIX"}, {20, "PXB"}, {30, "PHB"}, {40, "NODE"}, {50, "SYS"}};
constexpr int kNvlinkDeviceSwitch = 2;  // nvmlIntNvLinkDeviceType_t
constexpr unsigned kNvlinkMaxLinks = 18;

struct Nvml {
  void* lib = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  const char* (*error_string)(nvmlReturn_t) = nullptr;
  nvmlReturn_t (*driver_version)(char*, unsigned) = nullptr;
  nvmlReturn_t (*cuda_driver_version)(int*) = nullptr;
  nvmlReturn_t (*count)(unsigned*) = nullptr;
  nvmlReturn_t (*handle)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*name)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*uuid)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*pci)(nvmlDevice_t, NvmlPciInfo*) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, NvmlMemory*) = nullptr;
  nvmlReturn_t (*capability)(nvmlDevice_t, int*, int*) = nullptr;
  nvmlReturn_t (*common_ancestor)(nvmlDevice_t, nvmlDevice_t, int*) = nullptr;
  nvmlReturn_t (*p2p)(nvmlDevice_t, nvmlDevice_t, int, int*) = nullptr;
  nvmlReturn_t (*nvlink_state)(nvmlDevice_t, unsigned, int*) = nullptr;
  nvmlReturn_t (*nvlink_remote_pci)(nvmlDevice_t, unsigned, NvmlPciInfo*) = nullptr;
  nvmlReturn_t (*nvlink_remote_type)(nvmlDevice_t, unsigned, int*) = nullptr;

  template <typename F>
  void sym(F& f, const char* name, const char* fallback = nullptr) {
    void* p = dlsym(lib, name);
    if (!p && fallback) p = dlsym(lib, fallback);
    f = reinterpret_cast<F>(p);
  }
  std::string err(nvmlReturn_t r) const {
    const char* s = error_string ? error_string(r) : nullptr;
    return s ? s : "error " + std::to_string(r);
  }
};

// "00000000:3B:00.0" / "0000:3b:00.0" -> "0000:3b:00.0" (sysfs's spelling), "" if unparsable.
std::string sysfs_bus_id(const std::string& id) {
  unsigned dom = 0, bus = 0, dev = 0, fn = 0;
  if (std::sscanf(id.c_str(), "%x:%x:%x.%x", &dom, &bus, &dev, &fn) != 4) return "";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%04x:%02x:%02x.%x", dom & 0xffff, bus, dev, fn);
  return buf;
}

void discover_gpus(HostTopology& host) {
  Nvml n;
  n.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!n.lib) {
    host.gpu_status = "no driver";
    return;
  }
  n.sym(n.init, "nvmlInit_v2", "nvmlInit");
  n.sym(n.shutdown, "nvmlShutdown");
  n.sym(n.error_string, "nvmlErrorString");
  n.sym(n.driver_version, "nvmlSystemGetDriverVersion");
  n.sym(n.cuda_driver_version, "nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion");
  n.sym(n.count, "nvmlDeviceGetCount_v2", "nvmlDeviceGetCount");
  n.sym(n.handle, "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex");
  n.sym(n.name, "nvmlDeviceGetName");
  n.sym(n.uuid, "nvmlDeviceGetUUID");
  n.sym(n.pci, "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo_v2");
  n.sym(n.memory, "nvmlDeviceGetMemoryInfo");
  n.sym(n.capability, "nvmlDeviceGetCudaComputeCapability");
  n.sym(n.common_ancestor, "nvmlDeviceGetTopologyCommonAncestor");
  n.sym(n.p2p, "nvmlDeviceGetP2PStatus");
  n.sym(n.nvlink_state, "nvmlDeviceGetNvLinkState");
  n.sym(n.nvlink_remote_pci, "nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetNvLinkRemotePciInfo");
  n.sym(n.nvlink_remote_type, "nvmlDeviceGetNvLinkRemoteDeviceType");
  if (!n.init || !n.shutdown || !n.count || !n.handle) {
    host.gpu_status = "NVML: libnvidia-ml.so.1 lacks nvmlInit/nvmlDeviceGetCount";
    dlclose(n.lib);
    return;
  }
  if (nvmlReturn_t r = n.init(); r != kNvmlSuccess) {
    host.gpu_status = (r == kNvmlDriverNotLoaded ? "no driver (NVML: " : "NVML: nvmlInit: ") + n.err(r) +
                      (r == kNvmlDriverNotLoaded ? ")" : "");
    dlclose(n.lib);
    return;
  }
  char buf[128];
  if (n.driver_version && n.driver_version(buf, sizeof(buf)) == kNvmlSuccess) host.driver_version = buf;
  int cv = 0;
  if (n.cuda_driver_version && n.cuda_driver_version(&cv) == kNvmlSuccess)
    host.cuda_driver = cuda_version_string(cv);

  unsigned count = 0;
  if (nvmlReturn_t r = n.count(&count); r != kNvmlSuccess) {
    host.gpu_status = "NVML: nvmlDeviceGetCount: " + n.err(r);
    n.shutdown();
    dlclose(n.lib);
    return;
  }
  std::vector<nvmlDevice_t> devs;
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t d = nullptr;
    if (nvmlReturn_t r = n.handle(i, &d); r != kNvmlSuccess) {
      host.warnings.push_back("NVML: GPU " + std::to_string(i) + ": " + n.err(r));
      continue;
    }
    Gpu g;
    g.index = static_cast<int>(i);
    if (n.name && n.name(d, buf, sizeof(buf)) == kNvmlSuccess) g.name = buf;
    if (n.uuid && n.uuid(d, buf, sizeof(buf)) == kNvmlSuccess) g.uuid = buf;
    NvmlPciInfo pci{};
    if (n.pci && n.pci(d, &pci) == kNvmlSuccess) g.pci_bus_id = pci.busId;
    NvmlMemory mem{};
    if (n.memory && n.memory(d, &mem) == kNvmlSuccess) g.memory_bytes = static_cast<int64_t>(mem.total);
    if (n.capability) n.capability(d, &g.compute_major, &g.compute_minor);
    if (std::string id = sysfs_bus_id(g.pci_bus_id); !id.empty()) {
      std::string dir = "/sys/bus/pci/devices/" + id + "/";
      std::string numa = read_first_line(dir + "numa_node");
      if (!numa.empty()) g.numa_node = std::atoi(numa.c_str());
      if (g.numa_node < 0) g.numa_node = -1;
      g.cpu_affinity = read_first_line(dir + "local_cpulist");
    }
    host.gpus.push_back(std::move(g));
    devs.push_back(d);
  }

  // NVLinks: direct GPU-GPU links, and links into NVSwitches (every GPU on the switch
  // fabric reaches every other one through them).
  size_t g = devs.size();
  std::vector<std::vector<int>> direct(g, std::vector<int>(g, 0));
  std::vector<int> to_switch(g, 0);
  if (n.nvlink_state) {
    for (size_t i = 0; i < g; ++i) {
      for (unsigned l = 0; l < kNvlinkMaxLinks; ++l) {
        int active = 0;
        if (n.nvlink_state(devs[i], l, &active) != kNvmlSuccess || !active) continue;
        int type = -1;
        if (n.nvlink_remote_type && n.nvlink_remote_type(devs[i], l, &type) == kNvmlSuccess &&
            type == kNvlinkDeviceSwitch) {
          ++to_switch[i];
          continue;
        }
        NvmlPciInfo remote{};
        if (!n.nvlink_remote_pci || n.nvlink_remote_pci(devs[i], l, &remote) != kNvmlSuccess) continue;
        std::string rid = sysfs_bus_id(remote.busId);
        bool found = false;
        for (size_t j = 0; j < g; ++j)
          if (j != i && !rid.empty() && sysfs_bus_id(host.gpus[j].pci_bus_id) == rid) {
            ++direct[i][j];
            found = true;
          }
        if (!found && type != 0) ++to_switch[i];  // not a GPU we know: a switch (older NVML)
      }
    }
  }
  host.gpu_links.assign(g, std::vector<GpuLink>(g));
  for (size_t i = 0; i < g; ++i) {
    for (size_t j = 0; j < g; ++j) {
      GpuLink& link = host.gpu_links[i][j];
      if (i == j) {
        link.pcie = "X";
        continue;
      }
      int level = -1;
      if (n.common_ancestor && n.common_ancestor(devs[i], devs[j], &level) == kNvmlSuccess) {
        auto it = kTopologyLevel.find(level);
        link.pcie = it == kTopologyLevel.end() ? "" : it->second;
      }
      link.nvlinks = direct[i][j];
      if (to_switch[i] > 0 && to_switch[j] > 0) link.nvlinks += std::min(to_switch[i], to_switch[j]);
      int status = -1;
      link.p2p = n.p2p && n.p2p(devs[i], devs[j], /*NVML_P2P_CAPS_INDEX_READ*/ 0, &status) == kNvmlSuccess &&
                 status == 0;
    }
  }
  host.gpu_status = host.gpus.empty() ? "no GPU" : "ok";
  n.shutdown();
  dlclose(n.lib);
}

// Versions from the CUDA runtime and driver libraries, when this machine has them. The
// libraries stay loaded (unloading libcudart is not safe once anything initialised it).
void discover_cuda_versions(HostTopology& host) {
  std::vector<std::string> runtimes = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"};
  for (const env::Knob* home : {&env::kCudaHome, &env::kCudaPath})
    if (const std::string dir = env::text(*home); !dir.empty()) runtimes.push_back(dir + "/lib64/libcudart.so");
  runtimes.push_back("/usr/local/cuda/lib64/libcudart.so");
  for (const auto& name : runtimes) {
    void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) continue;
    using Fn = int (*)(int*);
    auto fn = reinterpret_cast<Fn>(dlsym(lib, "cudaRuntimeGetVersion"));
    int v = 0;
    if (fn && fn(&v) == 0 && v > 0) {
      host.cuda_runtime = cuda_version_string(v);
      break;
    }
  }
  // libcuda.so.1 only: the unversioned name may be the toolkit's stub, which has no driver.
  if (void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) {
    using Fn = int (*)(int*);
    auto fn = reinterpret_cast<Fn>(dlsym(lib, "cuDriverGetVersion"));
    int v = 0;
    if (fn && fn(&v) == 0 && v > 0 && host.cuda_driver.empty()) host.cuda_driver = cuda_version_string(v);
  }
}

}  // namespace

// ---- discovery ------------------------------------------------------------------------

HostTopology discover_host() {
  HostTopology host;
  host.hostname = hostname();
  std::string why;
  try {
    why = discover_cpus_hwloc(host);
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (!why.empty()) host = degraded_host(why);
  if (host.memory_bytes <= 0) host.memory_bytes = total_memory_bytes();
  discover_gpus(host);
  discover_cuda_versions(host);
  return host;
}

Topology local_topology(const HostTopology& host, int rank, int local_rank, const std::string& device) {
  Topology t;
  t.hosts.push_back(host);
  RankPlacement p;
  p.rank = rank;
  p.host = host.hostname;
  p.local_rank = local_rank;
  p.cpus = affinity_cpus();
  p.device = device.empty() ? (local_rank >= 0 ? default_device(host, local_rank) : "") : device;
  t.ranks.push_back(std::move(p));
  return t;
}

Topology local_topology(int rank, int local_rank, const std::string& device) {
  return local_topology(discover_host(), rank, local_rank, device);
}

void assign_local_ranks(Topology& t) {
  std::map<std::string, int> next;
  for (auto& r : t.ranks) {  // sorted by rank
    int ordinal = next[r.host]++;
    if (r.local_rank < 0) r.local_rank = ordinal;
    if (r.device.empty()) {
      const HostTopology* h = t.host(r.host);
      r.device = h ? default_device(*h, r.local_rank) : "cpu";
    }
  }
}

Topology merge(const std::vector<Topology>& parts) {
  Topology out;
  std::map<int, std::pair<RankPlacement, size_t>> ranks;  // rank -> placement, part
  std::map<std::string, HostTopology> hosts;
  for (size_t i = 0; i < parts.size(); ++i) {
    for (const auto& h : parts[i].hosts)
      hosts.emplace(h.hostname, h);  // the first description of a host wins
    for (const auto& r : parts[i].ranks) {
      if (auto it = ranks.find(r.rank); it != ranks.end())
        throw std::invalid_argument("topology merge: rank " + std::to_string(r.rank) + " appears in part " +
                                    std::to_string(it->second.second) + " and in part " + std::to_string(i));
      if (!parts[i].host(r.host))
        throw std::invalid_argument("topology merge: part " + std::to_string(i) + " places rank " +
                                    std::to_string(r.rank) + " on host \"" + r.host +
                                    "\" but does not describe that host");
      ranks.emplace(r.rank, std::make_pair(r, i));
    }
  }
  std::set<std::string> placed;
  for (const auto& [rank, rp] : ranks) {
    out.ranks.push_back(rp.first);
    if (placed.insert(rp.first.host).second) out.hosts.push_back(hosts.at(rp.first.host));
  }
  for (const auto& part : parts)  // hosts that no rank runs on keep their order, last
    for (const auto& h : part.hosts)
      if (placed.insert(h.hostname).second) out.hosts.push_back(h);
  assign_local_ranks(out);
  return out;
}

}  // namespace tetra::hardware
