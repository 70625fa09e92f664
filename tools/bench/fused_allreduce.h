// Fusion by copying: many small tensors packed into one buffer, reduced by one allreduce,
// unpacked (Horovod's fusion buffer). 200 allreduces of 4 KiB cost 200 latencies; one of
// 800 KiB costs one.
//
// bench-collectives --fused times it against separate calls, which is what it is kept for:
// training never copies gradients into a fusion buffer, since core's bucketer makes each
// parameter's .grad a view of its bucket (Note [Gradient buckets]), so data_parallel and
// ZeRO get the one latency per bucket without the two copies. Written over the
// Communicator interface, so every backend is timed alike.
#pragma once

#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/error.h"

namespace tetra::bench {

class FusedAllreduce {
 public:
  // Reduces every tensor in place (all of one dtype, contiguous) with one allreduce.
  // Blocking. The pack buffer is kept for the next call of the same total size.
  void run(collectives::Communicator& comm, const std::vector<at::Tensor>& tensors,
           const collectives::AllreduceOptions& opts = {}) {
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
    // On the CPU, pack and unpack with memcpy: an ATen copy costs about a microsecond of
    // dispatch, which for 200 small tensors is most of the time saved by fusing.
    const bool cpu = buffer_.is_cpu();
    const size_t esz = buffer_.element_size();
    auto* base = static_cast<char*>(buffer_.data_ptr());
    int64_t off = 0;
    for (const auto& t : tensors) {
      if (t.numel() == 0) continue;  // an empty tensor's data_ptr() is null: memcpy may not see it
      if (cpu && t.is_contiguous())
        std::memcpy(base + off * esz, t.data_ptr(), t.numel() * esz);
      else
        buffer_.narrow(0, off, t.numel()).copy_(t.reshape({-1}));
      off += t.numel();
    }
    comm.allreduce(buffer_, opts)->wait();
    off = 0;
    for (const auto& t : tensors) {
      if (t.numel() == 0) continue;
      if (cpu && t.is_contiguous())
        std::memcpy(t.data_ptr(), base + off * esz, t.numel() * esz);
      else
        t.view({-1}).copy_(buffer_.narrow(0, off, t.numel()));
      off += t.numel();
    }
  }

 private:
  at::Tensor buffer_;
};

}  // namespace tetra::bench
