// The `local` backend: N ranks as threads of one process, over shared memory.
//
// Used for in-process replication and for fast multi-rank tests. There is no
// process-wide state: make_local_group() builds one shared group state that only its N
// communicators see, so any number of groups (and the groups split() makes from them)
// coexist in one process.
//
// Note [Local backend protocol]
// Every collective is a rendezvous on the group's generation-counter barrier: each rank
// posts its op (kind, dtype, numel, reduce op, root, buffer pointers) in its own slot,
// crosses the barrier, checks that every rank posted the same op (a mismatch is a
// CommError on every rank naming both ranks' values, never silent corruption), works
// directly on the other ranks' buffers, and crosses a final barrier so that nobody
// returns (and reuses a buffer) while a peer still reads or writes it.
//
// allreduce pushes: rank r reduces element chunk r, [r*n/size, (r+1)*n/size), of every
// rank's input into its own output chunk r and then copies that chunk into every other
// rank's output chunk r. Each chunk is touched by its owner alone, so in-place
// (output == input) is safe and two barriers suffice, not the three of a pull scheme.
// Likewise reduce_scatter into the rank's own chunk of its input and allgather from the
// rank's own chunk of its output are safe. Buffers of different ranks must not overlap.
//
// Send is buffered: it clones the tensor into the group's mailbox, FIFO per
// (source, destination, tag), and returns; recv waits for a matching message.
//
// Any failure (a timeout, a mismatch, an error thrown by an op) aborts the group: peers
// waiting in a barrier or a recv are released with a CommError that names the failing
// rank, and later ops fail at once on every rank.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "collectives/communicator.h"

namespace tetra::collectives {

// Creates n communicators that share memory; give comms[r] to thread r. Each has its own
// progress thread; name() is `name` on every rank.
std::vector<CommunicatorPtr> make_local_group(int n, const std::string& name = "local");

// Runs fn(rank, comm) on n threads at once over a fresh local group and rethrows the
// first exception (test and replicate helper). When fn throws on one rank, the group is
// aborted so that the others are released from their collectives instead of waiting for
// their timeouts.
void run_local_ranks(int n, const std::function<void(int rank, Communicator& comm)>& fn);

// Aborts the shared-memory group `comm` (a communicator make_local_group made) on behalf
// of its rank: peers blocked in its collectives or receives are released with a
// CommError carrying `reason`, and later ops fail at once. For a runner of thread-ranks
// whose rank failed outside a collective. A communicator of another backend is left alone.
void abort_local_group(Communicator& comm, const std::string& reason);

}  // namespace tetra::collectives
