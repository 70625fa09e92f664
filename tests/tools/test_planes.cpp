// The two planes (Note [Two planes], collectives/backends.h) and their test doubles, on
// thread ranks: the pretend device tells device bytes from host bytes as a GPU would (Note
// [Pretend device]); the device-plane double refuses host memory and the host-plane double
// device memory, naming the op, the group and the tensor; the mesh hands out both planes of
// each axis; a trainer over the two follows one process, and one given only the device
// plane has its control traffic refused at the first host tensor, as NCCL would refuse it.
// tests/tools/test_two_planes.cpp runs every strategy so under a real mpirun.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "collectives/backends.h"
#include "collectives/local.h"
#include "core/job_spec.h"
#include "core/mesh.h"
#include "tests/common/error_of.h"
#include "tests/common/numerics.h"
#include "tests/common/plane_double.h"

using namespace tetra;
using doubles::PretendDevice;
using testing_errors::error_of;

namespace {

class Planes : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { PretendDevice::install(); }
  static at::TensorOptions device() { return at::TensorOptions().device(PretendDevice::device()); }
};

}  // namespace

TEST_F(Planes, PretendDeviceTellsDeviceBytesFromHostBytes) {
  // Made on the pretend device, or by an op that reads device bytes: device memory.
  const at::Tensor a = at::ones({4, 4}, device()), b = at::ones({4, 4}, device());
  EXPECT_TRUE(PretendDevice::holds(a));
  EXPECT_TRUE(PretendDevice::holds(at::mm(a, b)));
  EXPECT_TRUE(PretendDevice::holds(a * 2));
  EXPECT_TRUE(PretendDevice::holds(a.narrow(0, 1, 2)));
  EXPECT_TRUE(PretendDevice::holds(a.new_empty({3})));
  EXPECT_TRUE(PretendDevice::holds(a.sum()));
  // Made from values, or on the host by name: host memory, even beside device tensors.
  EXPECT_FALSE(PretendDevice::holds(torch::tensor({1.0, 2.0})));
  EXPECT_FALSE(PretendDevice::holds(at::full({1}, 2.0, at::kDouble)));
  EXPECT_FALSE(PretendDevice::holds(at::zeros({4})));
  EXPECT_FALSE(PretendDevice::holds(at::empty({4}, a.options())));  // a.options() names the host here
  EXPECT_FALSE(PretendDevice::holds(a.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true)));
  // Moved to the device: the copy is device memory, the original stays host memory.
  const at::Tensor host = at::arange(8, at::kFloat);
  EXPECT_TRUE(PretendDevice::holds(host.to(PretendDevice::device())));
  EXPECT_FALSE(PretendDevice::holds(host));
  // Gradients of device parameters are device memory.
  at::Tensor w = at::randn({4, 4}, device()).requires_grad_(true);
  at::mm(w, b).sum().backward();
  EXPECT_TRUE(PretendDevice::holds(w.grad()));
}

TEST_F(Planes, FreedDeviceBytesComeBackAsHostMemory) {
  void* where = nullptr;
  {
    at::Tensor d = at::empty({1 << 16}, device());
    where = d.data_ptr();
    ASSERT_TRUE(PretendDevice::holds(d));
  }
  // The allocator hands the freed block out again (or another): either way it is host memory now.
  at::Tensor h = at::empty({1 << 16});
  EXPECT_FALSE(PretendDevice::holds(h)) << (h.data_ptr() == where ? "the same block" : "another block");
}

TEST_F(Planes, EachDoubleRefusesTheOtherPlanesTensorsNamingTheOpAndGroup) {
  collectives::run_local_ranks(2, [&](int r, collectives::Communicator& world) {
    auto data = doubles::PlaneDouble::wrap(world.shared_from_this(), doubles::Plane::kDevice);
    auto host = doubles::PlaneDouble::wrap(world.split(0, r, "host"), doubles::Plane::kHost);
    at::Tensor loss = at::full({1}, 1.0 + r, at::kDouble);
    const std::string e = error_of([&] { data->allreduce(loss)->wait(); });
    EXPECT_NE(e.find("allreduce sum: the input tensor Double[1] on cpu: the device-plane double carries device tensors "
                     "only (as nccl does), and this one is host memory"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("(device plane)"), std::string::npos) << e;
    host->allreduce(loss)->wait();
    EXPECT_EQ(loss.item<double>(), 3.0);
    at::Tensor grad = at::full({3}, 1.0 + r, device());
    data->allreduce(grad)->wait();
    EXPECT_EQ(grad[0].item<double>(), 3.0);
    const std::string h = error_of([&] { host->broadcast(grad)->wait(); });
    EXPECT_NE(h.find("the host-plane double carries host tensors only"), std::string::npos) << h;
    // A refusal is the op's own failure: the group goes on.
    data->barrier()->wait();
    host->barrier()->wait();
  });
}

TEST_F(Planes, TheMeshHandsOutBothPlanesOfEachAxis) {
  collectives::run_local_ranks(4, [&](int r, collectives::Communicator& world) {
    auto data = doubles::PlaneDouble::wrap(world.shared_from_this(), doubles::Plane::kDevice);
    auto host = doubles::PlaneDouble::wrap(world.split(0, r, "host"), doubles::Plane::kHost);
    core::Mesh mesh(data, core::make_mesh_spec({{"pipeline", 2}, {"data", 2}}), nullptr, host);
    for (const char* axis : {"pipeline", "data", "tensor", "replica"}) {
      EXPECT_EQ(mesh.axis(axis)->backend(), "device-double") << axis;
      EXPECT_EQ(mesh.host(axis)->backend(), "host-double") << axis;
      EXPECT_EQ(mesh.axis(axis)->size(), mesh.host(axis)->size()) << axis;
      EXPECT_EQ(mesh.axis(axis)->rank(), mesh.host(axis)->rank()) << axis;
    }
    EXPECT_EQ(mesh.host_world(), host);
    // One world for both: the same groups, nothing split twice.
    core::Mesh one(world.shared_from_this(), core::make_mesh_spec({{"data", 4}}));
    EXPECT_EQ(one.host("data"), one.axis("data"));
  });
}

TEST_F(Planes, AHostPlaneOfOtherRanksIsRefused) {
  collectives::run_local_ranks(2, [&](int r, collectives::Communicator& world) {
    auto host = world.split(0, 1 - r, "reversed");  // rank r of the world is rank 1 - r here
    const std::string e = error_of([&] { core::Mesh(world.shared_from_this(), core::make_mesh_spec({{"data", 2}}), nullptr, host); });
    EXPECT_NE(e.find("is not the world's processes"), std::string::npos) << e;
  });
}

TEST_F(Planes, TheLaunchPicksTheHostBackend) {
  collectives::LaunchInfo l;
  l.launcher = "mpirun";
  EXPECT_EQ(collectives::host_backend_for(l), "mpi");
  l.launcher = "torchrun";
  EXPECT_EQ(collectives::host_backend_for(l), "gloo");
  l.launcher = "override";  // TETRA_RANK alone: no MPI to start (the suite runs outside mpirun)
  if (!std::getenv("OMPI_COMM_WORLD_RANK") && !std::getenv("PMIX_RANK") && !std::getenv("PMI_RANK")) {
    EXPECT_EQ(collectives::host_backend_for(l), "gloo");
  }
}

namespace {

const char* const kJob = R"(
model: {type: mlp, hidden: [16], dropout: 0.2}
data: {type: synthetic, shape: [12], classes: 3, train_samples: 256, test_samples: 32, batch_size: 8}
optimizer: {type: adamw, lr: 1.0e-2, clip_grad_norm: 0.5}
train: {max_steps: 4, seed: 2, threads: 1, eval_every: 2}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

}  // namespace

TEST_F(Planes, ATrainerOverBothPlanesFollowsOneProcess) {
  const numerics::Outcome ref = numerics::run_single(kJob, {});
  const core::JobSpec spec = numerics::job(kJob, {"mesh.data=2", "zero.stage=2"});
  std::vector<numerics::Outcome> got(2);
  collectives::run_local_ranks(2, [&](int r, collectives::Communicator& world) {
    core::TrainerOptions o;
    o.world = doubles::PlaneDouble::wrap(world.shared_from_this(), doubles::Plane::kDevice);
    o.host = doubles::PlaneDouble::wrap(world.split(0, r, "host"), doubles::Plane::kHost);
    o.device = PretendDevice::device();
    core::Trainer t(spec, o);
    got[static_cast<size_t>(r)].result = t.run();
    got[static_cast<size_t>(r)].weights = t.weights();
  });
  numerics::expect_follows(ref, got[0], 1e-5, "data 2, zero 2, adamw clipped, two planes");
}

TEST_F(Planes, WithoutAHostPlaneTheControlTrafficIsRefused) {
  // What a cuda job over NCCL alone would do: its first host tensor on the device plane.
  const core::JobSpec spec = numerics::job(kJob, {"mesh.data=2"});
  std::vector<std::string> errors(2);
  collectives::run_local_ranks(2, [&](int r, collectives::Communicator& world) {
    core::TrainerOptions o;
    o.world = doubles::PlaneDouble::wrap(world.shared_from_this(), doubles::Plane::kDevice);
    o.device = PretendDevice::device();
    errors[static_cast<size_t>(r)] = error_of([&] {
      core::Trainer t(spec, o);
      t.run();
    });
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("and this one is host memory"), std::string::npos) << e;
}
