#include "collectives/fusion.h"

#include <ATen/ATen.h>

#include "collectives/error.h"

namespace tetra::collectives {

void FusedAllreduce::run(Communicator& comm, const std::vector<at::Tensor>& tensors,
                         const AllreduceOptions& opts) {
  if (tensors.empty()) return;
  int64_t total = 0;
  for (const auto& t : tensors) {
    if (t.scalar_type() != tensors[0].scalar_type())
      throw CommError("fused allreduce: tensors of dtypes " + std::string(c10::toString(tensors[0].scalar_type())) +
                      " and " + c10::toString(t.scalar_type()) + " cannot share one buffer");
    total += t.numel();
  }
  if (!buffer_.defined() || buffer_.numel() != total || buffer_.scalar_type() != tensors[0].scalar_type() ||
      buffer_.device() != tensors[0].device())
    buffer_ = at::empty({total}, tensors[0].options());
  int64_t off = 0;
  for (const auto& t : tensors) {
    buffer_.narrow(0, off, t.numel()).copy_(t.reshape({-1}));
    off += t.numel();
  }
  comm.allreduce(buffer_, opts)->wait();
  off = 0;
  for (const auto& t : tensors) {
    t.view({-1}).copy_(buffer_.narrow(0, off, t.numel()));
    off += t.numel();
  }
}

}  // namespace tetra::collectives
