// bench-collectives' fused allreduce (tools/bench/fused_allreduce.h): many tensors through
// one collective give what separate calls give, so what --fused times is the same work.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "collectives/error.h"
#include "collectives/local.h"
#include "tools/bench/fused_allreduce.h"

using namespace tetra::collectives;
using tetra::bench::FusedAllreduce;

TEST(Fusion, ManyTensorsInOneCallMatchSeparateCalls) {
  run_local_ranks(3, [](int rank, Communicator& comm) {
    std::vector<at::Tensor> fused, separate;
    for (int i = 0; i < 50; ++i) {
      at::Tensor t = at::arange(i % 7 + 1, at::kFloat).reshape({-1}) * (rank + 1) + i;
      fused.push_back(t.clone());
      separate.push_back(t.clone());
    }
    fused.push_back(at::empty({0}, at::kFloat));  // an empty tensor takes no room
    separate.push_back(at::empty({0}, at::kFloat));
    FusedAllreduce f;
    AllreduceOptions avg;
    avg.op = ReduceOp::kAvg;
    f.run(comm, fused, avg);
    f.run(comm, fused, avg);  // the buffer is reused; avg of equal values stays
    for (auto& t : separate) comm.allreduce(t, avg)->wait();
    for (size_t i = 0; i < fused.size(); ++i) EXPECT_TRUE(fused[i].equal(separate[i])) << i;
  });
}

TEST(Fusion, MixedDtypesAreRefused) {
  run_local_ranks(1, [](int, Communicator& comm) {
    FusedAllreduce f;
    EXPECT_THROW(f.run(comm, {at::ones({2}), at::ones({2}, at::kDouble)}), tetra::CommError);
  });
}
