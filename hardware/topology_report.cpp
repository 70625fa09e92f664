// The readable report of a Topology (hardware/topology.h: format_table, format_host,
// format_gpu_matrix, format_ranks): what `topo` prints.
#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "hardware/topology.h"

namespace tetra::hardware {

namespace {

std::string plural(int n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

std::string sharing(const HostTopology& h, const Cache& c) {
  int per_core = h.cores.empty() ? 1 : std::max(1, h.pus / h.core_count());
  if (c.pus_per_instance <= 0) return "";
  if (c.pus_per_instance == h.pus && h.pus > 1) return "shared by all " + std::to_string(h.pus) + " PUs";
  if (c.pus_per_instance == per_core) return "per core";
  for (const auto& p : h.packages)
    if (h.packages.size() > 1 && p.pus == c.pus_per_instance) return "per package";
  return "shared by " + std::to_string(c.pus_per_instance) + " PUs";
}

void put_cores(std::ostringstream& os, const HostTopology& h, const std::vector<const Core*>& cores,
               const std::string& indent) {
  if (cores.empty()) return;
  if (cores.size() <= 8) {
    for (const Core* c : cores) {
      auto pus = parse_cpu_list(c->pus);
      os << indent << "core " << c->index << ": " << (pus.size() == 1 ? "PU " : "PUs ") << c->pus << "\n";
    }
    return;
  }
  std::vector<int> idx, pus;
  for (const Core* c : cores) {
    idx.push_back(c->index);
    for (int p : parse_cpu_list(c->pus)) pus.push_back(p);
  }
  os << indent << "cores " << format_cpu_list(idx) << " (" << cores.size() << "), PUs " << format_cpu_list(pus);
  if (pus.size() % cores.size() == 0 && pus.size() > cores.size())
    os << " (" << pus.size() / cores.size() << " per core)";
  os << "\n";
}

// One cell of nvidia-smi's matrix: left-aligned in a tab stop of 8.
std::string cell(const std::string& s, size_t width = 8) {
  return s.size() >= width ? s + " " : s + std::string(width - s.size(), ' ');
}

}  // namespace

std::string format_gpu_matrix(const HostTopology& h) {
  if (h.gpus.empty()) return "";
  std::ostringstream os;
  size_t n = h.gpus.size();
  os << cell("");
  for (size_t j = 0; j < n; ++j) os << cell("GPU" + std::to_string(j));
  os << cell("CPU Affinity", 16) << "NUMA Affinity\n";
  for (size_t i = 0; i < n; ++i) {
    os << cell("GPU" + std::to_string(i));
    for (size_t j = 0; j < n; ++j) {
      std::string label = i < h.gpu_links.size() && j < h.gpu_links[i].size() ? h.gpu_links[i][j].label() : "?";
      os << cell(" " + label);
    }
    const Gpu& g = h.gpus[i];
    os << cell(g.cpu_affinity.empty() ? "N/A" : g.cpu_affinity, 16)
       << (g.numa_node < 0 ? std::string("N/A") : std::to_string(g.numa_node)) << "\n";
  }
  os << "\nLegend:\n\n"
     << "  X    = Self\n"
     << "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
     << "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n"
     << "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n"
     << "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n"
     << "  PIX  = Connection traversing at most a single PCIe bridge\n"
     << "  NV#  = Connection traversing a bonded set of # NVLinks\n";
  std::vector<std::string> p2p_yes, p2p_no;
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j) {
      bool yes = i < h.gpu_links.size() && j < h.gpu_links[i].size() && h.gpu_links[i][j].p2p;
      (yes ? p2p_yes : p2p_no).push_back("GPU" + std::to_string(i) + "-GPU" + std::to_string(j));
    }
  if (n > 1) {
    os << "\nPeer access:";
    if (p2p_no.empty())
      os << " all pairs\n";
    else if (p2p_yes.empty())
      os << " none\n";
    else {
      os << " yes";
      for (const auto& s : p2p_yes) os << " " << s;
      os << "; no";
      for (const auto& s : p2p_no) os << " " << s;
      os << "\n";
    }
  }
  return os.str();
}

std::string format_host(const HostTopology& h) {
  std::ostringstream os;
  os << "host " << h.hostname << ": " << plural(static_cast<int>(h.packages.size()), "package", "packages") << ", "
     << plural(static_cast<int>(h.numa_nodes.size()), "NUMA node", "NUMA nodes") << ", "
     << plural(h.core_count(), "core", "cores") << ", " << plural(h.pus, "PU", "PUs") << ", "
     << format_bytes(h.memory_bytes);
  if (!h.hwloc_version.empty()) os << " (hwloc " << h.hwloc_version << ")";
  os << "\n";
  if (!h.allowed_cpus.empty() && h.pus > 0 && static_cast<int>(parse_cpu_list(h.allowed_cpus).size()) != h.pus)
    os << "  allowed PUs (cgroup): " << h.allowed_cpus << "\n";

  auto numa_line = [&](const NumaNode& n, const std::string& indent) {
    os << indent << "NUMA " << n.os_index << ": " << format_bytes(n.memory_bytes);
    if (n.cpus.empty())
      os << ", no CPUs (memory only)";
    else
      os << ", PUs " << n.cpus;
    os << "\n";
    std::vector<const Core*> cores;
    for (const auto& c : h.cores)
      if (c.numa == n.index) cores.push_back(&c);
    put_cores(os, h, cores, indent + "  ");
  };
  for (const auto& p : h.packages) {
    os << "  package " << p.index << ": " << (p.model.empty() ? "" : p.model + ", ")
       << plural(p.cores, "core", "cores") << ", " << plural(p.pus, "PU", "PUs") << " (" << p.cpus << ")\n";
    for (const auto& n : h.numa_nodes)
      if (n.package == p.index) numa_line(n, "    ");
    std::vector<const Core*> loose;  // cores of this package in no NUMA node shown above
    for (const auto& c : h.cores) {
      if (c.package != p.index) continue;
      bool shown = false;
      for (const auto& n : h.numa_nodes) shown = shown || (n.index == c.numa && n.package == p.index);
      if (!shown) loose.push_back(&c);
    }
    put_cores(os, h, loose, "    ");
  }
  for (const auto& n : h.numa_nodes)  // nodes spanning packages, or with no CPUs
    if (n.package < 0 || n.package >= static_cast<int>(h.packages.size())) {
      os << "  NUMA " << n.os_index << " (" << (n.cpus.empty() ? "memory only" : "spans packages")
         << "): " << format_bytes(n.memory_bytes) << (n.cpus.empty() ? "" : ", PUs " + n.cpus) << "\n";
    }
  if (!h.caches.empty()) {
    os << "  caches:";
    bool first = true;
    for (const auto& c : h.caches) {
      os << (first ? " " : ", ") << c.name << " " << format_bytes(c.size_bytes) << " x" << c.instances;
      std::string s = sharing(h, c);
      if (!s.empty()) os << " (" << s << ")";
      first = false;
    }
    os << "\n";
  }
  os << "  CUDA: runtime " << (h.cuda_runtime.empty() ? "none" : h.cuda_runtime) << ", driver "
     << (h.cuda_driver.empty() ? "none" : h.cuda_driver);
  if (!h.driver_version.empty()) os << " (NVIDIA " << h.driver_version << ")";
  os << "\n";
  if (h.gpus.empty()) {
    os << "  GPUs: none (" << (h.gpu_status.empty() ? "not probed" : h.gpu_status) << ")\n";
  } else {
    os << "  GPUs:\n";
    for (const auto& g : h.gpus) {
      os << "    GPU" << g.index << ": " << (g.name.empty() ? "unknown" : g.name) << ", "
         << format_bytes(g.memory_bytes);
      if (g.compute_major > 0) os << ", sm_" << g.compute_major << g.compute_minor;
      if (!g.pci_bus_id.empty()) os << ", PCI " << g.pci_bus_id;
      os << ", NUMA " << (g.numa_node < 0 ? std::string("N/A") : std::to_string(g.numa_node)) << "\n";
    }
    std::istringstream matrix(format_gpu_matrix(h));
    std::string line;
    os << "\n";
    while (std::getline(matrix, line)) os << (line.empty() ? "" : "  " + line) << "\n";
  }
  for (const auto& w : h.warnings) os << "  warning: " << w << "\n";
  return os.str();
}

std::string format_ranks(const Topology& t) {
  std::ostringstream os;
  if (t.ranks.empty()) return "";
  os << "ranks: " << t.ranks_count() << " on " << plural(t.hosts_count(), "host", "hosts");
  if (t.hosts_count() > 0) {
    std::vector<std::string> per;
    for (const auto& h : t.hosts) per.push_back(std::to_string(t.ranks_on(h.hostname).size()) + " on " + h.hostname);
    os << " (";
    for (size_t i = 0; i < per.size(); ++i) os << (i ? ", " : "") << per[i];
    os << ")";
  }
  os << "\n";
  std::vector<std::vector<std::string>> rows = {{"rank", "host", "local", "cpus", "device"}};
  for (const auto& r : t.ranks)
    rows.push_back({std::to_string(r.rank), r.host, std::to_string(r.local_rank), r.cpus, r.device});
  std::vector<size_t> w(5, 0);
  for (const auto& row : rows)
    for (size_t c = 0; c < 5; ++c) w[c] = std::max(w[c], row[c].size());
  for (const auto& row : rows) {
    std::string line = " ";
    for (size_t c = 0; c < 5; ++c) line += " " + row[c] + (c + 1 < 5 ? std::string(w[c] - row[c].size() + 1, ' ') : "");
    os << line << "\n";
  }
  return os.str();
}

std::string format_table(const Topology& t) {
  std::ostringstream os;
  for (size_t i = 0; i < t.hosts.size(); ++i) os << (i ? "\n" : "") << format_host(t.hosts[i]);
  if (!t.ranks.empty()) os << "\n" << format_ranks(t);
  return os.str();
}

}  // namespace tetra::hardware
