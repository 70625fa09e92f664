// The tuner's trials as the `train` tool runs them: `train JOB` and `bench-collectives
// --calibrate` under the launch a user would type (mpirun -np N, srun inside a Slurm
// allocation, or --launcher's words), each in a process group of its own that is ended
// at its deadline. The planner (tools/planner/tune.h) starts no process itself; this is
// the TrialLauncher the tool hands it.
#pragma once

#include <string>
#include <vector>

#include "tools/planner/tune.h"

namespace tetra::trials {

class ProcessLauncher : public planner::TrialLauncher {
 public:
  // `np` processes; `launcher`: the words before the program ({np} replaced by np; "":
  // mpirun -np N --oversubscribe --bind-to none, or srun --mpi=pmix -n N inside a Slurm
  // allocation; one process: none); `train_exe`: the train binary ("": this process's).
  ProcessLauncher(int np, std::string launcher = "", std::string train_exe = "");

  std::string command() const override;
  planner::Launched train(const std::string& job_file, const std::string& log, double seconds) override;
  bool can_calibrate() const override;
  planner::Launched calibrate(const std::string& file, const std::string& log, double seconds) override;

 private:
  planner::Launched run(std::vector<std::string> argv, const std::string& log, double seconds) const;
  std::vector<std::string> words_;  // the launch before the program
  std::string train_exe_;
  std::string bench_;  // bench-collectives beside train_exe_
};

}  // namespace tetra::trials
