// Preflight: every path a job reads and writes, checked before anything trains.
//
// Note [Preflight]
// A run that fails at its first checkpoint or at its export has spent its training for
// nothing. So `train --check`, and every rank at the start of a run, checks each path
// the job names, each error naming its key:
//   read   data.path (a file for text, a folder holding the four Fashion-MNIST files),
//          checkpoint.resume when it is a path: exists, readable, the right kind;
//          checkpoint.init_from: a checkpoint, or a file (an export).
//   write  log.dir, checkpoint.dir, log.metrics, log.trace, log.tensorboard,
//          checkpoint.safetensors: either there and of the right kind (a folder, a file)
//          and writable, or creatable: the nearest existing parent is a folder (not a
//          file in the way) that may be written.
//   space  checkpoint.dir's file system has room for one more checkpoint by the
//          estimate (checkpoint_bytes: fp32 weights and the optimizer's state): old
//          ones are pruned only after a new one is written, so one more must fit.
// Then the run folder (Note [One run folder]) must not hold another job's run: its
// job.yaml names the job that wrote it.
// All of these are ConfigErrors (exit 2), every problem at once, before any training.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/job_spec.h"

namespace tetra::core {

// The problems with the job's paths, one message each ("data.path: ..."); empty when
// every path is fine. Touches nothing: creates no folder, writes no file. `own_data`: the
// program brings its dataset (RunOptions::data), and data.path is not read.
std::vector<std::string> path_problems(const JobSpec& spec, bool own_data = false);

// What one checkpoint of `parameters` parameters takes on disk under the job's
// optimizer (fp32 weights and state), and the problem when checkpoint.dir's file system
// has less free ("" when it fits, or checkpoints are off).
int64_t checkpoint_bytes(const JobSpec& spec, int64_t parameters);
std::string space_problem(const JobSpec& spec, int64_t parameters);

// The problem when log.dir already holds a run of another job ("" when it does not).
std::string run_folder_problem(const JobSpec& spec);

// Throws tetra::ConfigError carrying every problem of path_problems, run_folder_problem
// and device_problem (train.device on this machine, core/device.h).
void check_paths(const JobSpec& spec, bool own_data = false);

}  // namespace tetra::core
