// gather_topology over the local backend: thread-ranks of one process, one host.
#include "collectives/topology_gather.h"

#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "hardware/host.h"

namespace tetra::collectives {
namespace {

using namespace std::chrono_literals;

TEST(TopologyGather, ThreeThreadRanksAgreeOnOneHost) {
  const int n = 3;
  LaunchInfo single;  // the process was not launched as several: local ranks come from the hosts
  std::mutex mu;
  std::vector<hardware::Topology> seen(n);
  run_local_ranks(n, [&](int rank, Communicator& comm) {
    hardware::Topology t = gather_topology(comm, single, 60s);
    std::lock_guard<std::mutex> lock(mu);
    seen[rank] = std::move(t);
  });
  for (int r = 1; r < n; ++r) EXPECT_EQ(seen[r], seen[0]) << "rank " << r << " merged differently";
  const hardware::Topology& t = seen[0];
  ASSERT_EQ(t.hosts_count(), 1);
  EXPECT_EQ(t.hosts[0].hostname, hardware::hostname());
  EXPECT_EQ(t.hosts[0].pus, hardware::host_cores());
  ASSERT_EQ(t.ranks_count(), n);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(t.ranks[r].rank, r);
    EXPECT_EQ(t.ranks[r].host, hardware::hostname());
    EXPECT_EQ(t.ranks[r].local_rank, r);
    EXPECT_FALSE(t.ranks[r].cpus.empty());
    EXPECT_EQ(t.ranks[r].device, hardware::default_device(t.hosts[0], r));
  }
  EXPECT_EQ(t.max_ranks_per_host(), n);
  EXPECT_EQ(hardware::topology_from_json(hardware::to_json(t)), t);
}

// The hosts of a communicator with their machines: thread-ranks of one process are one
// host on one machine (the test hosts' case, two hosts on one kernel, is
// tools_cost_model_check's: their calibration gives each half the cores).
TEST(TopologyGather, HostsKnowTheirMachine) {
  std::mutex mu;
  std::vector<HostMap> seen(2);
  run_local_ranks(2, [&](int rank, Communicator& comm) {
    HostMap m = gather_hosts(comm, 60s);
    std::lock_guard<std::mutex> lock(mu);
    seen[rank] = std::move(m);
  });
  for (const HostMap& m : seen) {
    ASSERT_EQ(m.hosts.size(), 1u);
    EXPECT_EQ(m.hosts[0], hardware::hostname());
    EXPECT_EQ(m.host_of, (std::vector<int>{0, 0}));
    EXPECT_EQ(m.machine_of, std::vector<int>{0});
    EXPECT_EQ(m.hosts_sharing_machine(0), 1);
  }
  EXPECT_EQ(hardware::boot_id().size(), 36u);  // a UUID, on Linux
}

// Note [One host map]: the dry run's hosts (blocks of consecutive ranks) and a group's
// own map, taken from the world's as gather_hosts over the group numbers it.
TEST(HostMap, ConsecutiveBlocksAndAGroupsOwnMap) {
  const HostMap world = consecutive_hosts(7, 3);  // 0-2, 3-5, 6
  EXPECT_EQ(world.hosts, (std::vector<std::string>{"host 0", "host 1", "host 2"}));
  EXPECT_EQ(world.host_of, (std::vector<int>{0, 0, 0, 1, 1, 1, 2}));
  EXPECT_EQ(world.machine_of, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(world.ranks_per_host(), 0);  // the last host has fewer
  EXPECT_EQ(world.most_on_one_host(), 3);
  EXPECT_EQ(consecutive_hosts(4, 2).ranks_per_host(), 2);
  EXPECT_EQ(consecutive_hosts(3, 8).hosts.size(), 1u);

  const HostMap group = world.of({6, 1, 4, 0});  // in the group's own order
  EXPECT_EQ(group.hosts, (std::vector<std::string>{"host 2", "host 0", "host 1"}));
  EXPECT_EQ(group.host_of, (std::vector<int>{0, 1, 2, 1}));
  EXPECT_EQ(group.machine_of, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(group.most_on_one_host(), 2);

  HostMap shared;  // hosts a and c on one kernel
  shared.hosts = {"a", "b", "c"};
  shared.host_of = {0, 1, 2, 0};
  shared.machine_of = {0, 1, 0};
  const HostMap part = shared.of({2, 1, 0});
  EXPECT_EQ(part.hosts, (std::vector<std::string>{"c", "b", "a"}));
  EXPECT_EQ(part.machine_of, (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(part.hosts_sharing_machine(0), 2);
}

TEST(TopologyGather, LauncherLocalRankWinsWhenItsWorldIsTheCommunicator) {
  // A world of 2 whose launcher numbered the local ranks in reverse: kept as given.
  const hardware::HostTopology host = hardware::discover_host();
  std::mutex mu;
  std::vector<hardware::Topology> seen(2);
  run_local_ranks(2, [&](int rank, Communicator& comm) {
    LaunchInfo launch;
    launch.launcher = "override";
    launch.world_size = 2;
    launch.rank = rank;
    launch.local_rank = 1 - rank;
    launch.local_world_size = 2;
    hardware::Topology t = gather_topology(comm, launch, host, 60s);
    std::lock_guard<std::mutex> lock(mu);
    seen[rank] = std::move(t);
  });
  ASSERT_EQ(seen[0].ranks_count(), 2);
  EXPECT_EQ(seen[0].ranks[0].local_rank, 1);
  EXPECT_EQ(seen[0].ranks[1].local_rank, 0);
  EXPECT_EQ(seen[1], seen[0]);
}

TEST(TopologyGather, OneRank) {
  run_local_ranks(1, [&](int, Communicator& comm) {
    hardware::Topology t = gather_topology(comm, LaunchInfo{}, 60s);
    ASSERT_EQ(t.ranks_count(), 1);
    EXPECT_EQ(t.ranks[0].local_rank, 0);
    EXPECT_EQ(t.hosts_count(), 1);
  });
}

}  // namespace
}  // namespace tetra::collectives
