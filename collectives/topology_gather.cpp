#include "collectives/topology_gather.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/error.h"

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

}  // namespace tetra::collectives
