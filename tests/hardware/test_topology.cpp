#include "hardware/topology.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "hardware/host.h"

namespace hw = tetra::hardware;

namespace {

// Distinct (package, core) pairs the kernel reports for the online CPUs: an independent
// count of physical cores (0 when sysfs does not say).
int sysfs_cores() {
  std::set<std::pair<int, int>> cores;
  for (int cpu : hw::parse_cpu_list([] {
         std::ifstream f("/sys/devices/system/cpu/online");
         std::string s;
         std::getline(f, s);
         return s;
       }())) {
    std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    std::ifstream pkg(dir + "physical_package_id"), core(dir + "core_id");
    int p = -1, c = -1;
    if (!(pkg >> p) || !(core >> c)) return 0;
    cores.insert({p, c});
  }
  return static_cast<int>(cores.size());
}

hw::HostTopology fake_host(const std::string& name, int cores) {
  hw::HostTopology h;
  h.hostname = name;
  std::vector<int> all;
  for (int i = 0; i < cores; ++i) all.push_back(i);
  std::string cpus = hw::format_cpu_list(all);
  h.packages = {hw::Package{0, "Fake CPU", cpus, cores, cores}};
  h.numa_nodes = {hw::NumaNode{0, 0, 0, int64_t{16} << 30, cpus}};
  for (int i = 0; i < cores; ++i) h.cores.push_back(hw::Core{i, 0, 0, std::to_string(i)});
  h.pus = cores;
  h.allowed_cpus = cpus;
  h.caches = {hw::Cache{"L1d", 1, 48 << 10, 64, cores, 1}, hw::Cache{"L3", 3, 32 << 20, 64, 1, cores}};
  h.memory_bytes = int64_t{16} << 30;
  h.gpu_status = "no driver";
  return h;
}

}  // namespace

TEST(Topology, DiscoverHostMatchesTheOs) {
  hw::HostTopology h = hw::discover_host();
  EXPECT_EQ(h.hostname, hw::hostname());
  ASSERT_GE(h.packages.size(), 1u);
  ASSERT_GE(h.numa_nodes.size(), 1u);
  ASSERT_GE(h.core_count(), 1);
  EXPECT_EQ(h.pus, hw::host_cores());
  EXPECT_EQ(h.pus, static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  EXPECT_LE(h.core_count(), h.pus);
  EXPECT_EQ(h.pus % h.core_count(), 0) << "PUs per core should be uniform here";
  if (int n = sysfs_cores(); n > 0) {
    EXPECT_EQ(h.core_count(), n);
  }
  EXPECT_TRUE(h.warnings.empty()) << h.warnings.front();
  EXPECT_FALSE(h.hwloc_version.empty());

  int pkg_cores = 0, pkg_pus = 0;
  for (const auto& p : h.packages) {
    pkg_cores += p.cores;
    pkg_pus += p.pus;
  }
  EXPECT_EQ(pkg_cores, h.core_count());
  EXPECT_EQ(pkg_pus, h.pus);
  int64_t numa_mem = 0;
  for (const auto& n : h.numa_nodes) {
    EXPECT_GT(n.memory_bytes, 0);
    numa_mem += n.memory_bytes;
  }
  // The host's memory is the OS's total; the nodes' own figures (what hwloc reads from
  // /sys/devices/system/node) can sum to less on a virtual machine, never to more.
  EXPECT_EQ(h.memory_bytes, hw::total_memory_bytes());
  EXPECT_LE(numa_mem, h.memory_bytes + (int64_t{64} << 20));
  std::set<int> pus;
  for (const auto& c : h.cores) {
    EXPECT_GE(c.package, 0);
    EXPECT_GE(c.numa, 0);
    for (int p : hw::parse_cpu_list(c.pus)) EXPECT_TRUE(pus.insert(p).second) << "PU " << p << " in two cores";
  }
  EXPECT_EQ(static_cast<int>(pus.size()), h.pus);
  EXPECT_EQ(hw::parse_cpu_list(h.allowed_cpus).size() > 0, true);
}

// Issue 33, item 7: `topo` showed "Oxide Virtual Turin-like Processor             , 2 cores":
// the CPU's name as the kernel pads it. Names are shown trimmed, with single spaces.
TEST(Topology, PackageNamesHaveNoPaddingOrRunsOfSpaces) {
  for (const hw::Package& p : hw::discover_host().packages) {
    if (p.model.empty()) continue;
    EXPECT_NE(p.model.front(), ' ') << "'" << p.model << "'";
    EXPECT_NE(p.model.back(), ' ') << "'" << p.model << "'";
    EXPECT_EQ(p.model.find("  "), std::string::npos) << "'" << p.model << "'";
  }
}

TEST(Topology, CachesArePlausible) {
  hw::HostTopology h = hw::discover_host();
  if (h.caches.empty()) GTEST_SKIP() << "hwloc reports no caches on this machine";
  int last_level = 0;
  for (const auto& c : h.caches) {
    EXPECT_GE(c.level, 1);
    EXPECT_LE(c.level, 5);
    EXPECT_GE(c.level, last_level) << "caches are listed by level";
    last_level = c.level;
    EXPECT_GE(c.size_bytes, 1 << 10) << c.name;
    EXPECT_LE(c.size_bytes, int64_t{4} << 30) << c.name;
    EXPECT_GE(c.instances, 1);
    EXPECT_GE(c.pus_per_instance, 1);
    EXPECT_LE(c.pus_per_instance, h.pus);
    EXPECT_LE(c.instances * c.pus_per_instance, h.pus) << c.name;
    if (c.line_bytes) {
      EXPECT_TRUE(c.line_bytes == 32 || c.line_bytes == 64 || c.line_bytes == 128 || c.line_bytes == 256);
    }
    EXPECT_EQ(c.name.substr(0, 2), "L" + std::to_string(c.level));
  }
}

TEST(Topology, DegradedHostUsesWhatTheOsSays) {
  hw::HostTopology h = hw::degraded_host("hwloc_topology_load failed");
  EXPECT_EQ(h.hostname, hw::hostname());
  ASSERT_EQ(h.packages.size(), 1u);
  ASSERT_EQ(h.numa_nodes.size(), 1u);
  EXPECT_EQ(h.pus, hw::host_cores());
  EXPECT_EQ(h.core_count(), hw::host_cores());
  EXPECT_EQ(h.memory_bytes, hw::total_memory_bytes());
  EXPECT_EQ(h.numa_nodes[0].memory_bytes, h.memory_bytes);
  ASSERT_FALSE(h.warnings.empty());
  EXPECT_NE(h.warnings[0].find("hwloc_topology_load failed"), std::string::npos);
  hw::Topology t = hw::local_topology(h, 0, 0);
  EXPECT_EQ(hw::topology_from_json(hw::to_json(t)), t);
  EXPECT_NE(hw::format_table(t).find("warning: hwloc: hwloc_topology_load failed"), std::string::npos);
}

TEST(Topology, NoDriverMeansNoGpus) {
  hw::HostTopology h = hw::discover_host();
  if (!h.gpus.empty()) GTEST_SKIP() << "this machine has GPUs";
  EXPECT_TRUE(h.gpu_links.empty());
  EXPECT_FALSE(h.gpu_status.empty());
  EXPECT_EQ(hw::format_gpu_matrix(h), "");
}

TEST(Topology, CpuLists) {
  EXPECT_EQ(hw::format_cpu_list({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
  EXPECT_EQ(hw::format_cpu_list({}), "");
  EXPECT_EQ(hw::format_cpu_list({3, 1, 2, 2}), "1-3");
  EXPECT_EQ(hw::parse_cpu_list("0-2,5,7-8"), (std::vector<int>{0, 1, 2, 5, 7, 8}));
  EXPECT_EQ(hw::parse_cpu_list(""), std::vector<int>{});
  EXPECT_THROW(hw::parse_cpu_list("1-x"), std::invalid_argument);
  EXPECT_THROW(hw::parse_cpu_list("3-1"), std::invalid_argument);
  EXPECT_FALSE(hw::affinity_cpus().empty());
  EXPECT_EQ(static_cast<int>(hw::parse_cpu_list(hw::affinity_cpus()).size()), hw::usable_cores());
}

TEST(Topology, FormatBytes) {
  EXPECT_EQ(hw::format_bytes(512), "512 B");
  EXPECT_EQ(hw::format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(hw::format_bytes(int64_t{32} << 30), "32 GiB");
}

// The styles the other outputs write (messages and progress lines; the plan's tables), kept
// as they were when each had its own function.
TEST(Topology, FormatBytesStyles) {
  using hw::ByteDigits;
  EXPECT_EQ(hw::format_bytes(512, ByteDigits::kWhole), "0 KiB");
  EXPECT_EQ(hw::format_bytes(1751122, ByteDigits::kWhole), "2 MiB");
  EXPECT_EQ(hw::format_bytes(int64_t{3} << 29, ByteDigits::kWhole), "1.5 GiB");
  EXPECT_EQ(hw::format_bytes(int64_t{2} << 40, ByteDigits::kWhole), "2048.0 GiB");
  EXPECT_EQ(hw::format_bytes(512, ByteDigits::kThree), "512 B");
  EXPECT_EQ(hw::format_bytes(12800, ByteDigits::kThree), "12.5 KiB");
  EXPECT_EQ(hw::format_bytes(1751122, ByteDigits::kThree), "1.67 MiB");
  EXPECT_EQ(hw::format_bytes(874496, ByteDigits::kThree), "854 KiB");
  EXPECT_EQ(hw::format_bytes(int64_t{2} << 40, ByteDigits::kThree), "2.00 TiB");
}

TEST(Topology, JsonRoundTripIsExact) {
  hw::Topology t = hw::local_topology(0, 0);
  ASSERT_EQ(t.hosts.size(), 1u);
  ASSERT_EQ(t.ranks.size(), 1u);
  EXPECT_EQ(t.ranks[0].device, t.hosts[0].gpus.empty() ? "cpu" : "cuda:0");
  EXPECT_EQ(t.ranks[0].cpus, hw::affinity_cpus());
  std::string json = hw::to_json(t);
  hw::Topology back = hw::topology_from_json(json);
  EXPECT_EQ(back, t);
  EXPECT_EQ(hw::to_json(back), json);
  EXPECT_EQ(hw::topology_from_json(hw::to_json(t, 2)), t);

  // Every field survives, including the GPU ones discovery leaves empty here.
  hw::Topology f;
  f.hosts.push_back(fake_host("a", 2));
  f.hosts[0].gpus = {hw::Gpu{0, "Fake GPU", "GPU-1", "00000000:3B:00.0", int64_t{80} << 30, 9, 0, 1, "0-1"}};
  f.hosts[0].gpu_links = {{hw::GpuLink{"X", 0, false}}};
  f.hosts[0].warnings = {"a \"quoted\" warning"};
  f.hosts[0].cuda_runtime = "13.0";
  f.ranks = {hw::RankPlacement{0, "a", 0, "0-1", "cuda:0"}};
  EXPECT_EQ(hw::topology_from_json(hw::to_json(f)), f);
}

TEST(Topology, BadJsonIsAClearError) {
  EXPECT_THROW(hw::topology_from_json("not json"), std::invalid_argument);
  EXPECT_THROW(hw::topology_from_json("[]"), std::invalid_argument);
  EXPECT_THROW(hw::topology_from_json("{}"), std::invalid_argument);
  try {
    hw::topology_from_json(R"({"hosts": [{"hostname": "a", "pus": "many"}]})");
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("hosts[0].pus"), std::string::npos) << e.what();
  }
  // The link matrix must be square in the GPUs.
  EXPECT_THROW(hw::topology_from_json(R"({"hosts": [{"hostname": "a", "gpus": [{"index": 0}], "gpu_links": []}]})"),
               std::invalid_argument);
}

TEST(Topology, MergeDeduplicatesHostsAndSortsRanks) {
  // Two hosts with two ranks each, arriving out of order, local ranks left for merge.
  std::vector<std::string> parts;
  for (int rank : {3, 0, 2, 1}) {
    std::string host = rank < 2 ? "node-a" : "node-b";
    hw::Topology t;
    t.hosts.push_back(fake_host(host, 4));
    t.ranks.push_back(hw::RankPlacement{rank, host, -1, std::to_string(rank % 2 * 2) + "-" + std::to_string(rank % 2 * 2 + 1), ""});
    parts.push_back(hw::to_json(t));
  }
  hw::Topology m = hw::merge(parts);
  ASSERT_EQ(m.hosts_count(), 2);
  EXPECT_EQ(m.hosts[0].hostname, "node-a");
  EXPECT_EQ(m.hosts[1].hostname, "node-b");
  ASSERT_EQ(m.ranks_count(), 4);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(m.ranks[r].rank, r);
    EXPECT_EQ(m.ranks[r].host, r < 2 ? "node-a" : "node-b");
    EXPECT_EQ(m.ranks[r].local_rank, r % 2);
    EXPECT_EQ(m.ranks[r].device, "cpu");
  }
  EXPECT_EQ(m.ranks_on("node-b"), (std::vector<int>{2, 3}));
  EXPECT_EQ(m.max_ranks_per_host(), 2);
  EXPECT_EQ(m.total_cores(), 8);
  EXPECT_EQ(m.host_of(3).hostname, "node-b");
  EXPECT_THROW(m.host_of(4), std::out_of_range);
  EXPECT_EQ(hw::topology_from_json(hw::to_json(m)), m);

  // The same rank twice is an error.
  parts.push_back(parts[0]);
  EXPECT_THROW(hw::merge(parts), std::invalid_argument);
}

TEST(Topology, MergeKeepsLauncherLocalRanks) {
  hw::Topology a = hw::local_topology(fake_host("h", 2), 1, 0, "cpu");
  hw::Topology b = hw::local_topology(fake_host("h", 2), 0, 1, "cpu");
  hw::Topology m = hw::merge(std::vector<hw::Topology>{a, b});
  ASSERT_EQ(m.hosts_count(), 1);
  EXPECT_EQ(m.ranks[0].local_rank, 1);
  EXPECT_EQ(m.ranks[1].local_rank, 0);
}

TEST(Topology, TableShowsHostCoresAndRanks) {
  hw::Topology t = hw::local_topology(0, 0);
  std::string table = hw::format_table(t);
  const hw::HostTopology& h = t.hosts[0];
  EXPECT_NE(table.find("host " + h.hostname), std::string::npos) << table;
  EXPECT_NE(table.find(std::to_string(h.core_count()) + (h.core_count() == 1 ? " core" : " cores")),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("package 0"), std::string::npos) << table;
  EXPECT_NE(table.find("NUMA " + std::to_string(h.numa_nodes[0].os_index)), std::string::npos) << table;
  EXPECT_NE(table.find("ranks: 1 on 1 host"), std::string::npos) << table;
  EXPECT_NE(table.find(t.ranks[0].cpus), std::string::npos) << table;
  if (!h.caches.empty()) {
    EXPECT_NE(table.find("caches: " + h.caches[0].name), std::string::npos) << table;
  }
}

TEST(Topology, FakeGpusPrintAnNvidiaSmiMatrix) {
  // A hand-written host with 4 GPUs: two NVLinked pairs, PCIe between the pairs.
  const char* json = R"({
    "hosts": [{
      "hostname": "gpu-node",
      "packages": [{"index": 0, "model": "Fake CPU", "cpus": "0-31", "cores": 32, "pus": 32}],
      "numa_nodes": [{"index": 0, "os_index": 0, "package": 0, "memory_bytes": 68719476736, "cpus": "0-31"}],
      "pus": 32, "memory_bytes": 68719476736, "gpu_status": "ok",
      "driver_version": "550.54.15", "cuda_driver": "12.4",
      "gpus": [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:18:00.0", "memory_bytes": 85899345920, "compute_major": 9, "numa_node": 0, "cpu_affinity": "0-31"},
        {"index": 1, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:2A:00.0", "memory_bytes": 85899345920, "compute_major": 9, "numa_node": 0, "cpu_affinity": "0-31"},
        {"index": 2, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:3A:00.0", "memory_bytes": 85899345920, "compute_major": 9, "numa_node": 0, "cpu_affinity": "0-31"},
        {"index": 3, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:5D:00.0", "memory_bytes": 85899345920, "compute_major": 9, "numa_node": -1}
      ],
      "gpu_links": [
        [{"pcie": "X"}, {"pcie": "PIX", "nvlinks": 4, "p2p": true}, {"pcie": "PXB", "p2p": true}, {"pcie": "SYS"}],
        [{"pcie": "PIX", "nvlinks": 4, "p2p": true}, {"pcie": "X"}, {"pcie": "PHB", "p2p": true}, {"pcie": "SYS"}],
        [{"pcie": "PXB", "p2p": true}, {"pcie": "PHB", "p2p": true}, {"pcie": "X"}, {"pcie": "NODE", "nvlinks": 12}],
        [{"pcie": "SYS"}, {"pcie": "SYS"}, {"pcie": "NODE", "nvlinks": 12}, {"pcie": "X"}]
      ]
    }],
    "ranks": [{"rank": 0, "host": "gpu-node", "local_rank": 0, "cpus": "0-7", "device": "cuda:0"}]
  })";
  hw::Topology t = hw::topology_from_json(json);
  ASSERT_EQ(t.total_gpus(), 4);
  EXPECT_EQ(hw::topology_from_json(hw::to_json(t)), t);
  EXPECT_EQ(hw::default_device(t.hosts[0], 5), "cuda:1");
  std::string m = hw::format_gpu_matrix(t.hosts[0]);
  EXPECT_NE(m.find("        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity\n"), std::string::npos) << m;
  EXPECT_NE(m.find("GPU0     X       NV4     PXB     SYS    0-31            0\n"), std::string::npos) << m;
  EXPECT_NE(m.find("GPU2     PXB     PHB     X       NV12   0-31            0\n"), std::string::npos) << m;
  EXPECT_NE(m.find("GPU3     SYS     SYS     NV12    X      N/A             N/A\n"), std::string::npos) << m;
  EXPECT_NE(m.find("Legend:"), std::string::npos);
  for (const char* key : {"X    = Self", "SYS  = ", "NODE = ", "PHB  = ", "PXB  = ", "PIX  = ",
                          "NV#  = Connection traversing a bonded set of # NVLinks"})
    EXPECT_NE(m.find(key), std::string::npos) << key;
  EXPECT_NE(m.find("Peer access: yes GPU0-GPU1 GPU0-GPU2 GPU1-GPU2; no GPU0-GPU3 GPU1-GPU3 GPU2-GPU3"),
            std::string::npos)
      << m;
  std::string table = hw::format_table(t);
  EXPECT_NE(table.find("GPU0: NVIDIA H100 80GB HBM3, 80 GiB, sm_90, PCI 00000000:18:00.0, NUMA 0"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("  GPU0     X       NV4"), std::string::npos) << table;
  EXPECT_NE(table.find("cuda:0"), std::string::npos) << table;
}
