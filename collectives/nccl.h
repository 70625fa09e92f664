// The nccl backend: NCCL collectives on CUDA tensors, one GPU per rank.
//
// Compiled whenever the CUDA toolkit and NCCL are found; usable only where a CUDA device
// and a CUDA build of LibTorch are present (its tests skip cleanly elsewhere). The
// world is bootstrapped over the mpi world (rank 0's ncclUniqueId is broadcast), and
// each rank takes device local_rank % devices. Ops run on the communicator's own CUDA
// stream, created blocking so that it orders after work on the legacy default stream
// (where LibTorch computes unless told otherwise); a deadline polls the stream and, when
// it passes, aborts the NCCL communicator (ncclCommAbort) so that nothing hangs.
//
// NCCL matches point-to-point messages by order, not by tag: a recv takes the next send
// from its peer on this communicator, whatever the tags say.
#pragma once

#include <string>

#include "collectives/backends.h"

namespace tetra::collectives {

void register_nccl_backend(BackendRegistry& registry);

// "" when NCCL can run here, else why not (no driver, no device).
std::string nccl_unavailable_reason();

// Builds an nccl communicator over the ranks of `bootstrap` (any backend, CPU tensors):
// rank 0 creates the unique id and broadcasts it. Collective over `bootstrap`.
CommunicatorPtr nccl_from(Communicator& bootstrap, int device, const WorldOptions& options = {});

std::string nccl_version();

}  // namespace tetra::collectives
