// Where a run starts from, and how it ends when it is asked to stop.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>

#include "collectives/communicator.h"
#include "core/checkpoint.h"
#include "core/job_spec.h"

namespace tetra::core {

// The checkpoint every rank of `ranks` (nullptr: one process) resumes under
// checkpoint.resume, or nullopt to start afresh. Collective. Rank 0 decides (the ranks
// could otherwise see the folder at different moments of a save, or through different
// mounts), after checking every file's size and CRC-32C: `auto` takes the newest intact
// checkpoint in checkpoint.dir, skipping a damaged one with a warning for the one before;
// an explicit path that is missing or damaged is an error, thrown on every rank alike.
std::optional<CheckpointReader> choose_checkpoint(const CheckpointSpec& ck, collectives::Communicator* ranks);

// The CPU generator's state, taken and put back with a checkpoint (not while another
// thread-rank seeds it and draws its model).
at::Tensor cpu_rng_state();
void set_cpu_rng_state(const at::Tensor& state);

// Note [Stop requests]: every rank agreed to stop after `step`. save_for_stop writes that
// step's checkpoint through `save` (collective; nullopt when checkpoint.dir is "") and
// returns the writer's name for it on every rank ("" when none); after it a further signal
// ends the process at once, resumably. throw_preempted then throws PreemptedError, naming
// it, after `say` printed the line (the writer's progress).
std::string save_for_stop(collectives::Communicator* ranks, const std::function<std::optional<std::string>()>& save);
[[noreturn]] void throw_preempted(int64_t step, int reason, const std::string& folder,
                                  const std::function<void(const std::string&)>& say);

}  // namespace tetra::core
