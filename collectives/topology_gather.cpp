#include "collectives/topology_gather.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/error.h"
#include "hardware/host.h"

namespace tetra::collectives {

hardware::Topology gather_topology(Communicator& comm, const LaunchInfo& launch, Duration timeout) {
  return gather_topology(comm, launch, hardware::discover_host(), timeout);
}

hardware::Topology gather_topology(Communicator& comm, const LaunchInfo& launch,
                                   const hardware::HostTopology& host, Duration timeout) {
  const int size = comm.size();
  // -1: merge assigns the position among the ranks on the same host.
  int local_rank = launch.world_size == size ? launch.local_rank : -1;
  std::string mine = hardware::to_json(hardware::local_topology(host, comm.rank(), local_rank));

  AllgatherOptions opts;
  opts.timeout = timeout;
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({size}, at::kLong);
  comm.allgather(len, lens, opts)->wait();
  std::vector<int64_t> n(lens.data_ptr<int64_t>(), lens.data_ptr<int64_t>() + size);
  int64_t max = 0;
  for (int r = 0; r < size; ++r) {
    if (n[r] <= 0 || n[r] > (int64_t{1} << 30))
      throw CommError("gather_topology over " + comm.name() + ": rank " + std::to_string(r) +
                      " sent a topology of " + std::to_string(n[r]) + " bytes");
    max = std::max(max, n[r]);
  }

  at::Tensor buf = at::zeros({max}, at::kByte);
  std::memcpy(buf.data_ptr<uint8_t>(), mine.data(), mine.size());
  at::Tensor all = at::empty({size * max}, at::kByte);
  comm.allgather(buf, all, opts)->wait();

  const char* bytes = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  std::vector<hardware::Topology> parts;
  parts.reserve(size);
  for (int r = 0; r < size; ++r) {
    try {
      parts.push_back(hardware::topology_from_json(std::string(bytes + r * max, static_cast<size_t>(n[r]))));
    } catch (const std::invalid_argument& e) {
      throw CommError("gather_topology over " + comm.name() + ": rank " + std::to_string(r) + "'s topology: " +
                      e.what());
    }
    const auto& ranks = parts.back().ranks;
    if (ranks.size() != 1 || ranks[0].rank != r)
      throw CommError("gather_topology over " + comm.name() + ": the document from rank " + std::to_string(r) +
                      " does not describe rank " + std::to_string(r) + " alone");
  }
  try {
    return hardware::merge(parts);
  } catch (const std::invalid_argument& e) {
    throw CommError("gather_topology over " + comm.name() + ": " + e.what());
  }
}

HostMap gather_hosts(Communicator& comm, Duration timeout) {
  constexpr int64_t kName = 65, kBoot = 40, kEach = kName + kBoot;  // HOST_NAME_MAX + 1, a UUID + 1
  const std::string mine = hardware::hostname().substr(0, kName - 1);
  const std::string boot = hardware::boot_id().substr(0, kBoot - 1);
  at::Tensor buf = at::zeros({kEach}, at::kByte);
  std::memcpy(buf.data_ptr<uint8_t>(), mine.data(), mine.size());
  std::memcpy(buf.data_ptr<uint8_t>() + kName, boot.data(), boot.size());
  at::Tensor all = at::empty({comm.size() * kEach}, at::kByte);
  AllgatherOptions opts;
  opts.timeout = timeout;
  comm.allgather(buf, all, opts)->wait();
  HostMap m;
  std::vector<std::string> boots;  // per machine
  const char* bytes = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  for (int r = 0; r < comm.size(); ++r) {
    const char* at = bytes + r * kEach;
    const std::string name(at, strnlen(at, kName));
    const auto it = std::find(m.hosts.begin(), m.hosts.end(), name);
    m.host_of.push_back(static_cast<int>(it - m.hosts.begin()));
    if (it != m.hosts.end()) continue;
    m.hosts.push_back(name);
    // No boot id (not Linux): the host is its own machine.
    std::string id(at + kName, strnlen(at + kName, kBoot));
    if (id.empty()) id = "host " + name;
    const auto b = std::find(boots.begin(), boots.end(), id);
    m.machine_of.push_back(static_cast<int>(b - boots.begin()));
    if (b == boots.end()) boots.push_back(id);
  }
  return m;
}

HostMap consecutive_hosts(int ranks, int ranks_per_host) {
  const int per = std::max(1, ranks_per_host);
  HostMap m;
  for (int r = 0; r < ranks; ++r) {
    const int h = r / per;
    if (h == static_cast<int>(m.hosts.size())) {
      m.hosts.push_back("host " + std::to_string(h));
      m.machine_of.push_back(h);
    }
    m.host_of.push_back(h);
  }
  return m;
}

int HostMap::ranks_on(int h) const { return static_cast<int>(std::count(host_of.begin(), host_of.end(), h)); }

int HostMap::most_on_one_host() const {
  int most = 0;
  for (int h = 0; h < static_cast<int>(hosts.size()); ++h) most = std::max(most, ranks_on(h));
  return most;
}

HostMap HostMap::of(const std::vector<int>& ranks) const {
  HostMap m;
  std::vector<int> host_index(hosts.size(), -1);  // a host of this map -> its number in m
  std::vector<int> machines;                      // m's machines, as this map numbers them
  for (int r : ranks) {
    const size_t h = static_cast<size_t>(host_of.at(static_cast<size_t>(r)));
    if (host_index[h] < 0) {
      host_index[h] = static_cast<int>(m.hosts.size());
      m.hosts.push_back(hosts[h]);
      // Machines numbered again too, in order of their first host.
      const int machine = h < machine_of.size() ? machine_of[h] : -1 - static_cast<int>(h);
      const auto it = std::find(machines.begin(), machines.end(), machine);
      m.machine_of.push_back(static_cast<int>(it - machines.begin()));
      if (it == machines.end()) machines.push_back(machine);
    }
    m.host_of.push_back(host_index[h]);
  }
  return m;
}

int HostMap::ranks_per_host() const {
  if (hosts.empty()) return 0;
  const int n = ranks_on(0);
  for (int h = 1; h < static_cast<int>(hosts.size()); ++h)
    if (ranks_on(h) != n) return 0;
  return n;
}

int HostMap::hosts_sharing_machine(int h) const {
  return static_cast<int>(std::count(machine_of.begin(), machine_of.end(), machine_of.at(static_cast<size_t>(h))));
}

std::string HostMap::describe(size_t max) const {
  std::string out;
  for (size_t h = 0; h < hosts.size() && h < max; ++h) {
    std::vector<int> ranks;
    for (int r = 0; r < static_cast<int>(host_of.size()); ++r)
      if (host_of[static_cast<size_t>(r)] == static_cast<int>(h)) ranks.push_back(r);
    std::string runs;
    for (size_t i = 0; i < ranks.size();) {
      size_t j = i;
      while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
      runs += (runs.empty() ? "" : ",") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
      i = j + 1;
    }
    out += (out.empty() ? "" : ", ") + hosts[h] + (ranks.size() == 1 ? ": rank " : ": ranks ") + runs;
  }
  if (hosts.size() > max) out += ", ... (" + std::to_string(hosts.size()) + " hosts)";
  return out;
}

}  // namespace tetra::collectives
