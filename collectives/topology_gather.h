// The job's topology, gathered: every rank discovers its host and placement and all
// ranks end with the same merged hardware::Topology.
#pragma once

#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/launch.h"
#include "hardware/topology.h"

namespace tetra::collectives {

// Collective over `comm`: each rank serialises hardware::local_topology (its host, its
// CPU affinity, its rank in `comm`) to JSON; an allgather of the lengths (i64) and one of
// the zero-padded bytes (u8) bring every document to every rank, which merges them
// (hardware::merge). The local rank is the launcher's when the launcher's world is this
// communicator (launch.world_size == comm.size()); otherwise (thread-ranks, a
// sub-communicator) it is the rank's position among the ranks on its host. A document
// that does not parse, or names another rank than its sender, is a tetra::CommError.
hardware::Topology gather_topology(Communicator& comm, const LaunchInfo& launch,
                                   Duration timeout = kDefaultTimeout);
// The same with this host already discovered (thread-ranks of one process share it).
hardware::Topology gather_topology(Communicator& comm, const LaunchInfo& launch,
                                   const hardware::HostTopology& host,
                                   Duration timeout = kDefaultTimeout);

// Note [One host map]
// Which host each rank is on: the one notion of placement that the run and the dry run
// share. The run gathers it (gather_hosts); the dry run, before any rank exists, takes
// consecutive_hosts (blocks of consecutive ranks, as launchers place them). The mesh reads
// every axis's placement from it alike (core/mesh.h: MeshLayout::axis_spans for the dry
// run's table and cost model, hierarchical_fits for the strategies' choice at attach).
//
// Where the ranks of a communicator run, by hostname: what needs only the hosts (the
// banner, hierarchical allreduce), not their hardware. One allgather of 64-byte names
// and 40-byte boot ids.
// With each host's machine: hosts whose ranks see one boot id run on one kernel
// (containers, network namespaces such as tools/test-hosts.sh's) and share its cores.
struct HostMap {
  std::vector<std::string> hosts;  // distinct hostnames, in order of their lowest rank
  std::vector<int> host_of;        // per rank: its index in `hosts`
  std::vector<int> machine_of;     // per host: its machine, numbered in order of first host
  // Ranks on host h.
  int ranks_on(int h) const;
  // The same number of ranks on every host: that number; 0 when they differ.
  int ranks_per_host() const;
  // The most ranks on one host (0 without ranks).
  int most_on_one_host() const;
  // The map of some of these ranks, in the order given (a mesh axis's group): rank i of
  // the result is ranks[i]; hosts numbered again in order of their lowest rank there, as
  // gather_hosts over that group numbers them.
  HostMap of(const std::vector<int>& ranks) const;
  // Hosts on host h's machine (1 unless hosts share a kernel).
  int hosts_sharing_machine(int h) const;
  // "tetra-host1: ranks 0-1, tetra-host2: ranks 2-3" (runs of ranks; the first `max`
  // hosts, then "... (N hosts)").
  std::string describe(size_t max = 4) const;
};
HostMap gather_hosts(Communicator& comm, Duration timeout = kDefaultTimeout);
// `ranks` ranks on hosts of `ranks_per_host` consecutive ranks each (the last may hold
// fewer), named "host 0", "host 1", ..., each its own machine: where mpirun --map-by slot,
// srun's block distribution and torchrun place them, and what a dry run plans with.
HostMap consecutive_hosts(int ranks, int ranks_per_host);

}  // namespace tetra::collectives
