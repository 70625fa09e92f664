// The gloo backend: LibTorch's own c10d ProcessGroupGloo over TCP.
//
// For torchrun-style launches without MPI (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
// rank 0 serves a c10d TCPStore there) and as an independent implementation to check the
// others against. c10d's Gloo has no reduce_scatter and no avg: tetra does them on top
// (allreduce then keep the own chunk; sum then divide once).
#pragma once

#include "collectives/backends.h"

namespace tetra::collectives {

void register_gloo_backend(BackendRegistry& registry);

// The world over a TCPStore at addr:port. Rank 0 serves it, unless `agent_store`: then a
// launcher's agent (torchrun) already does, every rank is a client, and the keys go under
// "/worker/attempt_<restart>/" as torch's own env:// rendezvous puts them. `source` says
// where addr and port came from, for messages ("the first node of SLURM_STEP_NODELIST").
// Collective.
CommunicatorPtr gloo_world(int rank, int size, const std::string& addr, int port,
                           const WorldOptions& options = {}, bool agent_store = false, int restart = 0,
                           const std::string& source = "");

}  // namespace tetra::collectives
