// Who launched this process, and as which rank: read in one place.
//
// Order (the first that is set wins): an explicit override (TETRA_RANK and
// TETRA_WORLD_SIZE, optional TETRA_LOCAL_RANK / TETRA_LOCAL_WORLD_SIZE); torchrun's
// variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
// Open MPI's (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE); PMIx's
// (PMIX_RANK, with the size from the launcher when it says); Slurm's (SLURM_PROCID,
// SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE); else a single process.
//
// Note [Slurm]: a task of an srun step carries SLURM_STEP_ID beside SLURM_PROCID; the
// batch script itself carries SLURM_PROCID=0 and SLURM_NTASKS of the whole allocation
// but no step, and is one process, not rank 0 of N (a job that needs N ranks says to
// start it with srun). Under `srun --mpi=pmix` PMIX_RANK is set as well, and Slurm's
// variables win: they also give the world size, which PMIx's do not. The sizes are the
// step's (SLURM_STEP_NUM_TASKS; this node's entry of SLURM_STEP_TASKS_PER_NODE, "2(x3),1"),
// not the allocation's. For the gloo backend, the rendezvous is MASTER_ADDR and
// MASTER_PORT when the job script exports them, else the step's first node
// (SLURM_STEP_NODELIST, expanded) and a port derived from the job and step ids, so that
// every task of a step computes the same one with no exchange (Note [Slurm port]).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace tetra::collectives {

struct LaunchInfo {
  std::string launcher = "single";  // override | torchrun | mpirun | pmix | slurm | single
  int rank = 0;
  int world_size = 1;     // 0 when the launcher does not say (PMIx alone)
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  // torchrun rendezvous; Slurm's, see Note [Slurm]
  int master_port = 0;
  // Where master_addr and master_port came from, for messages: "MASTER_ADDR, MASTER_PORT",
  // "the first node of SLURM_STEP_NODELIST, a port from SLURM_JOB_ID 17 step 0".
  std::string master_source;
  int hosts = 0;  // nodes of the step, where the launcher says (SLURM_STEP_NUM_NODES)
  // torchrun's agent already serves the store at master_addr:master_port
  // (TORCHELASTIC_USE_AGENT_STORE=True, its static rendezvous): every rank is a client,
  // under the key prefix of this restart (TORCHELASTIC_RESTART_COUNT), as torch does.
  bool agent_store = false;
  int restart = 0;
  // mpirun's --map-by and --bind-to as it hands them to the ranks
  // (OMPI_MCA_rmaps_base_mapping_policy, OMPI_MCA_hwloc_base_binding_policy); "" when
  // mpirun was left to its defaults. tetra never re-binds a rank the launcher placed.
  std::string map_by, bind_to;
  // The variables the decision was made from, for messages ("OMPI_COMM_WORLD_SIZE=4").
  // For a single process inside a Slurm allocation, what it was not (Note [Slurm]).
  std::string evidence;
  bool multi_process() const { return world_size != 1; }
};

// Reads the environment. A malformed variable (RANK=abc, a rank >= the world size) is a
// tetra::ConfigError naming it.
LaunchInfo detect_launch();
// The same from an explicit environment (tests).
LaunchInfo detect_launch(const std::map<std::string, std::string>& env);

// "mpirun, world 4, local ranks 2 (OMPI_COMM_WORLD_RANK, _SIZE)": the launcher, the
// sizes, and the variables the ranks were found from (for torchrun, also whose store the
// rendezvous is at).
// Throws tetra::CommError when the launcher's rank or world size disagrees with what
// the backend found, naming both ("the launcher (mpirun: OMPI_COMM_WORLD_SIZE=4) says 4
// ranks, the mpi backend has 2").
void check_launch_agrees(const LaunchInfo& launch, const std::string& backend, int rank,
                         int world_size);

// "mpirun, world 4, 1 host, local ranks 4" style one-liner for banners.
std::string describe(const LaunchInfo& launch);

// Slurm's compressed host lists, as in SLURM_JOB_NODELIST: "node[01-03,07],login1" is
// node01 node02 node03 node07 login1; several bracket groups in one name multiply
// ("r[1-2]n[1-2]": r1n1 r1n2 r2n1 r2n2); a range keeps the zero padding of its first
// number. A malformed list is a tetra::ConfigError quoting it.
std::vector<std::string> expand_hostlist(const std::string& list);
// Slurm's task counts per node, "2(x3),1" -> 2 2 2 1. A malformed list is a ConfigError.
std::vector<int> expand_tasks_per_node(const std::string& counts);

}  // namespace tetra::collectives
