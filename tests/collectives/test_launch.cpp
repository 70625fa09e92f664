// Launch detection: which launcher, which rank, in the documented order of precedence.
#include <gtest/gtest.h>

#include "collectives/error.h"
#include "collectives/launch.h"

using namespace tetra::collectives;

TEST(Launch, SingleProcessWhenNothingIsSet) {
  LaunchInfo l = detect_launch({{"HOME", "/root"}});
  EXPECT_EQ(l.launcher, "single");
  EXPECT_EQ(l.rank, 0);
  EXPECT_EQ(l.world_size, 1);
  EXPECT_FALSE(l.multi_process());
}

TEST(Launch, OpenMpi) {
  LaunchInfo l = detect_launch({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                {"PMIX_RANK", "3"}});
  EXPECT_EQ(l.launcher, "mpirun");
  EXPECT_EQ(l.rank, 3);
  EXPECT_EQ(l.world_size, 4);
  EXPECT_EQ(l.local_rank, 1);
  EXPECT_EQ(l.local_world_size, 2);
  EXPECT_NE(l.evidence.find("OMPI_COMM_WORLD_SIZE=4"), std::string::npos);
}

// torchrun's static rendezvous: its agent serves the store, the ranks join it under this
// restart's prefix; the banner says so, and says which variables found the ranks.
TEST(Launch, TorchrunsAgentStoreAndWhatTheBannerSays) {
  LaunchInfo l = detect_launch({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                                {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"},
                                {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "3"}});
  EXPECT_TRUE(l.agent_store);
  EXPECT_EQ(l.restart, 3);
  EXPECT_EQ(describe(l), "torchrun, world 2, local ranks 2 (RANK, WORLD_SIZE; store at 10.0.0.1:29500, torchrun's agent's)");
  LaunchInfo standalone = detect_launch({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "localhost"},
                                         {"MASTER_PORT", "41000"}, {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  EXPECT_FALSE(standalone.agent_store);
  EXPECT_NE(describe(standalone).find("store at localhost:41000, rank 0's"), std::string::npos) << describe(standalone);
  EXPECT_EQ(describe(detect_launch({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}})),
            "mpirun, world 4, local ranks 2 (OMPI_COMM_WORLD_RANK, _SIZE)");
  // mpirun --map-by core --bind-to core, as it hands them to the ranks
  EXPECT_EQ(describe(detect_launch({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                    {"OMPI_MCA_rmaps_base_mapping_policy", "core"},
                                    {"OMPI_MCA_hwloc_base_binding_policy", "core"}})),
            "mpirun, world 2, local ranks 2 (OMPI_COMM_WORLD_RANK, _SIZE; --map-by core --bind-to core)");
  EXPECT_EQ(describe(detect_launch({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NTASKS_PER_NODE", "2"}})),
            "slurm, world 4, local ranks 2 (SLURM_PROCID, SLURM_NTASKS)");
}

TEST(Launch, PrecedenceOverrideThenTorchrunThenMpiThenPmixThenSlurm) {
  std::map<std::string, std::string> env = {
      {"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "4(x2)"}};
  EXPECT_EQ(detect_launch(env).launcher, "slurm");
  EXPECT_EQ(detect_launch(env).local_world_size, 4);
  env["PMIX_RANK"] = "5";
  EXPECT_EQ(detect_launch(env).launcher, "pmix");
  EXPECT_EQ(detect_launch(env).world_size, 0);  // PMIx alone does not say
  env["OMPI_COMM_WORLD_RANK"] = "5";
  env["OMPI_COMM_WORLD_SIZE"] = "8";
  EXPECT_EQ(detect_launch(env).launcher, "mpirun");
  env["RANK"] = "2";
  env["WORLD_SIZE"] = "3";
  env["MASTER_ADDR"] = "127.0.0.1";
  env["MASTER_PORT"] = "29500";
  LaunchInfo t = detect_launch(env);
  EXPECT_EQ(t.launcher, "torchrun");
  EXPECT_EQ(t.rank, 2);
  EXPECT_EQ(t.master_port, 29500);
  env["TETRA_RANK"] = "0";
  env["TETRA_WORLD_SIZE"] = "1";
  EXPECT_EQ(detect_launch(env).launcher, "override");
}

TEST(Launch, MalformedVariablesAreConfigErrors) {
  try {
    detect_launch({{"RANK", "abc"}, {"WORLD_SIZE", "2"}});
    FAIL();
  } catch (const tetra::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK=abc"), std::string::npos) << e.what();
  }
  try {
    detect_launch({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
    FAIL();
  } catch (const tetra::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 4 is not below the world size 4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(detect_launch({{"TETRA_RANK", "1"}}), tetra::ConfigError);
}

TEST(Launch, DisagreementNamesBothViews) {
  LaunchInfo l = detect_launch({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  EXPECT_NO_THROW(check_launch_agrees(l, "mpi", 1, 4));
  try {
    check_launch_agrees(l, "mpi", 1, 2);
    FAIL();
  } catch (const tetra::CommError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("mpirun: OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=4"), std::string::npos) << m;
    EXPECT_NE(m.find("the mpi backend has rank 1 of 2"), std::string::npos) << m;
  }
}
