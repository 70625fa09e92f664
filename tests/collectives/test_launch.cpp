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
  EXPECT_EQ(describe(detect_launch({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NTASKS_PER_NODE", "2"},
                                    {"SLURM_STEP_ID", "0"}})),
            "slurm, world 4, local ranks 2 (srun: SLURM_PROCID, SLURM_NTASKS)");
}

// What srun 22.05 set for task 4 of `srun -N 2 -n 5 --mpi=pmix` (copied from a real
// step's environment on the test cluster, tools/test-slurm.sh up --hosts, with the job id
// made 17): srun placed 4 tasks on the first node and 1 on the second.
std::map<std::string, std::string> srun_task() {
  return {{"SLURM_JOB_ID", "17"},           {"SLURM_STEP_ID", "0"},
          {"SLURM_STEPID", "0"},            {"SLURM_PROCID", "4"},
          {"SLURM_LOCALID", "0"},           {"SLURM_NODEID", "1"},
          {"SLURM_NTASKS", "5"},            {"SLURM_STEP_NUM_TASKS", "5"},
          {"SLURM_TASKS_PER_NODE", "4,1"},  {"SLURM_STEP_TASKS_PER_NODE", "4,1"},
          {"SLURM_STEP_NUM_NODES", "2"},    {"SLURM_NNODES", "2"},
          {"SLURM_JOB_NODELIST", "tetra-host[1-2]"}, {"SLURM_STEP_NODELIST", "tetra-host[1-2]"},
          {"PMIX_RANK", "4"}};
}

TEST(Launch, AnSrunTaskIsARankOfItsStep) {
  LaunchInfo l = detect_launch(srun_task());
  EXPECT_EQ(l.launcher, "slurm");
  EXPECT_EQ(l.rank, 4);
  EXPECT_EQ(l.world_size, 5);
  EXPECT_EQ(l.local_rank, 0);
  EXPECT_EQ(l.local_world_size, 1);  // node 1 of "4,1"
  EXPECT_EQ(l.hosts, 2);
  EXPECT_EQ(describe(l), "slurm, world 5, local ranks 1 (srun: SLURM_PROCID, SLURM_STEP_NUM_TASKS; PMIx)");
  // gloo's rendezvous: the step's first node, a port every task derives from the ids
  EXPECT_EQ(l.master_addr, "tetra-host1");
  EXPECT_EQ(l.master_port, 10000 + (17 * 7 + 0) % 20000);
  EXPECT_EQ(l.master_source, "the first node of SLURM_STEP_NODELIST, a port from SLURM_JOB_ID 17 step 0");
  auto next_step = srun_task();
  next_step["SLURM_STEP_ID"] = "1";
  EXPECT_NE(detect_launch(next_step).master_port, l.master_port);
  // ... unless the job script exports them
  auto exported = srun_task();
  exported["MASTER_ADDR"] = "10.0.0.7";
  exported["MASTER_PORT"] = "29400";
  LaunchInfo e = detect_launch(exported);
  EXPECT_EQ(e.master_addr, "10.0.0.7");
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_EQ(e.master_source, "MASTER_ADDR, MASTER_PORT");
  // "2(x3)": node 2 of three nodes with two tasks each
  auto repeated = srun_task();
  repeated["SLURM_STEP_TASKS_PER_NODE"] = "2(x3)";
  repeated["SLURM_NODEID"] = "2";
  repeated["SLURM_STEP_NUM_TASKS"] = "6";
  EXPECT_EQ(detect_launch(repeated).local_world_size, 2);
  // job ids of a busy cluster's year
  auto busy = srun_task();
  busy["SLURM_JOB_ID"] = "61234567";
  EXPECT_EQ(detect_launch(busy).master_port, 10000 + static_cast<int>((61234567ull * 7) % 20000));
  busy["SLURM_JOB_ID"] = "12x";
  EXPECT_THROW(detect_launch(busy), tetra::ConfigError);
}

// The batch script of `sbatch -n 4` carries SLURM_PROCID=0 and SLURM_NTASKS=4 but is one
// process: taking it for rank 0 of 4 would wait for three ranks nobody starts.
TEST(Launch, ASlurmBatchScriptIsOneProcessAndSaysSo) {
  LaunchInfo l = detect_launch({{"SLURM_JOB_ID", "4"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"},
                                {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "0"}, {"SLURM_TASKS_PER_NODE", "4"}});
  EXPECT_EQ(l.launcher, "single");
  EXPECT_EQ(l.world_size, 1);
  EXPECT_FALSE(l.multi_process());
  EXPECT_EQ(describe(l), "1 process (a Slurm batch step: SLURM_NTASKS=4, no SLURM_STEP_ID)");
}

TEST(Launch, SlurmHostLists) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_hostlist("vm"), V{"vm"});
  EXPECT_EQ(expand_hostlist("node[01-03,07],login1"), (V{"node01", "node02", "node03", "node07", "login1"}));
  EXPECT_EQ(expand_hostlist("gpu[8-10]"), (V{"gpu8", "gpu9", "gpu10"}));
  EXPECT_EQ(expand_hostlist("r[1-2]n[1-2]"), (V{"r1n1", "r1n2", "r2n1", "r2n2"}));
  EXPECT_EQ(expand_hostlist("a-[009-011].cluster"), (V{"a-009.cluster", "a-010.cluster", "a-011.cluster"}));
  for (const char* bad : {"", "n[1-", "n1]", "n[3-1]", "n[a-b]", "n[]", "a,,b", "n[[1]]"}) {
    try {
      expand_hostlist(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const tetra::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(expand_tasks_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(expand_tasks_per_node("4"), (std::vector<int>{4}));
  for (const char* bad : {"", "x", "2(3)", "2(x3", "0", "2,"}) EXPECT_THROW(expand_tasks_per_node(bad), tetra::ConfigError) << bad;
}

TEST(Launch, PrecedenceOverrideThenTorchrunThenMpiThenSrunThenPmix) {
  std::map<std::string, std::string> env = {{"SLURM_PROCID", "5"},  {"SLURM_NTASKS", "8"},
                                            {"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                                            {"SLURM_STEP_ID", "0"}, {"SLURM_NODEID", "1"}};
  EXPECT_EQ(detect_launch(env).launcher, "slurm");
  EXPECT_EQ(detect_launch(env).local_world_size, 4);
  env["PMIX_RANK"] = "5";  // srun --mpi=pmix: Slurm's variables still say the world size
  EXPECT_EQ(detect_launch(env).launcher, "slurm");
  EXPECT_EQ(detect_launch(env).world_size, 8);
  env["PMIX_RANK"] = "2";  // another launcher's PMIx inside the step (prterun under srun)
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
