// Communicator: a group of ranks and asynchronous collectives on tensors.
//
// Note [Communicator shape]
// In c10d's shape: every op takes one plain options struct (with a timeout) and returns
// a Work to wait on; new knobs become fields, signatures do not grow. The public ops are
// non-virtual: they validate their arguments here, once, so that a bad call is the same
// clear error on every backend, then queue the op on the communicator's own progress
// thread. Ops issued on one communicator run there one at a time, in issue order, so a
// caller (the gradient bucketer) can go on computing while they run. A backend
// implements only the blocking primitives (the Backend* hooks below), each handed a
// deadline; it must return or throw TimeoutError by then, never hang.
//
// After an op fails the communicator is broken: the failed Work rethrows the error and
// every later op fails at once with the same cause (peers may be mid-collective; going
// on would deadlock or mix up messages).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/error.h"
#include "collectives/flight_recorder.h"

namespace tetra::collectives {

using Duration = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline constexpr Duration kDefaultTimeout = std::chrono::seconds(300);

enum class ReduceOp { kSum, kAvg, kMin, kMax, kProd };
const char* to_string(ReduceOp op);

struct AllreduceOptions {
  ReduceOp op = ReduceOp::kSum;
  Duration timeout = kDefaultTimeout;
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  Duration timeout = kDefaultTimeout;
};
struct AllgatherOptions {
  Duration timeout = kDefaultTimeout;
};
struct BroadcastOptions {
  int root = 0;
  Duration timeout = kDefaultTimeout;
};
struct SendOptions {
  int tag = 0;  // >= 0; a recv matches a send of the same (source, tag)
  Duration timeout = kDefaultTimeout;
};
struct RecvOptions {
  int tag = 0;
  Duration timeout = kDefaultTimeout;
};
struct BarrierOptions {
  Duration timeout = kDefaultTimeout;
};

// The handle of one queued op.
class Work {
 public:
  // `waiters` counts the callers blocked on any op of the work's communicator.
  explicit Work(std::string what, std::shared_ptr<std::atomic<int>> waiters = nullptr)
      : what_(std::move(what)), waiters_(std::move(waiters)) {}
  bool done() const;
  // Blocks until the op finished; rethrows its error (CommError, TimeoutError, ...).
  void wait();
  // As wait(), but throws TimeoutError naming the op when it has not finished in time.
  void wait(Duration timeout);
  std::exception_ptr exception() const;
  const std::string& what() const { return what_; }

  // When the progress thread began running the op and when it finished (for timelines;
  // a default time_point until then). Read them after wait().
  Clock::time_point started_at() const;
  Clock::time_point finished_at() const;

  // For backends: the op begins running; complete it (with an error, or nullptr for success).
  void start();
  void finish(std::exception_ptr error = nullptr);

 private:
  std::string what_;
  std::shared_ptr<std::atomic<int>> waiters_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  Clock::time_point started_{}, finished_{};
};
using WorkPtr = std::shared_ptr<Work>;

// Note [Traffic counters]
// Every communicator counts the payload its ops are handed, by kind, at the moment they
// are issued (after validation): allreduce and broadcast the tensor's bytes,
// reduce_scatter its input (the whole buffer), allgather its output (the whole buffer),
// send and recv the tensor's bytes. `sent` turns those into the bytes this rank puts on
// the wire under the bandwidth-optimal algorithms, the convention `train --dry-run`
// prints (n = the group's size, each op rounded down to whole bytes):
//   allreduce 2(n-1)/n x B (ring: reduce-scatter then allgather), reduce_scatter and
//   allgather (n-1)/n x B, broadcast (n-1)/n x B (pipelined: each of the n-1 links
//   carries B, shared out over the n ranks), send B, recv 0 (the sender counts it).
// A communicator made by split() adds its ops to its parent's count too, so an axis of
// the mesh counts every link cut from it (the pipeline's point-to-point pairs, ZeRO-3's
// gather communicator). Counting costs one short lock per op.
// Time is counted beside the bytes: busy_seconds() is the wall time during which at least
// one op of the communicator (or of one split from it) was running on its progress thread
// — the union of the ops' run intervals, so overlapping ops (a pipeline's prefetched
// receive beside a send, two pairs of one axis) count once and an axis is never busy for
// longer than the run. It includes waiting for a late peer: it is the time the link was
// in use or awaited, which is what "communication time per axis" reports (the trainer's
// comm_ms). Two more short locks per op.
struct Traffic {
  enum Kind { kAllreduce, kReduceScatter, kAllgather, kBroadcast, kSend, kRecv, kKinds };
  int64_t payload[kKinds] = {};  // bytes handed to ops of each kind
  int64_t count[kKinds] = {};    // ops of each kind (a cost model's latency terms)
  int64_t ops = 0;
  int64_t sent = 0;  // this rank's wire bytes (the convention above)
  static const char* name(Kind k);
  // This rank's wire bytes for one op of `bytes` on a group of n.
  static int64_t sent_by(Kind k, int64_t bytes, int n);
  // Adds one op.
  void record(Kind k, int64_t bytes, int n);
  Traffic& operator+=(const Traffic& o);
  Traffic operator-(const Traffic& o) const;
  bool operator==(const Traffic& o) const;
  bool operator!=(const Traffic& o) const { return !(*this == o); }
  // "allreduce 8 B, send 1.0 MiB, ... = 1.2 MiB sent in 12 ops"
  std::string str() const;
};

// Note [Health checks]
// Process-wide settings every communicator takes when it is made (tetra::run sets them
// from the job's collectives section before the world exists). The checks themselves are
// not the backend's: a factory hands out its backend inside a HealthWrapper
// (collectives/health.h) when these ask for a check or for stall warnings, as c10d wraps a
// backend in its ProcessGroupWrapper, so that a backend is only its transport.
// - check: before each op the group agrees on (op, dtype, shape, sequence number) through
//   the backend's own primitives, out of the op's sight: collectives allgather a small
//   fingerprint, a send is preceded by its fingerprint, which the receiver compares with
//   its own (on the same tag: messages of one sender and tag arrive in order). A mismatch
//   is a CommError on the ranks that see it, naming the op and the ranks that differ,
//   instead of a hang or silently wrong sums. Default: the environment variable
//   TETRA_COLLECTIVES_CHECK (1/on), else off.
// - stall_warning: an op that has run this long gets a warning naming who has not joined
//   (collectives/watchdog.h), repeated at a growing interval until its timeout, and an op
//   that times out says the same in its error.
// - timeout: the timeout of an op whose options leave it at kDefaultTimeout (the job's
//   collectives.timeout_s), and of a split's set-up. Every communicator takes this one,
//   wrapped or not.
struct HealthOptions {
  bool check = false;
  Duration stall_warning = std::chrono::seconds(60);
  Duration timeout = kDefaultTimeout;
};
HealthOptions health_options();
void set_health_options(const HealthOptions& options);
// Sets the options for the communicators made while it lives (tests of one backend's own
// checks turn the fingerprints off this way).
class ScopedHealthOptions {
 public:
  explicit ScopedHealthOptions(const HealthOptions& options) : saved_(health_options()) { set_health_options(options); }
  ~ScopedHealthOptions() { set_health_options(saved_); }
  ScopedHealthOptions(const ScopedHealthOptions&) = delete;
  ScopedHealthOptions& operator=(const ScopedHealthOptions&) = delete;

 private:
  HealthOptions saved_;
};

// What one member of a group has done on it, for stall and timeout diagnosis.
struct MemberProgress {
  std::shared_ptr<const GroupInfo> group;
  std::string owner;  // the member's recorder owner ("rank 3")
  std::string where;  // "host h, pid p"
  int64_t collectives_started = 0;                    // the highest sequence number begun
  std::vector<int64_t> sends_started, recvs_started;  // how many began, per peer (group rank)
  bool running = false;
  OpRecord current;  // the op running now (when running)
  bool has_last = false;
  OpRecord last;     // the newest op it started (maybe current)
};
nlohmann::json to_json(const MemberProgress& m);
MemberProgress member_progress_from_json(const nlohmann::json& j);

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // "mpi", "local", "nccl", "gloo".
  virtual std::string backend() const = 0;
  // "mpi world", "data (of mesh pipeline=2 x data=2)": what the group is, for messages.
  const std::string& name() const { return name_; }

  // In place: every rank ends with the reduction of all ranks' `tensor`.
  WorkPtr allreduce(at::Tensor tensor, const AllreduceOptions& opts = {});
  // Out of place: `output` (same shape and dtype as `input`) receives the reduction.
  WorkPtr allreduce(at::Tensor input, at::Tensor output, const AllreduceOptions& opts = {});
  // input holds size() equal chunks; rank r receives the reduction of chunk r in output.
  // input.numel() must equal size() * output.numel().
  WorkPtr reduce_scatter(at::Tensor input, at::Tensor output, const ReduceScatterOptions& opts = {});
  // output.numel() == size() * input.numel(); rank r's input lands in chunk r.
  WorkPtr allgather(at::Tensor input, at::Tensor output, const AllgatherOptions& opts = {});
  WorkPtr broadcast(at::Tensor tensor, const BroadcastOptions& opts = {});
  WorkPtr send(at::Tensor tensor, int dst, const SendOptions& opts = {});
  WorkPtr recv(at::Tensor tensor, int src, const RecvOptions& opts = {});
  WorkPtr barrier(const BarrierOptions& opts = {});

  // Collective over this communicator: ranks with the same color form a new
  // communicator, ordered by (key, rank). color < 0 joins none and gets nullptr.
  // Blocking (it waits for the ops queued before it).
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name = "",
                                      Duration timeout = kDefaultTimeout);

  // Waits for every op queued so far (and rethrows the first error among them).
  void synchronize();

  // What this communicator and every one split from it were handed so far
  // (Note [Traffic counters]).
  Traffic traffic() const;
  // Seconds during which an op of this communicator or of one split from it was running
  // (Note [Traffic counters]), up to now.
  double busy_seconds() const;

  // Dtypes every backend carries: f32 f64 bf16 f16 i32 i64 u8.
  static bool supported(at::ScalarType t);

  // Note [Two planes] (collectives/backends.h): "" when this backend's ops take `t` where
  // it lives, else why not ("the nccl backend carries CUDA tensors only, and this one is on
  // cpu ..."). The public ops ask before they queue anything, so a tensor on the wrong
  // plane is the same CommError, naming the op and the group, on every backend. Default:
  // every tensor.
  virtual std::string refuses(const at::Tensor& t) const { return ""; }
  // Where a tensor this group carries lives: a tensor made for the group's own bookkeeping
  // (a split's colors, a shape check, a fingerprint with no tensor beside it, a string's
  // bytes) is made there. The CPU by default; nccl's GPU.
  virtual at::Device device() const { return at::kCPU; }

  // For a backend polling an op: whether a caller is blocked in wait() on an op of this
  // communicator now (the running one, or one queued behind it, which needs it done).
  // Nobody waiting means the caller computes meanwhile: poll politely, do not take its
  // core. (Note [Awaited and background polls] in mpi.h.)
  bool awaited() const { return waiters_->load(std::memory_order_relaxed) > 0; }

  // Who this group is, the same on every member when agreed (Note [Flight recorder]).
  std::shared_ptr<const GroupInfo> group() const;
  // This rank's recorder (shared with the communicators split from the same root).
  const std::shared_ptr<FlightRecorder>& recorder() const { return recorder_; }
  // Where this member is on this group now.
  MemberProgress progress() const;

  // The backend under any wrapper (Note [Health checks]): itself for a backend. For code
  // that needs its backend's own calls (mpi_split_shared, abort_local_group).
  virtual Communicator& transport() { return *this; }

 protected:
  Communicator(int rank, int size, std::string name);
  // Roots: the identity every member of this group agrees on ("mpi:<job>"), or
  // agreed = false for a group whose identity is local to this process. Call from the
  // backend's factory before any op is issued. A split's identity is derived.
  void set_identity(std::string identity, bool agreed);
  // Records into `recorder` (another communicator's) instead of this one's own: a
  // composite (hierarchical) records with the rank it serves.
  void share_recorder(std::shared_ptr<FlightRecorder> recorder);
  // The op the progress thread runs now, as recorded (false when none is recorded): for
  // a wrapper that runs its backend's primitives inside it.
  bool running_op(OpRecord& out) const;

  // Blocking primitives, run on the progress thread, one at a time. Tensors are
  // validated (contiguous, supported dtype, sizes agree locally). For in-place
  // allreduce, input and output are the same tensor. Each must finish by `deadline` or
  // throw TimeoutError.
  virtual void backend_allreduce(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                                 Deadline deadline) = 0;
  virtual void backend_reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                      ReduceOp op, Deadline deadline) = 0;
  virtual void backend_allgather(const at::Tensor& input, const at::Tensor& output,
                                 Deadline deadline) = 0;
  virtual void backend_broadcast(const at::Tensor& tensor, int root, Deadline deadline) = 0;
  virtual void backend_send(const at::Tensor& tensor, int dst, int tag, Deadline deadline) = 0;
  virtual void backend_recv(const at::Tensor& tensor, int src, int tag, Deadline deadline) = 0;
  virtual void backend_barrier(Deadline deadline) = 0;
  virtual std::shared_ptr<Communicator> backend_split(int color, int key, const std::string& name,
                                                      Deadline deadline) = 0;

  // Backends call this from their destructor before tearing down their own state.
  void stop_progress_thread();

  // Called on the issuing thread as an op is issued, with what the progress thread will
  // run: a backend that runs ops on a device stream of its own returns `run` ordered after
  // the device work the issuing thread queued before it (Note [Streams] in nccl.cpp).
  // Default: `run` as it is (host backends: the issuer's tensors are ready when it issues).
  virtual std::function<void(Deadline)> order_after_issuer(std::function<void(Deadline)> run) { return run; }

 private:
  // The wrapper (Note [Health checks]) runs its backend's primitives and shares its
  // waiters and stream ordering.
  friend class HealthWrapper;

  // Issues an op: records it with its sequence number and queues it.
  struct OpDesc {
    const char* kind;  // "allreduce", ...
    std::string op;    // "allreduce sum"
    int peer = -1;
    int tag = 0;
    const at::Tensor* tensor = nullptr;
  };
  WorkPtr issue(OpDesc d, std::function<void(Deadline)> fn, Duration timeout);
  WorkPtr enqueue(std::string what, std::function<void(Deadline)> fn, Duration timeout);
  void begin(uint64_t record);  // the progress thread starts / ends a recorded op
  void end(uint64_t record);
  // Throws the CommError of Note [Two planes] when refuses(t) says why.
  void check_carried(const std::string& op, const char* which, const at::Tensor& t) const;
  void count(Traffic::Kind kind, const at::Tensor& t);
  struct Counter {
    std::mutex mu;
    Traffic traffic;
    std::shared_ptr<Counter> parent;  // the communicator this one was split from
    int running = 0;                  // ops running now, here or in a split
    Clock::time_point busy_since{};   // when `running` last left 0
    double busy_s = 0;                // closed busy intervals
  };
  void busy(bool begin);  // an op starts (true) or ends running: every counter up the chain
  std::shared_ptr<Counter> counter_ = std::make_shared<Counter>();
  void progress_loop();

  int rank_, size_;
  std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Item {
    WorkPtr work;
    std::function<void(Deadline)> fn;
    Duration timeout;
    uint64_t record = 0;  // its flight-recorder entry (0: none)
  };
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::exception_ptr broken_;  // the first failure; later ops fail fast with it
  std::shared_ptr<std::atomic<int>> waiters_ = std::make_shared<std::atomic<int>>(0);
  // Flight recorder (Note [Flight recorder]) and the default op timeout (Note [Health checks]).
  std::shared_ptr<FlightRecorder> recorder_;
  mutable std::shared_ptr<const GroupInfo> group_;  // guarded by mu_ (set by the factory, else on first use)
  Duration default_timeout_ = health_options().timeout;
  int64_t collectives_ = 0, splits_ = 0;          // issued so far (issue order)
  std::map<std::pair<int, int>, int64_t> sends_, recvs_;  // issued per (peer, tag)
  struct Running {
    int64_t collectives_started = 0;
    std::vector<int64_t> sends_started, recvs_started;
    uint64_t current = 0, last = 0;  // record ids
  } run_;  // guarded by mu_
  std::thread thread_;
};
using CommunicatorPtr = std::shared_ptr<Communicator>;

// Collective: `root`'s `text` on every rank of `group` (what a rank passes elsewhere is
// ignored): its length, then its bytes (none when empty), as two broadcasts.
std::string broadcast_string(Communicator& group, const std::string& text, const BroadcastOptions& options = {});

// Elementwise reduction of `src` into `dst` (same dtype and numel, contiguous): the one
// arithmetic kernel the shared-memory and user-op paths use. kAvg reduces as kSum (the
// caller divides once at the end with finish_average).
void reduce_into(const at::Tensor& dst, const at::Tensor& src, ReduceOp op);
// Divides a reduced tensor by the group size when op is kAvg (no-op otherwise).
void finish_average(const at::Tensor& t, ReduceOp op, int size);

}  // namespace tetra::collectives
