// The `hierarchical` communicator: one group of D processes x R replica threads, made of
// an in-process group (inner) and a cross-process group (outer), that behaves like a
// flat communicator of D*R ranks. Replication (replicate/) gives it to data parallelism
// and ZeRO, which then run over D*R data ranks unchanged.
//
// Note [Hierarchical composition]
// Replica r of process d holds two communicators:
//   inner: the R replicas of its process (usually `local`, shared memory), rank r;
//   outer: the replicas with index r in every process (usually `mpi`), rank d.
// Its rank in the group is g = d*R + r (a process's replicas are contiguous, the mesh's
// innermost axis), the group size D*R. Each op is a fixed sequence of inner and outer ops,
// the same on every replica, so that it equals the flat op:
//   allreduce      inner allreduce, then outer allreduce: every replica is in its own
//                  outer group, so every replica ends with the result. Sums of at least
//                  split_min_bytes instead go inner reduce_scatter (padded to a multiple
//                  of R) -> outer allreduce of the 1/R chunk -> inner allgather, so each
//                  replica moves 1/R of the bytes across processes, in parallel with its
//                  siblings (Horovod's hierarchical allreduce).
//   reduce_scatter input [D][R][n] is copied transposed to [R][D][n]; inner reduce_scatter
//                  leaves replica r the [D][n] blocks (., r), summed over the process;
//                  outer reduce_scatter leaves it block (d, r) summed over every process:
//                  chunk g.
//   allgather      outer allgather -> [D][n] (the inputs of (., r)); inner allgather ->
//                  [R][D][n]; copied transposed into the output [D][R][n].
//   broadcast      from g0 = (d0, r0): the replicas r0 broadcast over their outer group
//                  from d0, then every process broadcasts from its replica r0.
//   barrier        inner barrier, then outer barrier. When replica r leaves the outer
//                  barrier, replica r of every process has passed its inner barrier, so
//                  every rank of the group has arrived; a third (inner) barrier would add
//                  a rendezvous without adding a guarantee.
//   send, recv     to a rank of the same process over inner, to the same replica index
//                  of another process over outer; any other pair is a CommError (there is
//                  no path, and routing through a third rank would need a forwarding
//                  protocol nobody uses: the pipeline axis is never the replica axis).
//   split          (color, key) is allgathered over the group itself. Every color must
//                  form a rectangle: a list of processes x a list of replica indices,
//                  ordered by (key, rank) process-major, which is the only shape two
//                  splits (inner.split, outer.split) can reproduce. Then every rank calls
//                  inner.split and outer.split (color -1 when it joins none), in that
//                  order, and the result is again hierarchical. A color in one process,
//                  or of one replica index, is such a rectangle (its outer, or inner,
//                  group has one rank and its ops skip it), so every sub-group has
//                  backend() "hierarchical" like its parent. Any non-rectangular color
//                  is a CommError on every rank (each checks every color, so no rank
//                  goes on to an inner split the others never call).
// kAvg reduces as kSum at every stage and divides once by D*R at the end (Note
// [Communicator shape]: the same rounding as a flat group). A stage whose group has one
// rank is skipped, so D=1 or R=1 costs only the other stage.
//
// Each op runs on the hierarchical communicator's progress thread and waits for the inner
// and outer ops it issues with the time left until its own deadline, so nothing waits
// longer than the op's timeout. A failed stage is a CommError (TimeoutError for a
// timeout) naming the group, the stage, and the inner or outer group's own message.
//
// While the hierarchical communicator is in use, inner and outer belong to it: ops issued
// on them directly by the caller would interleave with its stages in an order that
// differs between replicas.
#pragma once

#include <cstdint>
#include <string>

#include "collectives/communicator.h"

namespace tetra::collectives {

struct HierarchicalOptions {
  // Allreduce sums (and averages) of at least this many bytes take the reduce_scatter ->
  // outer allreduce -> allgather path; smaller ones, and min/max/prod, allreduce inner
  // then outer. 0 sends every sum that way (tests use it to cover the path at every size).
  int64_t split_min_bytes = int64_t{64} << 10;
  // For the handshake in make_hierarchical.
  Duration timeout = kDefaultTimeout;
};

// Composes replica inner->rank() of process outer->rank() into a group of
// outer->size() x inner->size() ranks named `name` (backend() "hierarchical").
// Collective: every replica of every process calls it, each from its own thread (or any
// threads that do not wait on each other). It checks, over inner and outer, that every
// replica of a process has the same process index and process count, and that every
// member of an outer group has the same replica index and replica count, and throws
// CommError saying which differ (TimeoutError when a member does not come by
// options.timeout). inner or outer null is a CommError.
CommunicatorPtr make_hierarchical(CommunicatorPtr inner, CommunicatorPtr outer, std::string name,
                                  const HierarchicalOptions& options = {});

}  // namespace tetra::collectives
