#include "collectives/health.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "collectives/watchdog.h"

namespace tetra::collectives {

namespace {

// Fingerprint rows (Note [Health checks]): kind, reduce op or root, dtype, sequence
// number, numel, ndim, the first four sizes.
constexpr int64_t kPrint = 10;
const char* const kKinds[] = {"?", "allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "send", "recv"};
enum Kind : int64_t { kUnknown, kAllreduce, kReduceScatter, kAllgather, kBroadcast, kBarrier, kSend, kRecv };

std::string describe_print(const int64_t* p) {
  std::ostringstream os;
  const int64_t k = p[0] >= 1 && p[0] < 8 ? p[0] : 0;
  os << kKinds[k];
  if (k == kAllreduce || k == kReduceScatter) os << " " << to_string(static_cast<ReduceOp>(p[1]));
  if (k == kBroadcast) os << " from " << p[1];
  os << " #" << p[3];
  if (k != kBarrier) {
    os << " " << (p[2] >= 0 ? c10::toString(static_cast<at::ScalarType>(p[2])) : "?");
    if (p[5] <= 4) {
      os << "[";
      for (int64_t i = 0; i < p[5]; ++i) os << (i ? ", " : "") << p[6 + i];
      os << "]";
    } else {
      os << " of " << p[4] << " elements";
    }
  }
  return os.str();
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace

// What an op is, for its fingerprint: the tensor that describes it (the input of a
// reduction or gather), the reduce op or root, the peer and tag of a send or receive.
struct HealthWrapper::Print {
  Kind kind;
  const at::Tensor* tensor = nullptr;
  int64_t arg = 0;
  int peer = -1;
  int tag = 0;
};

HealthWrapper::HealthWrapper(CommunicatorPtr backend, const HealthOptions& options, bool watched)
    : Communicator(backend->rank(), backend->size(), backend->name()),
      backend_(std::move(backend)),
      options_(options),
      watched_(watched) {
  // One member, as the backend was: its identity, its recorder, its waiters.
  const std::shared_ptr<const GroupInfo> g = backend_->group();
  set_identity(g->identity, g->agreed);
  share_recorder(backend_->recorder());
  waiters_ = backend_->waiters_;
  if (watched_) watch(this, options_.stall_warning);
}

HealthWrapper::~HealthWrapper() {
  if (watched_) unwatch(this);  // before the thread goes: the watchdog reads progress()
  stop_progress_thread();       // ops still queued use backend_
}

template <typename Op>
void HealthWrapper::checked(const Print& print, Op&& op, Deadline deadline) {
  try {
    if (options_.check && print.kind != kUnknown) fingerprint(print, deadline);
    op();
  } catch (const TimeoutError& e) {
    // Say who did not come (Note [Stall warnings]).
    OpRecord r;
    if (!watched_ || options_.stall_warning.count() == 0 || !running_op(r)) throw;
    throw TimeoutError(std::string(e.what()) + "\n  " + diagnose(r, group_members(*group())));
  }
}

// Runs on the progress thread before the op itself: the group agrees on what it runs.
void HealthWrapper::fingerprint(const Print& print, Deadline deadline) {
  OpRecord r;
  if (!running_op(r)) return;  // an op no recorder holds: nothing to agree on
  int64_t p[kPrint] = {};
  p[0] = print.kind;
  p[1] = print.arg;
  p[2] = print.tensor ? static_cast<int64_t>(print.tensor->scalar_type()) : -1;
  p[3] = r.seq;
  if (print.tensor) {
    p[4] = static_cast<int64_t>(print.tensor->numel());
    p[5] = print.tensor->dim();
    for (int64_t i = 0; i < p[5] && i < 4; ++i) p[6 + i] = print.tensor->size(i);
  }
  if (print.kind == kRecv) return agree_recv(p, print.peer, print.tag, deadline);
  if (print.kind != kSend) return agree_collective(p, deadline);
  // Where the group carries tensors (Note [Two planes]): beside a GPU's op, a GPU tensor.
  at::Tensor mine = at::empty({kPrint}, at::kLong);
  std::memcpy(mine.data_ptr<int64_t>(), p, sizeof(p));
  backend_->backend_send(mine.to(device()), print.peer, print.tag, deadline);
}

void HealthWrapper::agree_recv(const int64_t* p, int peer, int tag, Deadline deadline) {
  at::Tensor theirs = at::zeros({kPrint}, at::TensorOptions(at::kLong).device(device()));
  backend_->backend_recv(theirs, peer, tag, deadline);
  theirs = theirs.cpu();
  const int64_t* q = theirs.data_ptr<int64_t>();
  bool same = q[0] == kSend;
  for (int64_t i = 2; i < kPrint; ++i) same = same && q[i] == p[i];
  if (same) return;
  int64_t expected[kPrint];
  std::memcpy(expected, p, sizeof(expected));
  expected[0] = kSend;
  throw CommError("collectives.check: rank " + std::to_string(rank()) + " expects " + describe_print(expected) +
                  " from rank " + std::to_string(peer) + ", which sent " + describe_print(q) +
                  " (a send or recv skipped, or the sizes differ)");
}

void HealthWrapper::agree_collective(const int64_t* p, Deadline deadline) {
  at::Tensor mine = at::empty({kPrint}, at::kLong);
  std::memcpy(mine.data_ptr<int64_t>(), p, kPrint * sizeof(int64_t));
  at::Tensor all = at::zeros({kPrint * size()}, at::TensorOptions(at::kLong).device(device()));
  backend_->backend_allgather(mine.to(device()), all, deadline);
  all = all.cpu();
  const int64_t* a = all.data_ptr<int64_t>();
  // Ranks grouped by what they called, in the order of their lowest rank.
  std::vector<std::pair<const int64_t*, std::vector<int>>> calls;
  for (int k = 0; k < size(); ++k) {
    const int64_t* row = a + k * kPrint;
    auto it = std::find_if(calls.begin(), calls.end(),
                           [&](const auto& c) { return std::equal(row, row + kPrint, c.first); });
    if (it == calls.end()) calls.push_back({row, {k}});
    else it->second.push_back(k);
  }
  if (calls.size() == 1) return;
  std::string msg = "collectives.check: the ranks of " + name() + " called different ops:";
  for (size_t i = 0; i < calls.size(); ++i)
    msg += std::string(i ? ";" : "") + " " + rank_list(calls[i].second) + " called " + describe_print(calls[i].first);
  throw CommError(msg);
}

void HealthWrapper::backend_allreduce(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                                      Deadline deadline) {
  checked({kAllreduce, &input, static_cast<int64_t>(op)},
          [&] { backend_->backend_allreduce(input, output, op, deadline); }, deadline);
}

void HealthWrapper::backend_reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                                           Deadline deadline) {
  checked({kReduceScatter, &input, static_cast<int64_t>(op)},
          [&] { backend_->backend_reduce_scatter(input, output, op, deadline); }, deadline);
}

void HealthWrapper::backend_allgather(const at::Tensor& input, const at::Tensor& output, Deadline deadline) {
  checked({kAllgather, &input}, [&] { backend_->backend_allgather(input, output, deadline); }, deadline);
}

void HealthWrapper::backend_broadcast(const at::Tensor& tensor, int root, Deadline deadline) {
  checked({kBroadcast, &tensor, root}, [&] { backend_->backend_broadcast(tensor, root, deadline); }, deadline);
}

void HealthWrapper::backend_send(const at::Tensor& tensor, int dst, int tag, Deadline deadline) {
  checked({kSend, &tensor, 0, dst, tag}, [&] { backend_->backend_send(tensor, dst, tag, deadline); }, deadline);
}

void HealthWrapper::backend_recv(const at::Tensor& tensor, int src, int tag, Deadline deadline) {
  checked({kRecv, &tensor, 0, src, tag}, [&] { backend_->backend_recv(tensor, src, tag, deadline); }, deadline);
}

void HealthWrapper::backend_barrier(Deadline deadline) {
  checked({kBarrier}, [&] { backend_->backend_barrier(deadline); }, deadline);
}

std::shared_ptr<Communicator> HealthWrapper::backend_split(int color, int key, const std::string& name,
                                                           Deadline deadline) {
  // No fingerprint: the color differs by rank. The split takes the process's options now,
  // as every communicator takes them when it is made.
  std::shared_ptr<Communicator> part;
  checked({kUnknown}, [&] { part = backend_->backend_split(color, key, name, deadline); }, deadline);
  return part ? with_health(std::move(part), health_options(), watched_) : nullptr;
}

CommunicatorPtr with_health(CommunicatorPtr backend, const HealthOptions& options, bool watched) {
  if (!backend) return backend;
  const bool stalls = watched && options.stall_warning.count() > 0;
  if (!options.check && !stalls) return backend;
  return std::make_shared<HealthWrapper>(std::move(backend), options, watched);
}

}  // namespace tetra::collectives
