// The `mpi` backend: Open MPI, the multi-process and multi-host engine.
//
// Note [mpi backend design]
// * One process-level runtime initialises MPI (MPI_Init_thread with
//   MPI_THREAD_MULTIPLE: every communicator's progress thread calls MPI) on the first
//   mpi_world() and finalises it at exit (an atexit handler), after it has stopped and
//   freed every communicator still alive then; a communicator that outlives main's
//   locals is shut down there and its destructor later does nothing. A process that
//   exits with an op it had to abandon (a timeout, see below) still pending does not
//   call MPI_Finalize (whose fence would wait for the peer that never came); it says so
//   on stderr and mpirun ends the job. Nor does a process that ends with an error
//   (mpi_exit_without_finalize).
// * Each communicator owns a dup of MPI_COMM_WORLD (never the world itself), with
//   MPI_ERRORS_RETURN: every MPI return code becomes a CommError naming the MPI call,
//   MPI's error string and mpi.cpp's line.
// * Timeouts: every op is non-blocking (MPI_Iallreduce, MPI_Iallgather, MPI_Ibcast,
//   MPI_Ibarrier, MPI_Isend/MPI_Irecv, also for the reduce-scatter's ring (Note
//   [Reduce-scatter as a ring] in mpi.cpp), MPI_Comm_idup)
//   followed by an MPI_Test loop up to the deadline (Note [Awaited and background
//   polls]). On the
//   deadline the op throws TimeoutError; its request and tensors are kept (MPI may still
//   write them) until MPI completes it, e.g. when the late peer joins. MPI_Comm_split
//   and MPI_Comm_split_type have no non-blocking form: an MPI_Ibarrier with the deadline
//   goes first, so that a peer that never comes is a TimeoutError there too.
// * libnbc (Open MPI's non-blocking collectives) picks a binomial reduce+bcast for
//   iallreduce on < 4 ranks and for in-place ones, measured at ~0.55 of the blocking
//   tuned MPI_Allreduce at 1-16 MiB; its ring runs at ~1.0. The runtime therefore sets
//   OMPI_MCA_coll_libnbc_iallreduce_algorithm=1 (ring) before MPI_Init unless the
//   environment already sets it.
// * bf16 and f16: a committed 2-byte contiguous datatype and commutative user ops
//   (MPI_Op_create) that reduce through float and round back with c10's conversions,
//   created once per process.
//
// Note [Awaited and background polls]
// How the progress thread tests an op's request depends on whether a caller is blocked
// in Work::wait() on the communicator (Communicator::awaited()). Awaited, the caller's
// core is free: a tight spin for the first 100 us (small messages), then sched_yield (a
// large op, every peer there) up to 5 ms, then 50 us sleeps (a peer is late). Nobody
// waiting, the caller is computing (a stage's forward while its activation travels,
// backward while gradient buckets reduce): a 20 us spin, then 50 us sleeps. A thread
// that yields stays runnable, and CFS gives it its fair share of the computing core;
// a sleeping one costs a test every ~60 us. When a caller begins to wait, the loop
// starts the awaited pattern from its beginning. Open MPI's progress engine is global,
// so a spinning wait on one communicator also moves the others' transfers along.
// Measured on 2 cores (bench-pipeline, 1f1b, 2 stages, 3 runs each, alternated): the
// pipeline's samples/s rose 18% at 8 micro-batches and 14% at 16; `train
// configs/pipeline.yaml` (6 runs each, alternated) did not move beyond the noise (8347
// vs 8315 samples/s). bench-train with data=2 did not change (overlap 0.880 vs 0.876 of
// its compute-only ceiling). A 2-rank sendrecv of 4 B took 52 us instead of 104 us. TETRA_MPI_POLL=spin,yield,sleep,
// background_spin (us) overrides the policy to measure it; a negative background_spin
// polls every op as awaited, which was the policy before.
#pragma once

#include <string>

#include "collectives/backends.h"
#include "collectives/communicator.h"

namespace tetra::collectives {

// name "mpi", description "Open MPI 4.1.4" (from MPI_Get_library_version).
void register_mpi_backend(BackendRegistry& registry);

// The world of this process: initialises MPI on first use (once per process; a single
// process without mpirun is a world of 1) and returns the same world on later calls.
// MPI without MPI_THREAD_MULTIPLE is a CommError.
CommunicatorPtr mpi_world(const WorldOptions& options = {});

// The ranks of `comm` on this host (MPI_Comm_split_type MPI_COMM_TYPE_SHARED), ordered
// by their rank in `comm`. Collective over `comm`; waits for the ops queued on it first
// (issue it from the thread that issues comm's ops). Throws CommError if comm is not an
// mpi communicator.
CommunicatorPtr mpi_split_shared(Communicator& comm, Duration timeout = kDefaultTimeout);

// Marks this process as ending with an error: at exit it does not call MPI_Finalize. The
// finalize's fence waits for every rank, and a rank that failed early (its peers still
// in a collective, or already waiting for it) would hang there instead of exiting, so
// mpirun, which ends the whole job when one rank exits non-zero, would never hear of
// it. `train` calls it on every path that exits non-zero; Open MPI then reports the
// rank that ended without finalising, and mpirun ends the job.
void mpi_exit_without_finalize();

// MPI_Get_library_version's first line: "Open MPI v4.1.4, package: Debian OpenMPI, ...".
std::string mpi_library_version();

}  // namespace tetra::collectives
