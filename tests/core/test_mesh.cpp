// The mesh: the fit check with the whole equation, rank <-> coordinates, axis groups.
#include <gtest/gtest.h>

#include "collectives/error.h"
#include "core/job_file.h"
#include "core/job_spec.h"
#include "core/mesh.h"

using namespace tetra::core;

TEST(Mesh, AxesTakeTheFixedOrderWhateverTheYamlSays) {
  MeshSpec s = make_mesh_spec({{"data", 2}, {"pipeline", 3}});
  ASSERT_EQ(s.axes.size(), 2u);
  EXPECT_EQ(s.axes[0].name, "pipeline");  // outermost
  EXPECT_EQ(s.axes[1].name, "data");      // the talkative axis innermost
  EXPECT_EQ(s.world_size(), 6);
  EXPECT_EQ(s.str(), "pipeline=3 x data=2");
  EXPECT_EQ(s.size("data"), 2);
  EXPECT_THROW(make_mesh_spec({{"expert", 2}}), tetra::ConfigError);  // no such axis
  MeshSpec t = make_mesh_spec({{"tensor", 2}, {"data", 2}, {"pipeline", 2}});
  EXPECT_EQ(t.str(), "pipeline=2 x data=2 x tensor=2");  // tensor innermost
}

TEST(Mesh, AMeshThatDoesNotFitStatesTheEquation) {
  MeshSpec s = make_mesh_spec({{"pipeline", 2}, {"data", 2}});
  EXPECT_NO_THROW(check_mesh_fits(s, 4));
  try {
    check_mesh_fits(s, 3, "mpirun -np 3");
    FAIL();
  } catch (const tetra::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("mesh pipeline=2 x data=2 = 4 ranks, but the world has 3 (mpirun -np 3)"),
              std::string::npos)
        << e.what();
  }
}

TEST(Mesh, DataIsInnermostOnConsecutiveRanks) {
  MeshLayout m(make_mesh_spec({{"pipeline", 2}, {"data", 3}}));
  EXPECT_EQ(m.coords(0), (std::vector<int>{0, 0}));
  EXPECT_EQ(m.coords(1), (std::vector<int>{0, 1}));
  EXPECT_EQ(m.coords(4), (std::vector<int>{1, 1}));
  EXPECT_EQ(m.group(4, "data"), (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(m.group(4, "pipeline"), (std::vector<int>{1, 4}));
  EXPECT_EQ(m.group(4, "absent"), (std::vector<int>{4}));
  for (int r = 0; r < 6; ++r) EXPECT_EQ(m.rank_of(m.coords(r)), r);
  EXPECT_NE(m.table().find("rank 5: pipeline 1, data 2"), std::string::npos) << m.table();
}

// Note [One host map]: a dry run's hosts (blocks of consecutive ranks) and any other map
// (a gathered one that deals ranks out round-robin) go through the same spans.
TEST(Mesh, AxisSpansReadTheHostMap) {
  const MeshLayout layout(make_mesh_spec({{"pipeline", 2}, {"data", 2}}));  // data: 0-1, 2-3
  const auto blocks = layout.axis_spans(tetra::collectives::consecutive_hosts(4, 2));
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[0].axis, "pipeline");
  EXPECT_EQ(blocks[0].most_hosts, 2);
  EXPECT_EQ(blocks[0].most_per_host, 1);
  EXPECT_EQ(blocks[1].axis, "data");
  EXPECT_EQ(blocks[1].most_hosts, 1);
  EXPECT_EQ(blocks[1].most_per_host, 2);

  tetra::collectives::HostMap dealt;  // ranks 0, 2 on host a; 1, 3 on host b
  dealt.hosts = {"a", "b"};
  dealt.host_of = {0, 1, 0, 1};
  dealt.machine_of = {0, 1};
  const auto spans = layout.axis_spans(dealt);
  EXPECT_EQ(spans[0].most_hosts, 1);  // pipeline 0-2 and 1-3: each on one host
  EXPECT_EQ(spans[1].most_hosts, 2);  // data 0-1 and 2-3: each across both
  EXPECT_EQ(spans[1].fewest_hosts, 2);
  EXPECT_EQ(layout.host_placement(dealt)[1], "data      x2   across 2 hosts (1 rank of each group per host)");
  // The data groups' own maps: one rank on each of two hosts, nothing to reduce inside.
  EXPECT_FALSE(hierarchical_fits(dealt.of(layout.group(0, "data"))));
  EXPECT_TRUE(hierarchical_fits(tetra::collectives::consecutive_hosts(4, 2)));
  EXPECT_FALSE(hierarchical_fits(tetra::collectives::consecutive_hosts(5, 2)));  // 2, 2, 1
}

TEST(Mesh, ParsedFromTheJobSpec) {
  SectionRegistry owners;  // stand-ins for the plugins that own the axes
  owners.add("data_parallel", [](Section&, const JobSpec&) { return nullptr; }, "data");
  owners.add("pipeline", [](Section&, const JobSpec&) { return nullptr; }, "pipeline");
  auto job = parse_job_string("mesh: {data: 2, pipeline: 2}\ncollectives: {backend: mpi, timeout_s: 30}\n",
                              "j", {}, owners);
  EXPECT_EQ(job.spec.mesh.str(), "pipeline=2 x data=2");
  EXPECT_EQ(job.spec.collectives.timeout_s, 30);
  try {
    parse_job_string("mesh:\n  dta: 2\n", "j.yaml", {}, {});
    FAIL();
  } catch (const tetra::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("j.yaml:2:3: error: mesh.dta: unknown key; did you mean \"data\"?"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(parse_job_string("mesh: {data: 0}\n", "j", {}, {}), tetra::ConfigError);
  try {  // an axis no plugin of this build owns
    parse_job_string("mesh: {data: 2}\n", "j.yaml", {}, {});
    FAIL();
  } catch (const tetra::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("j.yaml:1:8: error: mesh.data: 2 ranks on the data axis need its strategy plugin"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(parse_job_string("collectives: {backend: carrier-pigeon}\n", "j", {}, {}), tetra::ConfigError);
}

#include <ATen/ATen.h>

#include "collectives/local.h"

TEST(Mesh, AxisGroupsAreTheRanksThatDifferInThatAxisOnly) {
  // 2 x 3 on six thread-ranks: each data group sums its members' ranks, each pipeline
  // group likewise; the sums say which ranks were grouped.
  tetra::collectives::run_local_ranks(6, [](int rank, tetra::collectives::Communicator& world) {
    Mesh mesh(world.shared_from_this(), make_mesh_spec({{"pipeline", 2}, {"data", 3}}));
    auto data = mesh.axis("data"), pipe = mesh.axis("pipeline");
    EXPECT_EQ(data->size(), 3);
    EXPECT_EQ(pipe->size(), 2);
    EXPECT_EQ(data->rank(), rank % 3);
    EXPECT_EQ(pipe->rank(), rank / 3);
    at::Tensor t = at::full({1}, rank, at::kLong);
    data->allreduce(t)->wait();
    EXPECT_EQ(t.item<int64_t>(), rank < 3 ? 0 + 1 + 2 : 3 + 4 + 5);
    t.fill_(rank);
    pipe->allreduce(t)->wait();
    EXPECT_EQ(t.item<int64_t>(), (rank % 3) * 2 + 3);
  });
}

TEST(Mesh, AnAbsentAxisIsAGroupOfOne) {
  tetra::collectives::run_local_ranks(2, [](int rank, tetra::collectives::Communicator& world) {
    Mesh mesh(world.shared_from_this(), make_mesh_spec({{"data", 2}}));
    EXPECT_EQ(mesh.axis("pipeline")->size(), 1);
    EXPECT_EQ(mesh.axis("data")->size(), 2);
    EXPECT_EQ(mesh.coord("data"), rank);
  });
}

TEST(Mesh, BuildingOnAWorldOfTheWrongSizeFailsBeforeCommunicating) {
  tetra::collectives::run_local_ranks(3, [](int, tetra::collectives::Communicator& world) {
    EXPECT_THROW(Mesh(world.shared_from_this(), make_mesh_spec({{"data", 2}})), tetra::ConfigError);
  });
}
