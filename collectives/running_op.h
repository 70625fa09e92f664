// The timeout of the op the calling thread is running for its communicator.
//
// The base hands a backend only the op's deadline, computed when the op starts; by the time
// the backend is called, the fingerprint exchange (Note [Health checks]) and the queue have
// used some of it. A backend that names the timeout in an error ("did not join within
// 200 ms") reads the one the op was given here, not what is left of the deadline.
#pragma once

#include "collectives/communicator.h"

namespace tetra::collectives {

// The op's own timeout while the base runs it on this thread; elsewhere, what is left
// until `deadline`, to the nearest millisecond.
Duration running_op_timeout(Deadline deadline);

// Sets running_op_timeout() for this thread while it lives (the base, around each op).
class RunningOpTimeout {
 public:
  explicit RunningOpTimeout(Duration timeout);
  ~RunningOpTimeout();
  RunningOpTimeout(const RunningOpTimeout&) = delete;
  RunningOpTimeout& operator=(const RunningOpTimeout&) = delete;

 private:
  Duration saved_;
};

}  // namespace tetra::collectives
