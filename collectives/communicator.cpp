#include "collectives/communicator.h"

#include <ATen/ATen.h>

#include <sstream>

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
  ops += 1;
  sent += sent_by(k, bytes, n);
}

Traffic& Traffic::operator+=(const Traffic& o) {
  for (int k = 0; k < kKinds; ++k) payload[k] += o.payload[k];
  ops += o.ops;
  sent += o.sent;
  return *this;
}

Traffic Traffic::operator-(const Traffic& o) const {
  Traffic d = *this;
  for (int k = 0; k < kKinds; ++k) d.payload[k] -= o.payload[k];
  d.ops -= o.ops;
  d.sent -= o.sent;
  return d;
}

bool Traffic::operator==(const Traffic& o) const {
  for (int k = 0; k < kKinds; ++k)
    if (payload[k] != o.payload[k]) return false;
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
    : rank_(rank), size_(size), name_(std::move(name)) {
  thread_ = std::thread([this] { progress_loop(); });
}

Communicator::~Communicator() { stop_progress_thread(); }

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
  auto work = std::make_shared<Work>(name_ + ": " + what, waiters_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      work->finish(std::make_exception_ptr(CommError(work->what() + ": the communicator is shut down")));
      return work;
    }
    queue_.push_back({work, std::move(fn), timeout});
  }
  cv_.notify_one();
  return work;
}

void Communicator::progress_loop() {
  for (;;) {
    Item item;
    std::exception_ptr broken;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      item = std::move(queue_.front());
      queue_.pop_front();
      broken = broken_;
    }
    std::exception_ptr error;
    if (broken) {
      try {
        std::rethrow_exception(broken);
      } catch (const std::exception& e) {
        error = std::make_exception_ptr(
            CommError(item.work->what() + ": not run, an earlier op on this communicator failed: " + e.what()));
      }
    } else {
      try {
        item.work->start();
        item.fn(Clock::now() + item.timeout);
      } catch (const TimeoutError& e) {
        error = std::make_exception_ptr(TimeoutError(item.work->what() + ": " + e.what()));
      } catch (const std::exception& e) {
        error = std::make_exception_ptr(CommError(item.work->what() + ": " + e.what()));
      } catch (...) {
        error = std::make_exception_ptr(CommError(item.work->what() + ": unknown error"));
      }
      if (error) {
        std::lock_guard<std::mutex> lock(mu_);
        broken_ = error;
      }
    }
    item.work->finish(error);
  }
}

void Communicator::synchronize() {
  // An empty op: when it runs, everything queued before it has run.
  enqueue("synchronize", [](Deadline) {}, kDefaultTimeout)->wait();
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_) std::rethrow_exception(broken_);
}

// ---- the ops ------------------------------------------------------------------------

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
    check_op(op, opts.op, input);
    if (input.numel() != output.numel())
      throw CommError(op + ": input " + describe(input) + " and output " + describe(output) +
                      " differ in size");
  });
  ReduceOp r = opts.op;
  count(Traffic::kAllreduce, input);
  return enqueue(op + " " + describe(input), [=](Deadline d) { backend_allreduce(input, output, r, d); },
                 opts.timeout);
}

WorkPtr Communicator::reduce_scatter(at::Tensor input, at::Tensor output, const ReduceScatterOptions& opts) {
  const std::string op = std::string("reduce_scatter ") + to_string(opts.op);
  TETRA_VALIDATE(op, {
    check_tensor(op, "input", input);
    check_tensor(op, "output", output);
    check_same_dtype(op, input, output);
    check_op(op, opts.op, input);
    if (input.numel() != output.numel() * size_)
      throw CommError(op + ": input " + describe(input) + " must hold " + std::to_string(size_) +
                      " chunks of the output " + describe(output) + " (" +
                      std::to_string(output.numel() * size_) + " elements), it holds " +
                      std::to_string(input.numel()));
  });
  ReduceOp r = opts.op;
  count(Traffic::kReduceScatter, input);
  return enqueue(op + " " + describe(input),
                 [=](Deadline d) { backend_reduce_scatter(input, output, r, d); }, opts.timeout);
}

WorkPtr Communicator::allgather(at::Tensor input, at::Tensor output, const AllgatherOptions& opts) {
  const std::string op = "allgather";
  TETRA_VALIDATE(op, {
    check_tensor(op, "input", input);
    check_tensor(op, "output", output);
    check_same_dtype(op, input, output);
    if (output.numel() != input.numel() * size_)
      throw CommError(op + ": output " + describe(output) + " must hold " + std::to_string(size_) +
                      " chunks of the input " + describe(input) + " (" +
                      std::to_string(input.numel() * size_) + " elements), it holds " +
                      std::to_string(output.numel()));
  });
  count(Traffic::kAllgather, output);
  return enqueue(op + " " + describe(input), [=](Deadline d) { backend_allgather(input, output, d); },
                 opts.timeout);
}

WorkPtr Communicator::broadcast(at::Tensor tensor, const BroadcastOptions& opts) {
  const std::string op = "broadcast from " + std::to_string(opts.root);
  TETRA_VALIDATE(op, {
    check_tensor(op, "", tensor);
    check_peer(op, "root", opts.root, size_, rank_);
  });
  int root = opts.root;
  count(Traffic::kBroadcast, tensor);
  return enqueue(op + " " + describe(tensor), [=](Deadline d) { backend_broadcast(tensor, root, d); },
                 opts.timeout);
}

WorkPtr Communicator::send(at::Tensor tensor, int dst, const SendOptions& opts) {
  const std::string op = "send to " + std::to_string(dst) + " tag " + std::to_string(opts.tag);
  TETRA_VALIDATE(op, {
    check_tensor(op, "", tensor);
    check_peer(op, "destination", dst, size_, rank_);
    if (opts.tag < 0) throw CommError(op + ": tags must be >= 0");
  });
  int tag = opts.tag;
  count(Traffic::kSend, tensor);
  return enqueue(op + " " + describe(tensor), [=](Deadline d) { backend_send(tensor, dst, tag, d); },
                 opts.timeout);
}

WorkPtr Communicator::recv(at::Tensor tensor, int src, const RecvOptions& opts) {
  const std::string op = "recv from " + std::to_string(src) + " tag " + std::to_string(opts.tag);
  TETRA_VALIDATE(op, {
    check_tensor(op, "", tensor);
    check_peer(op, "source", src, size_, rank_);
    if (opts.tag < 0) throw CommError(op + ": tags must be >= 0");
  });
  int tag = opts.tag;
  count(Traffic::kRecv, tensor);
  return enqueue(op + " " + describe(tensor), [=](Deadline d) { backend_recv(tensor, src, tag, d); },
                 opts.timeout);
}

WorkPtr Communicator::barrier(const BarrierOptions& opts) {
  return enqueue("barrier", [=](Deadline d) { backend_barrier(d); }, opts.timeout);
}

std::shared_ptr<Communicator> Communicator::split(int color, int key, const std::string& name,
                                                  Duration timeout) {
  std::shared_ptr<Communicator> out;
  std::string label = name.empty() ? name_ + "/split(" + std::to_string(color) + ")" : name;
  auto work = enqueue("split color " + std::to_string(color),
                      [&, label](Deadline d) { out = backend_split(color, key, label, d); }, timeout);
  work->wait();
  if (out) out->counter_->parent = counter_;  // its ops count on this one's axis too
  return out;
}

#undef TETRA_VALIDATE

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

}  // namespace tetra::collectives
