// The two planes' test doubles (Note [Two planes], collectives/backends.h): a communicator
// that wraps another and carries only one kind of tensor, as a GPU job's backends do.
//   Plane::kDevice  what NCCL is to a cuda job: it refuses host memory.
//   Plane::kHost    what Debian's Open MPI is beside it: it refuses device memory.
// Device memory is Note [Pretend device]'s (tests/common/pretend_device.h): the job trains
// on cpu:0 and the double asks PretendDevice::holds of each tensor. The refusal is the base
// class's check (Communicator::refuses), before the op is queued, so the error names the op,
// the group and the tensor exactly as NCCL's would. Everything else goes to the wrapped
// communicator, op for op, with the time left of its deadline; its splits are doubles too.
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

#include "collectives/backends.h"
#include "collectives/communicator.h"
#include "collectives/health.h"
#include "tests/common/pretend_device.h"

namespace tetra::doubles {

enum class Plane { kDevice, kHost };

class PlaneDouble final : public collectives::Communicator {
 public:
  static collectives::CommunicatorPtr wrap(collectives::CommunicatorPtr inner, Plane plane) {
    const std::string name = inner->name() + (plane == Plane::kDevice ? " (device plane)" : " (host plane)");
    // Checked as a backend's world is (Note [Health wrapper]); its stalls are the wrapped
    // communicator's, watched there.
    return collectives::with_health(std::shared_ptr<PlaneDouble>(new PlaneDouble(std::move(inner), plane, name)),
                                    collectives::health_options(), /*watched=*/false);
  }
  ~PlaneDouble() override { stop_progress_thread(); }  // queued ops use inner_

  std::string backend() const override { return plane_ == Plane::kDevice ? "device-double" : "host-double"; }
  at::Device device() const override { return plane_ == Plane::kDevice ? PretendDevice::device() : at::Device(at::kCPU); }
  std::string refuses(const at::Tensor& t) const override {
    const bool device = PretendDevice::holds(t);
    if (plane_ == Plane::kDevice && !device)
      return "the device-plane double carries device tensors only (as nccl does), and this one is host memory";
    if (plane_ == Plane::kHost && device)
      return "the host-plane double carries host tensors only (as Debian's Open MPI does), and this one is device memory";
    return "";
  }

 protected:
  void backend_allreduce(const at::Tensor& in, const at::Tensor& out, collectives::ReduceOp op,
                         collectives::Deadline d) override {
    run(d, [&](collectives::Duration t) { return inner_->allreduce(in, out, {op, t}); });
  }
  void backend_reduce_scatter(const at::Tensor& in, const at::Tensor& out, collectives::ReduceOp op,
                              collectives::Deadline d) override {
    run(d, [&](collectives::Duration t) { return inner_->reduce_scatter(in, out, {op, t}); });
  }
  void backend_allgather(const at::Tensor& in, const at::Tensor& out, collectives::Deadline d) override {
    run(d, [&](collectives::Duration t) { return inner_->allgather(in, out, {t}); });
  }
  void backend_broadcast(const at::Tensor& t, int root, collectives::Deadline d) override {
    run(d, [&](collectives::Duration left) { return inner_->broadcast(t, {root, left}); });
  }
  void backend_send(const at::Tensor& t, int dst, int tag, collectives::Deadline d) override {
    run(d, [&](collectives::Duration left) { return inner_->send(t, dst, {tag, left}); });
  }
  void backend_recv(const at::Tensor& t, int src, int tag, collectives::Deadline d) override {
    run(d, [&](collectives::Duration left) { return inner_->recv(t, src, {tag, left}); });
  }
  void backend_barrier(collectives::Deadline d) override {
    run(d, [&](collectives::Duration t) { return inner_->barrier({t}); });
  }
  std::shared_ptr<collectives::Communicator> backend_split(int color, int key, const std::string& name,
                                                           collectives::Deadline d) override {
    collectives::CommunicatorPtr sub = inner_->split(color, key, name, left(d));
    return sub ? std::shared_ptr<PlaneDouble>(new PlaneDouble(std::move(sub), plane_, name)) : nullptr;
  }

 private:
  PlaneDouble(collectives::CommunicatorPtr inner, Plane plane, const std::string& name)
      : Communicator(inner->rank(), inner->size(), name), inner_(std::move(inner)), plane_(plane) {
    set_identity(inner_->group()->identity + (plane == Plane::kDevice ? "/device" : "/host"), inner_->group()->agreed);
  }
  static collectives::Duration left(collectives::Deadline d) {
    return std::max(std::chrono::ceil<collectives::Duration>(d - collectives::Clock::now()), collectives::Duration(0));
  }
  template <typename Issue>
  void run(collectives::Deadline d, Issue&& issue) {
    issue(left(d))->wait(left(d));
  }

  collectives::CommunicatorPtr inner_;
  Plane plane_;
};

// A backend entry for the device double: carries no host tensors, so create_planes builds
// the launch's host backend beside it (Note [Two planes]) and wraps a split of it.
inline collectives::BackendEntry device_double_backend() {
  collectives::BackendEntry e;
  e.name = "device-double";
  e.description = "the device plane's double (tests/common/plane_double.h)";
  e.carries_host = false;
  e.unavailable = [] { return std::string(); };
  e.create = [](const collectives::LaunchInfo&, const collectives::WorldOptions& options,
                const collectives::CommunicatorPtr& host) -> collectives::CommunicatorPtr {
    // Its own communicator over the same processes, as NCCL's is beside the host's.
    collectives::CommunicatorPtr own = host->split(0, host->rank(), "device-double world", options.timeout);
    return PlaneDouble::wrap(std::move(own), Plane::kDevice);
  };
  return e;
}

}  // namespace tetra::doubles
