// The nccl backend: compiled wherever CUDA and NCCL are found; run where a GPU and a CUDA
// build of LibTorch are, skipped cleanly (with the reason) everywhere else.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "collectives/build_config.h"
#include "collectives/local.h"

#if TETRA_HAVE_NCCL
#include "collectives/nccl.h"
#endif

using namespace tetra::collectives;

namespace {

#if TETRA_HAVE_NCCL
// Skips the test, naming why NCCL cannot run on this machine.
#define TETRA_REQUIRE_NCCL()                                           \
  do {                                                                 \
    std::string why_ = nccl_unavailable_reason();                      \
    if (!why_.empty()) GTEST_SKIP() << "nccl cannot run here: " << why_; \
  } while (0)
#endif

}  // namespace

TEST(Nccl, AllOpsOnOneGpu) {
#if TETRA_HAVE_NCCL
  TETRA_REQUIRE_NCCL();
  run_local_ranks(1, [](int, Communicator& boot) {
    CommunicatorPtr c = nccl_from(boot, 0);
    EXPECT_EQ(c->backend(), "nccl");
    auto cuda = at::TensorOptions().device(at::kCUDA, 0);
    for (auto dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt, at::kLong, at::kByte}) {
      at::Tensor t = at::arange(7, cuda.dtype(dt));
      c->allreduce(t)->wait();
      EXPECT_TRUE(t.cpu().equal(at::arange(7, at::TensorOptions().dtype(dt)))) << c10::toString(dt);
    }
    at::Tensor in = at::ones({4}, cuda), out = at::zeros({4}, cuda);
    c->allreduce(in, out)->wait();
    EXPECT_EQ(out.sum().item<float>(), 4.0f);
    c->reduce_scatter(in, out)->wait();
    c->allgather(in, out)->wait();
    c->broadcast(in)->wait();
    c->barrier()->wait();
    // CPU tensors are refused with a clear error.
    EXPECT_THROW(c->allreduce(at::ones({2}))->wait(), tetra::CommError);
  });
#else
  GTEST_SKIP() << "built without the nccl backend (no CUDA toolkit or NCCL found)";
#endif
}
