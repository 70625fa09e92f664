// Megatron's four mappings over a tensor axis' communicator (Note [Tensor-parallel maps],
// core/tensor_group.h): what the tensor_parallel plugin binds to the layers at attach.
#pragma once

#include <memory>

#include "collectives/communicator.h"
#include "core/tensor_group.h"

namespace tetra::tensor_parallel {

// The tensor group over `comm` (the mesh's tensor axis: T ranks, this one's part its
// rank). Each map is an autograd function whose collective runs on `comm`, forward or
// backward, and waits (the next op needs its result), each bounded by `timeout`. With
// `overlap`, a column-parallel Linear's backward sums its input gradient while it
// computes its weight gradient (Note [Overlapped input gradient]).
std::shared_ptr<core::TensorGroup> tensor_group(collectives::CommunicatorPtr comm,
                                                collectives::Duration timeout = collectives::kDefaultTimeout,
                                                bool overlap = true);

}  // namespace tetra::tensor_parallel
