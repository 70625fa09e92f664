#include "collectives/local.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h stopped bringing it in LibTorch 2.x

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>

#include "collectives/health.h"
#include "collectives/running_op.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tetra::collectives {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

enum class Kind { kNone, kAllreduce, kReduceScatter, kAllgather, kBroadcast, kBarrier, kSplit };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kNone: return "nothing";
    case Kind::kAllreduce: return "allreduce";
    case Kind::kReduceScatter: return "reduce_scatter";
    case Kind::kAllgather: return "allgather";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kBarrier: return "barrier";
    case Kind::kSplit: return "split";
  }
  return "?";
}

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << t.sizes();
  return os.str();
}

// A 1-d view of `len` elements of a contiguous buffer, from element `offset`. Built from
// the raw pointer so that it touches nothing of the (other rank's) tensor it came from.
at::Tensor span(void* base, at::ScalarType dtype, int64_t offset, int64_t len) {
  const auto item = static_cast<int64_t>(c10::elementSize(dtype));
  return at::from_blob(static_cast<char*>(base) + offset * item, {len},
                       at::TensorOptions().dtype(dtype));
}

// out = a (op) b; out may be a (or b) exactly.
void reduce_pair(at::Tensor out, const at::Tensor& a, const at::Tensor& b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: at::add_out(out, a, b); break;
    case ReduceOp::kProd: at::mul_out(out, a, b); break;
    case ReduceOp::kMin: at::minimum_out(out, a, b); break;
    case ReduceOp::kMax: at::maximum_out(out, a, b); break;
  }
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

struct Shared;

// What one rank posts for the collective in flight. Written by its rank before the first
// barrier of an op, read by the others between the first and the last barrier.
struct alignas(64) Slot {
  Kind kind = Kind::kNone;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  at::ScalarType dtype = at::kFloat;
  int64_t numel = 0;  // of the input (of the tensor, for broadcast)
  void* in = nullptr;
  void* out = nullptr;
  // Keep the buffers alive while peers may still touch them (an op that fails on this
  // rank leaves them here, so a peer still copying never reads freed memory).
  at::Tensor in_tensor, out_tensor;
  int color = 0, key = 0;
  std::shared_ptr<Shared> split_group;  // posted by each new group's first rank
};

// The state the N communicators of one local group share.
struct Shared {
  explicit Shared(int n)
      : n(n), slots(static_cast<size_t>(n)), arrived_(static_cast<size_t>(n), 0) {
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    // Spinning only pays when every rank has a core; oversubscribed, yield soon.
    spin_ = static_cast<unsigned>(n) <= hw ? 4000 : 64;
  }

  const int n;
  std::vector<Slot> slots;

  // Waits until all n ranks arrived, or throws: TimeoutError naming the absent ranks at
  // the deadline (and aborts the group), CommError when the group is aborted.
  void barrier(int rank, const char* what, Deadline deadline, Duration timeout) {
    uint64_t gen;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (aborted_) throw CommError(aborted_message(what));
      gen = gen_.load(std::memory_order_relaxed);
      arrived_[static_cast<size_t>(rank)] = 1;
      if (++count_ == n) {
        count_ = 0;
        std::fill(arrived_.begin(), arrived_.end(), 0);
        gen_.store(gen + 1, std::memory_order_release);
        lock.unlock();
        barrier_cv_.notify_all();
        return;
      }
    }
    for (unsigned i = 0; i < spin_; ++i) {
      if (gen_.load(std::memory_order_acquire) != gen) return;
      if (aborted_flag_.load(std::memory_order_relaxed)) break;
      if (i < 64)
        cpu_relax();
      else
        std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(mu_);
    barrier_cv_.wait_until(lock, deadline, [&] {
      return gen_.load(std::memory_order_relaxed) != gen || aborted_;
    });
    if (gen_.load(std::memory_order_relaxed) != gen) return;  // passed (even if aborted since)
    if (aborted_) throw CommError(aborted_message(what));
    std::vector<int> missing;
    for (int r = 0; r < n; ++r)
      if (!arrived_[static_cast<size_t>(r)]) missing.push_back(r);
    std::string msg = std::string("local ") + what + ": rank" + (missing.size() > 1 ? "s " : " ") +
                      rank_list(missing) + " of " + std::to_string(n) + " did not join within " +
                      std::to_string(timeout.count()) + " ms";
    abort_locked(rank, msg);
    lock.unlock();
    notify_all();
    throw TimeoutError(msg);
  }

  // Marks the group broken (the first reason wins) and releases every waiter.
  void abort(int rank, const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      abort_locked(rank, reason);
    }
    notify_all();
  }

  bool aborted() const { return aborted_flag_.load(std::memory_order_acquire); }

  // ---- mailbox --------------------------------------------------------------------
  void post(int src, int dst, int tag, at::Tensor message) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) throw CommError(aborted_message("send"));
      mailbox_[{src, dst, tag}].push_back(std::move(message));
    }
    mail_cv_.notify_all();
  }

  // Waits for the oldest message from src to dst with tag; nothing by the deadline is a
  // TimeoutError (and aborts the group).
  at::Tensor take(int src, int dst, int tag, Deadline deadline, Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto key = std::make_tuple(src, dst, tag);
    auto ready = [&] {
      if (aborted_) return true;
      auto it = mailbox_.find(key);
      return it != mailbox_.end() && !it->second.empty();
    };
    mail_cv_.wait_until(lock, deadline, ready);
    auto it = mailbox_.find(key);
    if (it != mailbox_.end() && !it->second.empty()) {
      at::Tensor m = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) mailbox_.erase(it);
      return m;
    }
    const std::string what = "recv from " + std::to_string(src) + " tag " + std::to_string(tag);
    if (aborted_) throw CommError(aborted_message(what.c_str()));
    std::string msg = what + ": nothing arrived within " + std::to_string(timeout.count()) + " ms";
    abort_locked(dst, msg);
    lock.unlock();
    notify_all();
    throw TimeoutError(msg);
  }

 private:
  void abort_locked(int rank, const std::string& reason) {
    if (aborted_) return;
    aborted_ = true;
    reason_ = "rank " + std::to_string(rank) + " failed: " + reason;
    aborted_flag_.store(true, std::memory_order_release);
  }
  void notify_all() {
    barrier_cv_.notify_all();
    mail_cv_.notify_all();
  }
  std::string aborted_message(const char* what) const {
    return std::string("local ") + what + ": the group was aborted (" + reason_ + ")";
  }

  std::mutex mu_;
  std::condition_variable barrier_cv_, mail_cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<bool> aborted_flag_{false};
  unsigned spin_ = 0;
  // Guarded by mu_:
  int count_ = 0;
  std::vector<char> arrived_;  // who arrived in the current generation
  bool aborted_ = false;
  std::string reason_;
  std::map<std::tuple<int, int, int>, std::deque<at::Tensor>> mailbox_;
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(int rank, int size, std::string name, std::shared_ptr<Shared> shared)
      : Communicator(rank, size, std::move(name)), shared_(std::move(shared)) {}
  ~LocalCommunicator() override { stop_progress_thread(); }
  void name_group(const std::string& identity) { set_identity(identity, false); }

  std::string backend() const override { return "local"; }
  // Note [Two planes]: the ranks read each other's bytes through host pointers.
  std::string refuses(const at::Tensor& t) const override {
    return t.is_cpu() ? "" : "the local backend carries host tensors only (thread ranks read each other's memory)";
  }
  Shared& shared() { return *shared_; }

 protected:
  void backend_allreduce(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                         Deadline deadline) override {
    guarded([&] {
      if (size() == 1) {
        if (input.data_ptr() != output.data_ptr()) output.view({-1}).copy_(input.view({-1}));
        return;
      }
      Op o = begin(Kind::kAllreduce, "allreduce", deadline, input, output, op, 0);
      const int64_t n = o.mine.numel;
      const int64_t lo = n * rank() / size(), len = n * (rank() + 1) / size() - lo;
      if (len > 0) {
        const int s = size(), r = rank();
        at::Tensor acc = span(o.mine.out, o.mine.dtype, lo, len);
        // Start from this rank's own input: in place, acc is that very chunk.
        reduce_pair(acc, span(o.mine.in, o.mine.dtype, lo, len),
                    span(slot((r + 1) % s).in, o.mine.dtype, lo, len), op);
        for (int j = 2; j < s; ++j) reduce_into(acc, span(slot((r + j) % s).in, o.mine.dtype, lo, len), op);
        finish_average(acc, op, s);
        for (int j = 1; j < s; ++j) span(slot((r + j) % s).out, o.mine.dtype, lo, len).copy_(acc);
      }
      end(o);
    });
  }

  void backend_reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                              Deadline deadline) override {
    guarded([&] {
      if (size() == 1) {
        if (input.data_ptr() != output.data_ptr()) output.view({-1}).copy_(input.view({-1}));
        return;
      }
      Op o = begin(Kind::kReduceScatter, "reduce_scatter", deadline, input, output, op, 0);
      const int64_t m = output.numel();
      if (m > 0) {
        const int s = size(), r = rank();
        const int64_t lo = m * r;
        at::Tensor acc = span(o.mine.out, o.mine.dtype, 0, m);
        reduce_pair(acc, span(o.mine.in, o.mine.dtype, lo, m),
                    span(slot((r + 1) % s).in, o.mine.dtype, lo, m), op);
        for (int j = 2; j < s; ++j) reduce_into(acc, span(slot((r + j) % s).in, o.mine.dtype, lo, m), op);
        finish_average(acc, op, s);
      }
      end(o);
    });
  }

  void backend_allgather(const at::Tensor& input, const at::Tensor& output,
                         Deadline deadline) override {
    guarded([&] {
      if (size() == 1) {
        if (input.data_ptr() != output.data_ptr()) output.view({-1}).copy_(input.view({-1}));
        return;
      }
      Op o = begin(Kind::kAllgather, "allgather", deadline, input, output, ReduceOp::kSum, 0);
      const int64_t m = o.mine.numel;
      if (m > 0) {
        for (int k = 0; k < size(); ++k) {
          void* dst = static_cast<char*>(o.mine.out) + k * m * static_cast<int64_t>(c10::elementSize(o.mine.dtype));
          if (dst == slot(k).in) continue;  // in-place allgather: already there
          span(o.mine.out, o.mine.dtype, k * m, m).copy_(span(slot(k).in, o.mine.dtype, 0, m));
        }
      }
      end(o);
    });
  }

  void backend_broadcast(const at::Tensor& tensor, int root, Deadline deadline) override {
    guarded([&] {
      if (size() == 1) return;
      Op o = begin(Kind::kBroadcast, "broadcast", deadline, tensor, tensor, ReduceOp::kSum, root);
      if (rank() != root && o.mine.numel > 0)
        span(o.mine.out, o.mine.dtype, 0, o.mine.numel)
            .copy_(span(slot(root).in, o.mine.dtype, 0, o.mine.numel));
      end(o);
    });
  }

  void backend_send(const at::Tensor& tensor, int dst, int tag, Deadline deadline) override {
    guarded([&] { shared_->post(rank(), dst, tag, tensor.clone()); });
  }

  void backend_recv(const at::Tensor& tensor, int src, int tag, Deadline deadline) override {
    guarded([&] {
      at::Tensor m = shared_->take(src, rank(), tag, deadline, running_op_timeout(deadline));
      if (m.scalar_type() != tensor.scalar_type() || m.numel() != tensor.numel())
        throw CommError("recv from " + std::to_string(src) + " tag " + std::to_string(tag) + ": rank " +
                        std::to_string(src) + " sent " + describe(m) + ", rank " +
                        std::to_string(rank()) + " receives into " + describe(tensor));
      if (tensor.numel() > 0) tensor.view({-1}).copy_(m.view({-1}));
    });
  }

  void backend_barrier(Deadline deadline) override {
    guarded([&] {
      if (size() == 1) return;
      Op o = begin(Kind::kBarrier, "barrier", deadline, at::Tensor(), at::Tensor(), ReduceOp::kSum, 0);
      end(o);
    });
  }

  std::shared_ptr<Communicator> backend_split(int color, int key, const std::string& name,
                                              Deadline deadline) override {
    std::shared_ptr<Communicator> result;
    guarded([&] {
      const Duration timeout = running_op_timeout(deadline);
      Slot& me = slot(rank());
      me.kind = Kind::kSplit;
      me.color = color;
      me.key = key;
      me.split_group.reset();
      shared_->barrier(rank(), "split", deadline, timeout);
      check_kinds(Kind::kSplit);
      std::vector<std::pair<int, int>> members;  // (key, old rank)
      if (color >= 0)
        for (int r = 0; r < size(); ++r)
          if (slot(r).color == color) members.emplace_back(slot(r).key, r);
      std::sort(members.begin(), members.end());
      const bool leader = !members.empty() && members.front().second == rank();
      if (leader) me.split_group = std::make_shared<Shared>(static_cast<int>(members.size()));
      shared_->barrier(rank(), "split", deadline, timeout);
      if (color >= 0) {
        int new_rank = 0;
        while (members[static_cast<size_t>(new_rank)].second != rank()) ++new_rank;
        result = std::make_shared<LocalCommunicator>(new_rank, static_cast<int>(members.size()), name,
                                                     slot(members.front().second).split_group);
      }
      shared_->barrier(rank(), "split", deadline, timeout);
      me.split_group.reset();
      me.kind = Kind::kNone;
    });
    return result;
  }

 private:
  struct Op {
    const char* what;
    Deadline deadline;
    Duration timeout;
    Slot& mine;
  };

  Slot& slot(int r) { return shared_->slots[static_cast<size_t>(r)]; }

  // Runs one op; any failure aborts the group (peers are released) and propagates.
  template <typename F>
  void guarded(F&& body) {
    at::NoGradGuard no_grad;  // in-place ops on parameters that require grad
    try {
      body();
    } catch (const std::exception& e) {
      shared_->abort(rank(), e.what());
      throw;
    }
  }

  // Posts this rank's op, meets the others, and checks they all posted the same.
  Op begin(Kind kind, const char* what, Deadline deadline, const at::Tensor& in, const at::Tensor& out,
           ReduceOp op, int root) {
    Op o{what, deadline, running_op_timeout(deadline), slot(rank())};
    Slot& s = o.mine;
    s.kind = kind;
    s.op = op;
    s.root = root;
    if (in.defined()) {
      s.dtype = in.scalar_type();
      s.numel = in.numel();
      s.in = in.data_ptr();
      s.out = out.data_ptr();
      s.in_tensor = in;
      s.out_tensor = out;
    }
    shared_->barrier(rank(), what, deadline, o.timeout);
    check_kinds(kind);
    if (in.defined()) {
      const Slot& z = slot(0);
      for (int r = 1; r < size(); ++r) {
        const Slot& x = slot(r);
        if (x.dtype != z.dtype || x.numel != z.numel)
          throw CommError(std::string(what) + ": rank 0 has " + shape_of(0) + ", rank " + std::to_string(r) +
                          " has " + shape_of(r));
        if ((kind == Kind::kAllreduce || kind == Kind::kReduceScatter) && x.op != z.op)
          throw CommError(std::string(what) + ": rank 0 reduces with " + to_string(z.op) + ", rank " +
                          std::to_string(r) + " with " + to_string(x.op));
        if (kind == Kind::kBroadcast && x.root != z.root)
          throw CommError(std::string(what) + ": rank 0 has root " + std::to_string(z.root) + ", rank " +
                          std::to_string(r) + " has root " + std::to_string(x.root));
      }
    }
    return o;
  }

  // The last barrier of an op: after it nobody touches this rank's buffers any more.
  void end(Op& o) {
    shared_->barrier(rank(), o.what, o.deadline, o.timeout);
    o.mine.in_tensor.reset();
    o.mine.out_tensor.reset();
    o.mine.kind = Kind::kNone;
  }

  void check_kinds(Kind kind) {
    for (int r = 0; r < size(); ++r)
      if (slot(r).kind != slot(0).kind)
        throw CommError(std::string("collective mismatch: rank 0 called ") + kind_name(slot(0).kind) +
                        ", rank " + std::to_string(r) + " called " + kind_name(slot(r).kind));
  }

  // Formatted only on the error path, from the (still alive) posted tensors.
  std::string shape_of(int r) {
    const Slot& s = slot(r);
    return s.in_tensor.defined() ? describe(s.in_tensor) : std::string(c10::toString(s.dtype));
  }

  std::shared_ptr<Shared> shared_;
};

}  // namespace

std::vector<CommunicatorPtr> make_local_group(int n, const std::string& name) {
  TETRA_CHECK(n >= 1, "make_local_group: a group needs at least 1 rank, got ", n);
  auto shared = std::make_shared<Shared>(n);
  std::vector<CommunicatorPtr> comms;
  comms.reserve(static_cast<size_t>(n));
  // One identity for the n members, known only in this process (they all live here).
  static std::atomic<int64_t> groups{0};
  const std::string identity = "local:" + std::to_string(++groups);
  for (int r = 0; r < n; ++r) {
    auto c = std::make_shared<LocalCommunicator>(r, n, name, shared);
    c->name_group(identity);
    comms.push_back(with_health(std::move(c)));  // Note [Health wrapper]
  }
  return comms;
}

void abort_local_group(Communicator& comm, const std::string& reason) {
  if (auto* local = dynamic_cast<LocalCommunicator*>(&comm.transport())) local->shared().abort(comm.rank(), reason);
}

void run_local_ranks(int n, const std::function<void(int rank, Communicator& comm)>& fn) {
  auto comms = make_local_group(n);
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, *comms[static_cast<size_t>(r)]);
      } catch (...) {
        std::string what = "unknown exception";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) first = std::current_exception();
        }
        abort_local_group(*comms[static_cast<size_t>(r)], "run_local_ranks: " + what);
      }
    });
  }
  for (auto& t : threads) t.join();
  comms.clear();  // each drains its queue (aborted groups fail fast)
  if (first) std::rethrow_exception(first);
}

}  // namespace tetra::collectives
