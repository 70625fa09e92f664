#include "collectives/communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "collectives/running_op.h"
#include "hardware/env.h"

namespace tetra::collectives {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProd: return "prod";
  }
  return "?";
}

// ---- health (Note [Health checks]) ----------------------------------------------------

namespace {
std::mutex& health_mu() {
  static std::mutex mu;
  return mu;
}
HealthOptions& health_slot() {
  static HealthOptions h = [] {
    HealthOptions o;
    o.check = env::flag(env::kCollectivesCheck);
    return o;
  }();
  return h;
}
}  // namespace

HealthOptions health_options() {
  std::lock_guard<std::mutex> lock(health_mu());
  return health_slot();
}

void set_health_options(const HealthOptions& options) {
  std::lock_guard<std::mutex> lock(health_mu());
  health_slot() = options;
}

// ---- traffic (Note [Traffic counters]) ------------------------------------------------

const char* Traffic::name(Kind k) {
  static const char* names[] = {"allreduce", "reduce_scatter", "allgather", "broadcast", "send", "recv"};
  return k >= 0 && k < kKinds ? names[k] : "?";
}

int64_t Traffic::sent_by(Kind k, int64_t bytes, int n) {
  switch (k) {
    case kAllreduce: return n > 1 ? 2 * (n - 1) * bytes / n : 0;
    case kReduceScatter:
    case kAllgather:
    case kBroadcast: return n > 1 ? (n - 1) * bytes / n : 0;
    case kSend: return bytes;
    default: return 0;
  }
}

void Traffic::record(Kind k, int64_t bytes, int n) {
  payload[k] += bytes;
  count[k] += 1;
  ops += 1;
  sent += sent_by(k, bytes, n);
}

Traffic& Traffic::operator+=(const Traffic& o) {
  for (int k = 0; k < kKinds; ++k) {
    payload[k] += o.payload[k];
    count[k] += o.count[k];
  }
  ops += o.ops;
  sent += o.sent;
  return *this;
}

Traffic Traffic::operator-(const Traffic& o) const {
  Traffic d = *this;
  for (int k = 0; k < kKinds; ++k) {
    d.payload[k] -= o.payload[k];
    d.count[k] -= o.count[k];
  }
  d.ops -= o.ops;
  d.sent -= o.sent;
  return d;
}

bool Traffic::operator==(const Traffic& o) const {
  for (int k = 0; k < kKinds; ++k)
    if (payload[k] != o.payload[k] || count[k] != o.count[k]) return false;
  return ops == o.ops && sent == o.sent;
}

std::string Traffic::str() const {
  std::ostringstream os;
  for (int k = 0; k < kKinds; ++k)
    if (payload[k]) os << name(static_cast<Kind>(k)) << " " << payload[k] << " B, ";
  os << sent << " B sent in " << ops << " op" << (ops == 1 ? "" : "s");
  return os.str();
}

Traffic Communicator::traffic() const {
  std::lock_guard<std::mutex> lock(counter_->mu);
  return counter_->traffic;
}

double Communicator::busy_seconds() const {
  std::lock_guard<std::mutex> lock(counter_->mu);
  double s = counter_->busy_s;
  if (counter_->running > 0) s += std::chrono::duration<double>(Clock::now() - counter_->busy_since).count();
  return s;
}

void Communicator::busy(bool begin) {
  const Clock::time_point now = Clock::now();
  for (Counter* c = counter_.get(); c; c = c->parent.get()) {
    std::lock_guard<std::mutex> lock(c->mu);
    if (begin) {
      if (c->running++ == 0) c->busy_since = now;
    } else if (--c->running == 0) {
      c->busy_s += std::chrono::duration<double>(now - c->busy_since).count();
    }
  }
}

void Communicator::count(Traffic::Kind kind, const at::Tensor& t) {
  const int64_t bytes = static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
  for (Counter* c = counter_.get(); c; c = c->parent.get()) {
    std::lock_guard<std::mutex> lock(c->mu);
    c->traffic.record(kind, bytes, size_);  // the op's own group size, also in a parent's count
  }
}

// ---- Work --------------------------------------------------------------------------

bool Work::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

namespace {
// Counts this caller among the communicator's waiters while it blocks.
class Waiting {
 public:
  explicit Waiting(std::atomic<int>* n) : n_(n) {
    if (n_) n_->fetch_add(1, std::memory_order_relaxed);
  }
  ~Waiting() {
    if (n_) n_->fetch_sub(1, std::memory_order_relaxed);
  }
  Waiting(const Waiting&) = delete;
  Waiting& operator=(const Waiting&) = delete;

 private:
  std::atomic<int>* n_;
};
}  // namespace

void Work::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  Waiting waiting(done_ ? nullptr : waiters_.get());
  cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

void Work::wait(Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  Waiting waiting(done_ ? nullptr : waiters_.get());
  if (!cv_.wait_for(lock, timeout, [&] { return done_; }))
    throw TimeoutError(what_ + ": not finished after " + std::to_string(timeout.count()) + " ms");
  if (error_) std::rethrow_exception(error_);
}

std::exception_ptr Work::exception() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

Clock::time_point Work::started_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return started_;
}

Clock::time_point Work::finished_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_;
}

void Work::start() {
  std::lock_guard<std::mutex> lock(mu_);
  started_ = Clock::now();
}

void Work::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = Clock::now();
    if (started_ == Clock::time_point{}) started_ = finished_;
    done_ = true;
    error_ = error;
  }
  cv_.notify_all();
}

// ---- validation (the same words on every backend) -----------------------------------

bool Communicator::supported(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf:
    case at::kInt: case at::kLong: case at::kByte:
      return true;
    default:
      return false;
  }
}

namespace {

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << t.sizes();
  return os.str();
}

void check_tensor(const std::string& op, const char* which, const at::Tensor& t) {
  if (!t.defined()) throw CommError(op + ": the " + which + " tensor is undefined");
  if (!Communicator::supported(t.scalar_type()))
    throw CommError(op + ": dtype " + c10::toString(t.scalar_type()) + " of the " + which +
                    " tensor is not supported (f32, f64, bf16, f16, i32, i64, u8)");
  if (!t.is_contiguous())
    throw CommError(op + ": the " + which + " tensor " + describe(t) +
                    " is not contiguous (call .contiguous() first)");
}

void check_same_dtype(const std::string& op, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type())
    throw CommError(op + ": input is " + c10::toString(a.scalar_type()) + " but output is " +
                    c10::toString(b.scalar_type()));
  if (a.device() != b.device())
    throw CommError(op + ": input is on " + a.device().str() + " but output is on " + b.device().str());
}

void check_op(const std::string& op, ReduceOp r, const at::Tensor& t) {
  if (r == ReduceOp::kAvg && !at::isFloatingType(t.scalar_type()))
    throw CommError(op + ": avg needs a floating-point tensor, got " +
                    c10::toString(t.scalar_type()) + " (use sum and divide)");
}

void check_peer(const std::string& op, const char* role, int peer, int size, int self) {
  if (peer < 0 || peer >= size)
    throw CommError(op + ": " + role + " rank " + std::to_string(peer) + " is outside the group of " +
                    std::to_string(size));
  if (peer == self && std::string(role) != "root")
    throw CommError(op + ": rank " + std::to_string(self) + " cannot " +
                    (std::string(role) == "destination" ? "send to" : "receive from") + " itself");
}

WorkPtr failed(const std::string& what, std::exception_ptr e) {
  auto w = std::make_shared<Work>(what);
  w->finish(e);
  return w;
}

}  // namespace

// ---- the progress thread ------------------------------------------------------------

Communicator::Communicator(int rank, int size, std::string name)
    : rank_(rank),
      size_(size),
      name_(std::move(name)),
      recorder_(std::make_shared<FlightRecorder>("rank " + std::to_string(rank))) {
  run_.sends_started.assign(static_cast<size_t>(size), 0);
  run_.recvs_started.assign(static_cast<size_t>(size), 0);
  thread_ = std::thread([this] { progress_loop(); });
}

Communicator::~Communicator() { stop_progress_thread(); }

void Communicator::set_identity(std::string identity, bool agreed) {
  auto g = std::make_shared<GroupInfo>();
  g->name = name_;
  g->identity = std::move(identity);
  g->agreed = agreed;
  g->backend = backend();
  g->rank = rank_;
  g->size = size_;
  std::lock_guard<std::mutex> lock(mu_);
  group_ = std::move(g);
}

void Communicator::share_recorder(std::shared_ptr<FlightRecorder> recorder) {
  std::lock_guard<std::mutex> lock(mu_);
  recorder_ = std::move(recorder);
}

std::shared_ptr<const GroupInfo> Communicator::group() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!group_) {
    // A group no factory named: its own, in this process.
    auto g = std::make_shared<GroupInfo>();
    g->name = name_;
    std::ostringstream id;
    id << "process:" << static_cast<const void*>(this);
    g->identity = id.str();
    g->agreed = false;  // (no backend(): this may run while a backend is still being built)
    g->rank = rank_;
    g->size = size_;
    group_ = g;
  }
  return group_;
}

MemberProgress Communicator::progress() const {
  MemberProgress m;
  m.group = group();
  uint64_t current = 0, last = 0;
  std::shared_ptr<FlightRecorder> rec;
  {
    std::lock_guard<std::mutex> lock(mu_);
    m.collectives_started = run_.collectives_started;
    m.sends_started = run_.sends_started;
    m.recvs_started = run_.recvs_started;
    current = run_.current;
    last = run_.last;
    rec = recorder_;
  }
  m.owner = rec->owner();
  m.where = process_description();
  if (current) m.running = rec->snapshot_of(current, m.current);
  if (last) m.has_last = rec->snapshot_of(last, m.last);
  return m;
}

void Communicator::stop_progress_thread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

WorkPtr Communicator::enqueue(std::string what, std::function<void(Deadline)> fn, Duration timeout) {
  if (timeout == kDefaultTimeout) timeout = default_timeout_;
  auto work = std::make_shared<Work>(name_ + ": " + what, waiters_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      work->finish(std::make_exception_ptr(CommError(work->what() + ": the communicator is shut down")));
      return work;
    }
    queue_.push_back({work, std::move(fn), timeout, 0});
  }
  cv_.notify_one();
  return work;
}

void Communicator::progress_loop() {
  for (;;) {
    Item item;
    std::exception_ptr broken;
    std::shared_ptr<FlightRecorder> rec;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      item = std::move(queue_.front());
      queue_.pop_front();
      broken = broken_;
      rec = recorder_;
    }
    std::exception_ptr error;
    std::string error_text;
    if (broken) {
      try {
        std::rethrow_exception(broken);
      } catch (const std::exception& e) {
        error_text = item.work->what() + ": not run, an earlier op on this communicator failed: " + e.what();
        error = std::make_exception_ptr(CommError(error_text));
      }
    } else {
      begin(item.record);
      busy(true);
      try {
        item.work->start();
        const RunningOpTimeout running(item.timeout);
        item.fn(Clock::now() + item.timeout);
      } catch (const PeerLostError& e) {
        error_text = item.work->what() + ": " + e.what();
        error = std::make_exception_ptr(PeerLostError(error_text));
      } catch (const TimeoutError& e) {
        // Leave the record of every rank's ops behind (a HealthWrapper has already said
        // who did not come).
        error_text = item.work->what() + ": " + e.what();
        const std::string dumped = FlightRecorder::dump("timeout: " + error_text);
        if (!dumped.empty()) error_text += "\n  flight recorder: " + dumped;
        error = std::make_exception_ptr(TimeoutError(error_text));
      } catch (const std::exception& e) {
        error_text = item.work->what() + ": " + e.what();
        error = std::make_exception_ptr(CommError(error_text));
      } catch (...) {
        error_text = item.work->what() + ": unknown error";
        error = std::make_exception_ptr(CommError(error_text));
      }
      busy(false);
      if (error) {
        std::lock_guard<std::mutex> lock(mu_);
        broken_ = error;
      }
      end(item.record);
    }
    if (item.record) rec->ended(item.record, error_text);
    item.work->finish(error);
  }
}

// The progress counters other ranks read to tell how far this one got.
void Communicator::begin(uint64_t record) {
  if (!record) return;
  std::shared_ptr<FlightRecorder> rec;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rec = recorder_;
  }
  OpRecord r;
  const bool found = rec->started(record, &r);
  std::lock_guard<std::mutex> lock(mu_);
  if (found) {
    if (!r.p2p) run_.collectives_started = std::max(run_.collectives_started, r.seq);
    else if (r.op.rfind("send", 0) == 0) ++run_.sends_started[static_cast<size_t>(r.peer)];
    else ++run_.recvs_started[static_cast<size_t>(r.peer)];
  }
  run_.current = run_.last = record;
}

void Communicator::end(uint64_t record) {
  if (!record) return;
  std::lock_guard<std::mutex> lock(mu_);
  run_.current = 0;
}

bool Communicator::running_op(OpRecord& out) const {
  uint64_t current = 0;
  std::shared_ptr<FlightRecorder> rec;
  {
    std::lock_guard<std::mutex> lock(mu_);
    current = run_.current;
    rec = recorder_;
  }
  return current && rec->snapshot_of(current, out);
}

void Communicator::synchronize() {
  // An empty op: when it runs, everything queued before it has run.
  enqueue("synchronize", [](Deadline) {}, kDefaultTimeout)->wait();
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_) std::rethrow_exception(broken_);
}

// ---- the ops ------------------------------------------------------------------------

// ---- issuing: records and sequence numbers ----------------------------------------

WorkPtr Communicator::issue(OpDesc d, std::function<void(Deadline)> fn, Duration timeout) {
  if (timeout == kDefaultTimeout) timeout = default_timeout_;  // Note [Health checks]
  OpRecord r;
  r.op = std::string(d.kind) == "split" ? "split" : d.op;  // the color differs by rank
  r.peer = d.peer;
  r.tag = d.tag;
  const std::string kind = d.kind;
  r.p2p = kind == "send" || kind == "recv";
  std::string shape;
  if (d.tensor) {
    r.dtype = c10::toString(d.tensor->scalar_type());
    r.shape = d.tensor->sizes().vec();
    r.bytes = static_cast<int64_t>(d.tensor->numel()) * static_cast<int64_t>(d.tensor->element_size());
    shape = " " + describe(*d.tensor);
  }
  r.group = group();
  r.queued_us = wall_us();
  if (kind != "split") fn = order_after_issuer(std::move(fn));
  WorkPtr work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The sequence number and the queue position are taken together: issue order.
    r.seq = r.p2p ? ++(kind == "send" ? sends_ : recvs_)[{d.peer, d.tag}] : ++collectives_;
    work = std::make_shared<Work>(name_ + ": " + d.op + " #" + std::to_string(r.seq) + shape, waiters_);
    if (stopping_) {
      work->finish(std::make_exception_ptr(CommError(work->what() + ": the communicator is shut down")));
      return work;
    }
    const uint64_t id = recorder_->record(r);
    queue_.push_back({work, std::move(fn), timeout, id});
  }
  cv_.notify_one();
  return work;
}

void Communicator::check_carried(const std::string& op, const char* which, const at::Tensor& t) const {
  const std::string why = refuses(t);
  if (why.empty()) return;
  throw CommError(name_ + ": " + op + ": the " + (*which ? std::string(which) + " " : std::string()) + "tensor " +
                  describe(t) + " on " + t.device().str() + ": " + why);
}

#define TETRA_VALIDATE(what, ...)                              \
  try {                                                        \
    __VA_ARGS__;                                               \
  } catch (...) {                                              \
    return failed(name_ + ": " + (what), std::current_exception()); \
  }

WorkPtr Communicator::allreduce(at::Tensor tensor, const AllreduceOptions& opts) {
  return allreduce(tensor, tensor, opts);
}

WorkPtr Communicator::allreduce(at::Tensor input, at::Tensor output, const AllreduceOptions& opts) {
  const std::string op = std::string("allreduce ") + to_string(opts.op);
  TETRA_VALIDATE(op, {
    check_tensor(op, "input", input);
    check_tensor(op, "output", output);
    check_same_dtype(op, input, output);
    check_carried(op, "input", input);
    check_carried(op, "output", output);
    check_op(op, opts.op, input);
    if (input.numel() != output.numel())
      throw CommError(op + ": input " + describe(input) + " and output " + describe(output) +
                      " differ in size");
  });
  ReduceOp r = opts.op;
  count(Traffic::kAllreduce, input);
  return issue({"allreduce", op, -1, 0, &input},
               [=](Deadline d) { backend_allreduce(input, output, r, d); }, opts.timeout);
}

WorkPtr Communicator::reduce_scatter(at::Tensor input, at::Tensor output, const ReduceScatterOptions& opts) {
  const std::string op = std::string("reduce_scatter ") + to_string(opts.op);
  TETRA_VALIDATE(op, {
    check_tensor(op, "input", input);
    check_tensor(op, "output", output);
    check_same_dtype(op, input, output);
    check_carried(op, "input", input);
    check_carried(op, "output", output);
    check_op(op, opts.op, input);
    if (input.numel() != output.numel() * size_)
      throw CommError(op + ": input " + describe(input) + " must hold " + std::to_string(size_) +
                      " chunks of the output " + describe(output) + " (" +
                      std::to_string(output.numel() * size_) + " elements), it holds " +
                      std::to_string(input.numel()));
  });
  ReduceOp r = opts.op;
  count(Traffic::kReduceScatter, input);
  return issue({"reduce_scatter", op, -1, 0, &input},
               [=](Deadline d) { backend_reduce_scatter(input, output, r, d); }, opts.timeout);
}

WorkPtr Communicator::allgather(at::Tensor input, at::Tensor output, const AllgatherOptions& opts) {
  const std::string op = "allgather";
  TETRA_VALIDATE(op, {
    check_tensor(op, "input", input);
    check_tensor(op, "output", output);
    check_same_dtype(op, input, output);
    check_carried(op, "input", input);
    check_carried(op, "output", output);
    if (output.numel() != input.numel() * size_)
      throw CommError(op + ": output " + describe(output) + " must hold " + std::to_string(size_) +
                      " chunks of the input " + describe(input) + " (" +
                      std::to_string(input.numel() * size_) + " elements), it holds " +
                      std::to_string(output.numel()));
  });
  count(Traffic::kAllgather, output);
  return issue({"allgather", op, -1, 0, &input}, [=](Deadline d) { backend_allgather(input, output, d); },
               opts.timeout);
}

WorkPtr Communicator::broadcast(at::Tensor tensor, const BroadcastOptions& opts) {
  const std::string op = "broadcast from " + std::to_string(opts.root);
  TETRA_VALIDATE(op, {
    check_tensor(op, "", tensor);
    check_carried(op, "", tensor);
    check_peer(op, "root", opts.root, size_, rank_);
  });
  int root = opts.root;
  count(Traffic::kBroadcast, tensor);
  return issue({"broadcast", op, root, 0, &tensor}, [=](Deadline d) { backend_broadcast(tensor, root, d); },
               opts.timeout);
}

WorkPtr Communicator::send(at::Tensor tensor, int dst, const SendOptions& opts) {
  const std::string op = "send to " + std::to_string(dst) + " tag " + std::to_string(opts.tag);
  TETRA_VALIDATE(op, {
    check_tensor(op, "", tensor);
    check_carried(op, "", tensor);
    check_peer(op, "destination", dst, size_, rank_);
    if (opts.tag < 0) throw CommError(op + ": tags must be >= 0");
  });
  int tag = opts.tag;
  count(Traffic::kSend, tensor);
  return issue({"send", "send to " + std::to_string(dst) + " tag " + std::to_string(tag), dst, tag, &tensor},
               [=](Deadline d) { backend_send(tensor, dst, tag, d); }, opts.timeout);
}

WorkPtr Communicator::recv(at::Tensor tensor, int src, const RecvOptions& opts) {
  const std::string op = "recv from " + std::to_string(src) + " tag " + std::to_string(opts.tag);
  TETRA_VALIDATE(op, {
    check_tensor(op, "", tensor);
    check_carried(op, "", tensor);
    check_peer(op, "source", src, size_, rank_);
    if (opts.tag < 0) throw CommError(op + ": tags must be >= 0");
  });
  int tag = opts.tag;
  count(Traffic::kRecv, tensor);
  return issue({"recv", "recv from " + std::to_string(src) + " tag " + std::to_string(tag), src, tag, &tensor},
               [=](Deadline d) { backend_recv(tensor, src, tag, d); }, opts.timeout);
}

WorkPtr Communicator::barrier(const BarrierOptions& opts) {
  return issue({"barrier", "barrier", -1, 0, nullptr}, [=](Deadline d) { backend_barrier(d); }, opts.timeout);
}

std::shared_ptr<Communicator> Communicator::split(int color, int key, const std::string& name,
                                                  Duration timeout) {
  std::shared_ptr<Communicator> out;
  std::string label = name.empty() ? name_ + "/split(" + std::to_string(color) + ")" : name;
  int64_t nth = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    nth = ++splits_;
  }
  auto work = issue({"split", "split color " + std::to_string(color), -1, 0, nullptr},
                    [&, label](Deadline d) { out = backend_split(color, key, label, d); }, timeout);
  work->wait();
  if (out) {
    out->counter_->parent = counter_;  // its ops count on this one's axis too
    // The same path on every member: this group's identity, which split, which color.
    auto parent = group();
    out->set_identity(parent->identity + "/" + std::to_string(nth) + "." + std::to_string(color), parent->agreed);
    std::lock_guard<std::mutex> lock(mu_);
    out->share_recorder(recorder_);
  }
  return out;
}

#undef TETRA_VALIDATE

// ---- the running op's timeout (collectives/running_op.h) ------------------------------

namespace {
thread_local Duration running_timeout{-1};  // -1: no op runs on this thread
}  // namespace

Duration running_op_timeout(Deadline deadline) {
  if (running_timeout.count() >= 0) return running_timeout;
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
  return Duration(std::max<int64_t>(0, (left.count() + 500) / 1000));
}

RunningOpTimeout::RunningOpTimeout(Duration timeout) : saved_(running_timeout) { running_timeout = timeout; }
RunningOpTimeout::~RunningOpTimeout() { running_timeout = saved_; }

// ---- arithmetic ---------------------------------------------------------------------

void reduce_into(const at::Tensor& dst, const at::Tensor& src, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: dst.add_(src); break;
    case ReduceOp::kProd: dst.mul_(src); break;
    case ReduceOp::kMin: at::minimum_out(const_cast<at::Tensor&>(dst), dst, src); break;
    case ReduceOp::kMax: at::maximum_out(const_cast<at::Tensor&>(dst), dst, src); break;
  }
}

void finish_average(const at::Tensor& t, ReduceOp op, int size) {
  if (op == ReduceOp::kAvg && size > 1) t.div_(size);
}

std::string broadcast_string(Communicator& group, const std::string& text, const BroadcastOptions& options) {
  // Where the group carries its tensors (Note [Two planes]): host memory on a host plane.
  const at::TensorOptions where = at::TensorOptions().device(group.device());
  at::Tensor len = at::full({1}, static_cast<int64_t>(text.size()), where.dtype(at::kLong));
  group.broadcast(len, options)->wait();
  const int64_t n = len.item<int64_t>();
  if (n == 0) return "";
  at::Tensor bytes = at::empty({n}, at::kByte);
  if (group.rank() == options.root) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  bytes = bytes.to(group.device());
  group.broadcast(bytes, options)->wait();
  bytes = bytes.cpu();
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n));
}

}  // namespace tetra::collectives
