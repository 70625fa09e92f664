// The health wrapper: the checks a job asks for, around a backend that is only its
// transport (Note [Health checks] in communicator.h; c10d's ProcessGroupWrapper is the
// model).
//
// Note [Health wrapper]
// A HealthWrapper is a Communicator around another (its backend). Its own base issues,
// validates, records and queues every op as any communicator does; on its progress thread
// it runs the backend's primitives directly, with what the job asked for around them:
// - check: the fingerprint exchange (Note [Health checks]) before the op, through the
//   backend's own primitives, so a mismatch is found before the op can hang or mix up sums;
// - stall warnings: it registers with the watchdog (collectives/watchdog.h) while it lives,
//   and an op of it that times out says who has not joined, as a stall warning would.
// The backend's own queue stays empty and its thread idle: one hop, as without the
// wrapper. The wrapper takes the backend's recorder and waiters (a polling backend asks
// whether anyone waits) and orders its ops after the issuer's device work as the backend
// would. A split is the backend's split, wrapped the same way; so every communicator born
// of a wrapped world is checked.
//
// The factories wrap what they hand out (with_health): each backend's world, the local
// backend's groups, mpi's shared-memory split; the mesh wraps the hierarchical composite
// it builds with the check alone (its members are watched themselves).
#pragma once

#include "collectives/communicator.h"

namespace tetra::collectives {

class HealthWrapper final : public Communicator {
 public:
  // `watched`: registered with the watchdog (false for a composite whose members are).
  HealthWrapper(CommunicatorPtr backend, const HealthOptions& options, bool watched);
  ~HealthWrapper() override;

  std::string backend() const override { return backend_->backend(); }
  std::string refuses(const at::Tensor& t) const override { return backend_->refuses(t); }
  at::Device device() const override { return backend_->device(); }
  Communicator& transport() override { return backend_->transport(); }

 protected:
  void backend_allreduce(const at::Tensor& input, const at::Tensor& output, ReduceOp op, Deadline deadline) override;
  void backend_reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                              Deadline deadline) override;
  void backend_allgather(const at::Tensor& input, const at::Tensor& output, Deadline deadline) override;
  void backend_broadcast(const at::Tensor& tensor, int root, Deadline deadline) override;
  void backend_send(const at::Tensor& tensor, int dst, int tag, Deadline deadline) override;
  void backend_recv(const at::Tensor& tensor, int src, int tag, Deadline deadline) override;
  void backend_barrier(Deadline deadline) override;
  std::shared_ptr<Communicator> backend_split(int color, int key, const std::string& name,
                                              Deadline deadline) override;
  std::function<void(Deadline)> order_after_issuer(std::function<void(Deadline)> run) override {
    return backend_->order_after_issuer(std::move(run));
  }

 private:
  struct Print;
  // Runs `op` after the fingerprint exchange (when checking); a timeout in either says who
  // has not joined (when watched with stall warnings).
  template <typename Op>
  void checked(const Print& print, Op&& op, Deadline deadline);
  void fingerprint(const Print& print, Deadline deadline);
  void agree_collective(const int64_t* mine, Deadline deadline);
  void agree_recv(const int64_t* mine, int peer, int tag, Deadline deadline);

  CommunicatorPtr backend_;
  HealthOptions options_;
  bool watched_;
};

// What a factory hands out (Note [Health wrapper]): `backend` inside a HealthWrapper when
// `options` ask for a check or for stall warnings, else `backend` itself. `watched` false:
// the check alone, for a composite whose members are watched.
CommunicatorPtr with_health(CommunicatorPtr backend, const HealthOptions& options = health_options(),
                            bool watched = true);

}  // namespace tetra::collectives
