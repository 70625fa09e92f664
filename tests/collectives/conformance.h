// The backend conformance suite: what every Communicator must do, as gtest checks that
// run on one rank's communicator.
//
// Each rank of a group calls the same functions in the same order (thread-ranks over
// `local` from test_local.cpp; MPI processes from the mpi tests) and checks its own
// results. Every value is a small integer computed from (rank, size, index), exact in
// every dtype, and the expected results are computed with plain torch ops in the
// tensor's own dtype (so u8 sums wrap mod 256 exactly as the backend's do). Failures are
// EXPECTs, never early returns, so that every rank keeps issuing the same collectives;
// ops carry Config::timeout so that a broken backend fails instead of hanging.
//
// Send/recv use small messages (a few elements), which MPI sends eagerly: each rank
// sends before it receives, on a progress thread that runs its ops one at a time.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "collectives/communicator.h"

namespace tetra::collectives::conformance {

struct Config {
  Duration timeout = std::chrono::seconds(60);  // for every op
  int64_t large_numel = 1 << 20;                // f32 allreduce sum; 0 skips it
};

inline const std::vector<at::ScalarType>& dtypes() {
  static const std::vector<at::ScalarType> all = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                                  at::kInt,   at::kLong,   at::kByte};
  return all;
}

inline const std::vector<ReduceOp>& reduce_ops() {
  static const std::vector<ReduceOp> all = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                                            ReduceOp::kProd};
  return all;
}

// Rank `rank`'s element i, for reductions with `op`: within -5..5 (0..10 for u8), and
// +-1 or +-2 for prod (1 or 2 for u8), so that sums and products over up to 8 ranks are
// exact in every dtype (bf16 holds integers up to 256 exactly).
inline at::Tensor pattern(int rank, int64_t n, at::ScalarType dt, ReduceOp op = ReduceOp::kSum, int salt = 0) {
  const bool is_signed = dt != at::kByte;
  at::Tensor i = at::arange(n, at::kLong);
  at::Tensor v;
  if (op == ReduceOp::kProd) {
    // 2 where (i + rank + salt) % 3 == 0, else 1: at most 3 of any 8 ranks, |prod| <= 8.
    at::Tensor two = ((i + rank + salt) % 3 == 0).to(at::kLong) + 1;
    v = is_signed ? at::where((i * 5 + rank * 3 + salt) % 4 == 0, -two, two) : two;
  } else {
    v = (i * 7 + rank * 3 + salt) % 11;  // 0..10
    if (is_signed) v = v - 5;             // -5..5
  }
  return v.to(dt);
}

// Values near the top of u8, so that sums wrap mod 256.
inline at::Tensor u8_wrap_pattern(int rank, int64_t n) {
  at::Tensor i = at::arange(n, at::kLong);
  return (100 + (i * 11 + rank * 37) % 150).to(at::kByte);
}

// The reduction of every rank's pattern, computed with plain torch ops in dtype `dt`.
inline at::Tensor expected_reduction(int size, int64_t n, at::ScalarType dt, ReduceOp op, int salt = 0) {
  at::Tensor acc = pattern(0, n, dt, op, salt);
  for (int k = 1; k < size; ++k) {
    at::Tensor p = pattern(k, n, dt, op, salt);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc = acc + p; break;
      case ReduceOp::kProd: acc = acc * p; break;
      case ReduceOp::kMin: acc = at::minimum(acc, p); break;
      case ReduceOp::kMax: acc = at::maximum(acc, p); break;
    }
  }
  if (op == ReduceOp::kAvg) acc = acc / size;  // floating dtypes only: stays in dt
  EXPECT_EQ(acc.scalar_type(), dt);
  return acc;
}

// ---- helpers ----------------------------------------------------------------------

inline std::string label(const Communicator& c, const std::string& what) {
  return c.backend() + " rank " + std::to_string(c.rank()) + "/" + std::to_string(c.size()) + ": " + what;
}

inline std::string case_name(const char* op, at::ScalarType dt, int64_t n, const char* extra = "") {
  return std::string(op) + " " + c10::toString(dt) + "[" + std::to_string(n) + "]" + extra;
}

// Waits; a failure is a gtest failure (and false), never an exception out of the suite.
// The message a failed op's wait() throws ("" when it succeeded).
inline std::string error_of(const WorkPtr& w) {
  try {
    w->wait();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

inline bool wait_ok(const WorkPtr& w) {
  try {
    w->wait();
    return true;
  } catch (const std::exception& e) {
    ADD_FAILURE() << w->what() << " failed: " << e.what();
    return false;
  }
}

// Exact equality (or closeness, for avg), reporting the first bad element.
inline void expect_tensor_eq(const at::Tensor& got, const at::Tensor& want, bool exact = true) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type());
  ASSERT_EQ(got.numel(), want.numel());
  if (got.numel() == 0) return;
  at::Tensor g = got.reshape({-1}).to(at::kDouble), w = want.reshape({-1}).to(at::kDouble);
  double rtol = 0;
  if (!exact) {
    switch (got.scalar_type()) {
      case at::kBFloat16: rtol = 1e-2; break;
      case at::kHalf: rtol = 1e-3; break;
      case at::kFloat: rtol = 1e-6; break;
      default: rtol = 1e-12; break;
    }
  }
  at::Tensor bad = (g - w).abs() > (w.abs() * rtol + (exact ? 0.0 : rtol));
  if (!bad.any().item<bool>()) return;
  const int64_t i = bad.to(at::kByte).argmax().item<int64_t>();
  ADD_FAILURE() << bad.sum().item<int64_t>() << " of " << got.numel() << " elements differ; first at " << i
                << ": got " << g[i].item<double>() << ", want " << w[i].item<double>();
}

// The op must fail at once (validated before it is queued) with a CommError saying `text`.
inline void expect_rejected(const WorkPtr& w, const std::string& text) {
  EXPECT_TRUE(w->done()) << w->what() << ": a validation error must finish the Work before it is queued";
  try {
    w->wait();
    ADD_FAILURE() << w->what() << ": expected a CommError saying \"" << text << "\"";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos)
        << "message \"" << e.what() << "\" does not say \"" << text << "\"";
  } catch (const std::exception& e) {
    ADD_FAILURE() << w->what() << ": expected a CommError, got " << e.what();
  }
}

inline std::vector<int64_t> reduce_sizes(const Communicator& c) {
  return {0, 1, 7, static_cast<int64_t>(c.size()) * 3 + 1};
}

// ---- the ops ----------------------------------------------------------------------

// allreduce: every dtype x reduce op x size, in place and out of place; avg on integer
// dtypes is rejected; u8 sums wrap.
inline void check_allreduce(Communicator& c, const Config& cfg = {}) {
  const int r = c.rank(), s = c.size();
  for (at::ScalarType dt : dtypes()) {
    for (ReduceOp op : reduce_ops()) {
      AllreduceOptions opts;
      opts.op = op;
      opts.timeout = cfg.timeout;
      for (int64_t n : reduce_sizes(c)) {
        SCOPED_TRACE(label(c, case_name("allreduce", dt, n, (std::string(" ") + to_string(op)).c_str())));
        if (op == ReduceOp::kAvg && !at::isFloatingType(dt)) {
          expect_rejected(c.allreduce(pattern(r, n, dt), opts), "avg needs a floating-point");
          expect_rejected(c.allreduce(pattern(r, n, dt), at::empty({n}, dt), opts), "avg needs a floating-point");
          continue;
        }
        const at::Tensor want = expected_reduction(s, n, dt, op);
        // In place.
        at::Tensor t = pattern(r, n, dt, op);
        if (wait_ok(c.allreduce(t, opts))) expect_tensor_eq(t, want, op != ReduceOp::kAvg);
        // Out of place: the input is left alone.
        at::Tensor in = pattern(r, n, dt, op), out = at::zeros({n}, dt);
        if (wait_ok(c.allreduce(in, out, opts))) {
          expect_tensor_eq(out, want, op != ReduceOp::kAvg);
          expect_tensor_eq(in, pattern(r, n, dt, op));
        }
      }
    }
  }
  // u8 sums wrap mod 256.
  {
    SCOPED_TRACE(label(c, "allreduce u8 wrap"));
    const int64_t n = 13;
    at::Tensor want = u8_wrap_pattern(0, n);
    for (int k = 1; k < s; ++k) want = want + u8_wrap_pattern(k, n);
    at::Tensor t = u8_wrap_pattern(r, n);
    AllreduceOptions opts;
    opts.timeout = cfg.timeout;
    if (wait_ok(c.allreduce(t, opts))) expect_tensor_eq(t, want);
  }
  // Shapes other than 1-d: a 0-d scalar and a 3x5 matrix.
  {
    SCOPED_TRACE(label(c, "allreduce shapes"));
    AllreduceOptions opts;
    opts.timeout = cfg.timeout;
    at::Tensor scalar = pattern(r, 1, at::kFloat).reshape({});
    at::Tensor matrix = pattern(r, 15, at::kDouble).reshape({3, 5});
    if (wait_ok(c.allreduce(scalar, opts)))
      expect_tensor_eq(scalar, expected_reduction(s, 1, at::kFloat, ReduceOp::kSum).reshape({}));
    if (wait_ok(c.allreduce(matrix, opts)))
      expect_tensor_eq(matrix, expected_reduction(s, 15, at::kDouble, ReduceOp::kSum).reshape({3, 5}));
  }
}

// One large f32 allreduce (sum, in place and out of place).
inline void check_allreduce_large(Communicator& c, const Config& cfg = {}) {
  if (cfg.large_numel <= 0) return;
  const int64_t n = cfg.large_numel;
  SCOPED_TRACE(label(c, case_name("allreduce large", at::kFloat, n)));
  AllreduceOptions opts;
  opts.timeout = cfg.timeout;
  const at::Tensor want = expected_reduction(c.size(), n, at::kFloat, ReduceOp::kSum);
  at::Tensor t = pattern(c.rank(), n, at::kFloat);
  if (wait_ok(c.allreduce(t, opts))) expect_tensor_eq(t, want);
  at::Tensor out = at::empty({n}, at::kFloat);
  if (wait_ok(c.allreduce(pattern(c.rank(), n, at::kFloat), out, opts))) expect_tensor_eq(out, want);
}

// reduce_scatter: every dtype x reduce op, chunks of 0, 1 and 5 elements.
inline void check_reduce_scatter(Communicator& c, const Config& cfg = {}) {
  const int r = c.rank(), s = c.size();
  for (at::ScalarType dt : dtypes()) {
    for (ReduceOp op : reduce_ops()) {
      ReduceScatterOptions opts;
      opts.op = op;
      opts.timeout = cfg.timeout;
      for (int64_t m : {0, 1, 5}) {
        const int64_t n = m * s;
        SCOPED_TRACE(label(c, case_name("reduce_scatter", dt, n, (std::string(" ") + to_string(op)).c_str())));
        at::Tensor in = pattern(r, n, dt, op), out = at::zeros({m}, dt);
        if (op == ReduceOp::kAvg && !at::isFloatingType(dt)) {
          expect_rejected(c.reduce_scatter(in, out, opts), "avg needs a floating-point");
          continue;
        }
        if (wait_ok(c.reduce_scatter(in, out, opts))) {
          expect_tensor_eq(out, expected_reduction(s, n, dt, op).narrow(0, r * m, m), op != ReduceOp::kAvg);
          expect_tensor_eq(in, pattern(r, n, dt, op));
        }
      }
    }
  }
}

// allgather: every dtype, chunks of 0, 1 and 5 elements; rank k's input lands in chunk k.
inline void check_allgather(Communicator& c, const Config& cfg = {}) {
  const int r = c.rank(), s = c.size();
  AllgatherOptions opts;
  opts.timeout = cfg.timeout;
  for (at::ScalarType dt : dtypes()) {
    for (int64_t m : {0, 1, 5}) {
      SCOPED_TRACE(label(c, case_name("allgather", dt, m)));
      at::Tensor in = pattern(r, m, dt, ReduceOp::kSum, 3), out = at::zeros({m * s}, dt);
      if (!wait_ok(c.allgather(in, out, opts))) continue;
      std::vector<at::Tensor> parts;
      for (int k = 0; k < s; ++k) parts.push_back(pattern(k, m, dt, ReduceOp::kSum, 3));
      expect_tensor_eq(out, at::cat(parts));
    }
  }
}

// broadcast: every dtype, sizes 0, 1 and 7, from every root.
inline void check_broadcast(Communicator& c, const Config& cfg = {}) {
  const int r = c.rank(), s = c.size();
  for (at::ScalarType dt : dtypes()) {
    for (int64_t n : {0, 1, 7}) {
      for (int root = 0; root < s; ++root) {
        SCOPED_TRACE(label(c, case_name("broadcast", dt, n, (" from " + std::to_string(root)).c_str())));
        BroadcastOptions opts;
        opts.root = root;
        opts.timeout = cfg.timeout;
        at::Tensor t = pattern(r, n, dt, ReduceOp::kSum, 5);
        if (wait_ok(c.broadcast(t, opts))) expect_tensor_eq(t, pattern(root, n, dt, ReduceOp::kSum, 5));
      }
    }
  }
}

// A ring: rank r sends tags 1 then 2 to r+1 and receives tag 2 then tag 1 from r-1, so
// each recv must pass over a pending message of the other tag. A sent buffer may be
// reused once its send finished.
inline void check_send_recv(Communicator& c, const Config& cfg = {}) {
  const int r = c.rank(), s = c.size();
  if (s < 2) return;
  const int next = (r + 1) % s, prev = (r + s - 1) % s;
  for (at::ScalarType dt : dtypes()) {
    SCOPED_TRACE(label(c, case_name("send/recv ring", dt, 7)));
    SendOptions t1, t2;
    t1.tag = 1;
    t2.tag = 2;
    t1.timeout = t2.timeout = cfg.timeout;
    RecvOptions r1, r2;
    r1.tag = 1;
    r2.tag = 2;
    r1.timeout = r2.timeout = cfg.timeout;
    at::Tensor a = pattern(r, 7, dt, ReduceOp::kSum, 1), b = pattern(r, 7, dt, ReduceOp::kSum, 2);
    WorkPtr sa = c.send(a, next, t1), sb = c.send(b, next, t2);
    at::Tensor got_b = at::zeros({7}, dt), got_a = at::zeros({7}, dt);
    WorkPtr rb = c.recv(got_b, prev, r2), ra = c.recv(got_a, prev, r1);
    if (wait_ok(sa)) a.zero_();
    if (wait_ok(sb)) b.zero_();
    if (wait_ok(rb)) expect_tensor_eq(got_b, pattern(prev, 7, dt, ReduceOp::kSum, 2));
    if (wait_ok(ra)) expect_tensor_eq(got_a, pattern(prev, 7, dt, ReduceOp::kSum, 1));
  }
  // Several messages with one tag arrive in the order they were sent; an empty message too.
  {
    SCOPED_TRACE(label(c, "send/recv FIFO"));
    SendOptions so;
    so.tag = 7;
    so.timeout = cfg.timeout;
    RecvOptions ro;
    ro.tag = 7;
    ro.timeout = cfg.timeout;
    std::vector<WorkPtr> works;
    for (int k = 0; k < 3; ++k) works.push_back(c.send(at::full({2}, r * 10 + k, at::kInt), next, so));
    works.push_back(c.send(at::empty({0}, at::kFloat), next, so));
    std::vector<at::Tensor> got;
    for (int k = 0; k < 3; ++k) {
      got.push_back(at::zeros({2}, at::kInt));
      works.push_back(c.recv(got.back(), prev, ro));
    }
    works.push_back(c.recv(at::empty({0}, at::kFloat), prev, ro));
    bool ok = true;
    for (auto& w : works) ok = wait_ok(w) && ok;
    if (ok)
      for (int k = 0; k < 3; ++k) expect_tensor_eq(got[static_cast<size_t>(k)], at::full({2}, prev * 10 + k, at::kInt));
  }
}

// Communicator::awaited() is true exactly while a caller blocks in wait() on one of its
// ops: backends poll politely otherwise (Note [Awaited and background polls] in mpi.h).
inline void check_awaited(Communicator& c, const Config& cfg = {}) {
  SCOPED_TRACE(label(c, "awaited"));
  EXPECT_FALSE(c.awaited());
  if (c.size() < 2) return;
  // The signal that rank 0's waiter is counted travels over another communicator: on
  // this one it would queue behind the receive it is about to unblock.
  auto side = c.split(0, c.rank(), "awaited side", cfg.timeout);
  BarrierOptions bo;
  bo.timeout = cfg.timeout;
  if (c.rank() == 0) {
    at::Tensor got = at::zeros({3}, at::kInt);
    RecvOptions ro;
    ro.timeout = cfg.timeout;
    WorkPtr w = c.recv(got, 1, ro);
    EXPECT_FALSE(c.awaited()) << "an op nobody waits on yet";
    std::thread waiter([&] { wait_ok(w); });
    const auto give_up = std::chrono::steady_clock::now() + cfg.timeout;
    while (!c.awaited() && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    EXPECT_TRUE(c.awaited()) << "a caller blocked in wait()";
    wait_ok(side->barrier(bo));
    waiter.join();
    expect_tensor_eq(got, at::full({3}, 5, at::kInt));
    EXPECT_FALSE(c.awaited()) << "the wait returned";
    w->wait();  // done already: returns at once and counts nobody
    EXPECT_FALSE(c.awaited());
  } else {
    wait_ok(side->barrier(bo));
    if (c.rank() == 1) {
      SendOptions so;
      so.timeout = cfg.timeout;
      wait_ok(c.send(at::full({3}, 5, at::kInt), 0, so));
    }
  }
}

inline void check_barrier(Communicator& c, const Config& cfg = {}) {
  SCOPED_TRACE(label(c, "barrier"));
  BarrierOptions opts;
  opts.timeout = cfg.timeout;
  for (int k = 0; k < 3; ++k) wait_ok(c.barrier(opts));
  // Barriers queue behind other ops like any op.
  at::Tensor t = at::ones({3}, at::kInt);
  AllreduceOptions ao;
  ao.timeout = cfg.timeout;
  WorkPtr a = c.allreduce(t, ao);
  WorkPtr b = c.barrier(opts);
  if (wait_ok(b)) {
    EXPECT_TRUE(a->done());
    if (wait_ok(a)) expect_tensor_eq(t, at::full({3}, c.size(), at::kInt));
  }
}

// split: even/odd ranks, the whole group with the order reversed by key, and a color < 0
// (no group); each new group's allreduce sums its own members only, and the parent
// still works afterwards.
inline void check_split(Communicator& c, const Config& cfg = {}) {
  const int r = c.rank(), s = c.size();
  AllreduceOptions ao;
  ao.timeout = cfg.timeout;
  {
    SCOPED_TRACE(label(c, "split even/odd"));
    CommunicatorPtr sub;
    try {
      sub = c.split(r % 2, r, "parity", cfg.timeout);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "split failed: " << e.what();
    }
    if (sub) {
      const int parity = r % 2;
      int members = 0, sum = 0;
      for (int k = parity; k < s; k += 2) ++members, sum += k + 1;
      EXPECT_EQ(sub->size(), members);
      EXPECT_EQ(sub->rank(), r / 2);
      EXPECT_EQ(sub->backend(), c.backend());
      EXPECT_EQ(sub->name(), "parity");
      at::Tensor t = at::full({5}, r + 1, at::kLong);
      if (wait_ok(sub->allreduce(t, ao))) expect_tensor_eq(t, at::full({5}, sum, at::kLong));
    } else {
      ADD_FAILURE() << "split with color " << r % 2 << " gave no communicator";
    }
  }
  {
    SCOPED_TRACE(label(c, "split reversed by key"));
    CommunicatorPtr sub;
    try {
      sub = c.split(0, s - r, "", cfg.timeout);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "split failed: " << e.what();
    }
    if (sub) {
      EXPECT_EQ(sub->size(), s);
      EXPECT_EQ(sub->rank(), s - 1 - r);
      // New rank 0 is old rank s-1: its value reaches everyone.
      BroadcastOptions bo;
      bo.timeout = cfg.timeout;
      at::Tensor t = at::full({3}, r, at::kInt);
      if (wait_ok(sub->broadcast(t, bo))) expect_tensor_eq(t, at::full({3}, s - 1, at::kInt));
      at::Tensor order = at::zeros({s}, at::kInt);
      order[sub->rank()].fill_(r);  // new rank k holds old rank s-1-k
      if (wait_ok(sub->allreduce(order, ao))) expect_tensor_eq(order, at::arange(s - 1, -1, -1, at::kInt));
    } else {
      ADD_FAILURE() << "split with color 0 gave no communicator";
    }
  }
  {
    SCOPED_TRACE(label(c, "split with color < 0"));
    CommunicatorPtr sub;
    try {
      sub = c.split(r == 0 ? -1 : 1, r, "rest", cfg.timeout);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "split failed: " << e.what();
    }
    if (r == 0) {
      EXPECT_EQ(sub, nullptr);
    } else if (sub) {
      EXPECT_EQ(sub->size(), s - 1);
      EXPECT_EQ(sub->rank(), r - 1);
      at::Tensor t = at::ones({2}, at::kFloat);
      if (wait_ok(sub->allreduce(t, ao))) expect_tensor_eq(t, at::full({2}, s - 1, at::kFloat));
    } else {
      ADD_FAILURE() << "split with color 1 gave no communicator";
    }
  }
  {
    SCOPED_TRACE(label(c, "parent after split"));
    at::Tensor t = at::ones({4}, at::kFloat);
    if (wait_ok(c.allreduce(t, ao))) expect_tensor_eq(t, at::full({4}, s, at::kFloat));
  }
}

// `sub`, from `parent.split`, must be the group of `members` (parent ranks, in their new
// rank order; empty: this rank joins none and gets nullptr), with the parent's backend.
inline void expect_split_group(Communicator& parent, const CommunicatorPtr& sub, const std::vector<int>& members,
                               const Config& cfg) {
  if (members.empty()) {
    EXPECT_EQ(sub, nullptr);
    return;
  }
  ASSERT_TRUE(sub) << "no communicator for a rank that joins a group";
  const int n = static_cast<int>(members.size());
  EXPECT_EQ(sub->backend(), parent.backend());
  EXPECT_EQ(sub->size(), n);
  if (sub->rank() >= 0 && sub->rank() < n)
    EXPECT_EQ(members[static_cast<size_t>(sub->rank())], parent.rank()) << "new rank " << sub->rank();
  else
    ADD_FAILURE() << "new rank " << sub->rank() << " outside a group of " << n;
  // Every member in its place, seen from every member.
  AllgatherOptions go;
  go.timeout = cfg.timeout;
  at::Tensor order = at::zeros({n}, at::kInt);
  if (wait_ok(sub->allgather(at::full({1}, parent.rank(), at::kInt), order, go)))
    expect_tensor_eq(order, at::tensor(members, at::kInt));
  BroadcastOptions bo;
  bo.root = n - 1;
  bo.timeout = cfg.timeout;
  at::Tensor last = at::full({2}, parent.rank(), at::kLong);
  if (wait_ok(sub->broadcast(last, bo))) expect_tensor_eq(last, at::full({2}, members.back(), at::kLong));
  AllreduceOptions ao;
  ao.timeout = cfg.timeout;
  int64_t sum = 0;
  for (int m : members) sum += m + 1;
  at::Tensor t = at::full({3}, parent.rank() + 1, at::kLong);
  if (wait_ok(sub->allreduce(t, ao))) expect_tensor_eq(t, at::full({3}, sum, at::kLong));
}

// split on a group laid out as `procs` blocks of size()/procs consecutive ranks (processes
// of replicas: rank = p * R + q), with colors and keys that keep each new group a
// rectangle of blocks x positions taken block by block — the splits a hierarchical
// communicator can make (check_split's even/odd and "all but rank 0" groups are not
// rectangles when R > 1 and procs > 1). What data parallelism (per host, across hosts) and
// ZeRO-3 (a dup) ask for are among them. A flat group of any backend passes it too.
inline void check_split_rectangles(Communicator& c, int procs, const Config& cfg = {}) {
  const int s = c.size(), R = s / procs, g = c.rank(), p = g / R, q = g % R;
  ASSERT_EQ(procs * R, s) << "a layout of " << procs << " blocks does not divide " << s << " ranks";
  auto split = [&](int color, int key, const char* what) -> CommunicatorPtr {
    try {
      return c.split(color, key, what, cfg.timeout);
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": split failed: " << e.what();
      return nullptr;
    }
  };
  auto ranks = [&](auto&& in_group) {  // the members, in flat (rank) order
    std::vector<int> m;
    for (int k = 0; k < s; ++k)
      if (in_group(k / R, k % R)) m.push_back(k);
    return m;
  };
  {
    SCOPED_TRACE(label(c, "split per process (per host)"));
    expect_split_group(c, split(p, g, "per process"), ranks([&](int kp, int) { return kp == p; }), cfg);
  }
  {
    SCOPED_TRACE(label(c, "split per replica index (across hosts, as data parallelism does)"));
    expect_split_group(c, split(q, p, "per replica index"), ranks([&](int, int kq) { return kq == q; }), cfg);
  }
  {
    SCOPED_TRACE(label(c, "split a dup (as ZeRO-3 does)"));
    expect_split_group(c, split(0, g, "dup"), ranks([](int, int) { return true; }), cfg);
  }
  {
    SCOPED_TRACE(label(c, "split reversed by key"));
    std::vector<int> m = ranks([](int, int) { return true; });
    std::reverse(m.begin(), m.end());
    expect_split_group(c, split(0, s - g, "reversed"), m, cfg);
  }
  {
    SCOPED_TRACE(label(c, "split with the positions reversed in each block"));
    std::vector<int> m;
    for (int kp = 0; kp < procs; ++kp)
      for (int kq = R - 1; kq >= 0; --kq) m.push_back(kp * R + kq);
    expect_split_group(c, split(0, p * R + (R - 1 - q), "positions reversed"), m, cfg);
  }
  CommunicatorPtr parity;
  {
    SCOPED_TRACE(label(c, "split by position parity"));
    parity = split(q % 2, g, "position parity");
    expect_split_group(c, parity, ranks([&](int, int kq) { return kq % 2 == q % 2; }), cfg);
  }
  if (parity) {
    SCOPED_TRACE(label(c, "split of a split (position parity, then per process)"));
    CommunicatorPtr sub;
    try {
      sub = parity->split(p, parity->rank(), "parity per process", cfg.timeout);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "split failed: " << e.what();
    }
    // The parity group's ranks are its members' old ranks in order: map them back.
    const std::vector<int> parity_members = ranks([&](int, int kq) { return kq % 2 == q % 2; });
    std::vector<int> m;
    for (int k = 0; k < static_cast<int>(parity_members.size()); ++k)
      if (parity_members[static_cast<size_t>(k)] / R == p) m.push_back(k);
    expect_split_group(*parity, sub, m, cfg);
  }
  {
    SCOPED_TRACE(label(c, "split by block parity"));
    expect_split_group(c, split(p % 2, g, "block parity"), ranks([&](int kp, int) { return kp % 2 == p % 2; }), cfg);
  }
  {
    // color < 0: the whole first block (or, with one block, the first position of it).
    SCOPED_TRACE(label(c, "split with color < 0"));
    const bool out = procs > 1 ? p == 0 : q == 0;
    expect_split_group(c, split(out ? -1 : 1, g, "rest"),
                       out ? std::vector<int>{}
                           : ranks([&](int kp, int kq) { return !(procs > 1 ? kp == 0 : kq == 0); }),
                       cfg);
  }
  {
    SCOPED_TRACE(label(c, "parent after split"));
    AllreduceOptions ao;
    ao.timeout = cfg.timeout;
    at::Tensor t = at::ones({4}, at::kFloat);
    if (wait_ok(c.allreduce(t, ao))) expect_tensor_eq(t, at::full({4}, s, at::kFloat));
  }
}

// Bad calls fail from wait() with a CommError that says what is wrong, before they are
// queued, and leave the communicator working.
inline void check_validation(Communicator& c, const Config& cfg = {}) {
  const int r = c.rank(), s = c.size();
  SCOPED_TRACE(label(c, "validation"));
  AllreduceOptions ao;
  ao.timeout = cfg.timeout;
  expect_rejected(c.allreduce(at::zeros({4, 3}).t(), ao), "is not contiguous");
  expect_rejected(c.allreduce(at::zeros({4}, at::kBool), ao), "dtype Bool");
  expect_rejected(c.allreduce(at::zeros({4}, at::kComplexFloat), ao), "is not supported");
  expect_rejected(c.allreduce(at::zeros({4}), at::zeros({4}, at::kDouble), ao), "input is Float but output is Double");
  expect_rejected(c.allreduce(at::zeros({4}), at::zeros({5}), ao), "differ in size");
  expect_rejected(c.allreduce(at::Tensor(), ao), "undefined");
  ao.op = ReduceOp::kAvg;
  expect_rejected(c.allreduce(at::zeros({4}, at::kInt), ao), "avg needs a floating-point tensor, got Int");
  expect_rejected(c.reduce_scatter(at::zeros({s * 3 + 1}), at::zeros({3})), "must hold");
  expect_rejected(c.allgather(at::zeros({3}), at::zeros({s * 3 + 1})), "must hold");
  BroadcastOptions bo;
  bo.root = s;
  expect_rejected(c.broadcast(at::zeros({2}), bo), "root rank " + std::to_string(s) + " is outside the group");
  bo.root = -1;
  expect_rejected(c.broadcast(at::zeros({2}), bo), "is outside the group");
  expect_rejected(c.send(at::zeros({2}), r), "cannot send to itself");
  expect_rejected(c.recv(at::zeros({2}), r), "cannot receive from itself");
  expect_rejected(c.send(at::zeros({2}), s), "outside the group");
  if (s > 1) {
    SendOptions so;
    so.tag = -1;
    expect_rejected(c.send(at::zeros({2}), (r + 1) % s, so), "tags must be >= 0");
  }
  // Not broken: a collective still works, and synchronize() has nothing to report.
  AllreduceOptions sum;
  sum.timeout = cfg.timeout;
  at::Tensor t = at::full({3}, r, at::kLong);
  if (wait_ok(c.allreduce(t, sum))) expect_tensor_eq(t, at::full({3}, int64_t(s) * (s - 1) / 2, at::kLong));
  EXPECT_NO_THROW(c.synchronize());
}

// Everything above, in one fixed order.
inline void run_all(Communicator& c, const Config& cfg = {}) {
  check_allreduce(c, cfg);
  check_allreduce_large(c, cfg);
  check_reduce_scatter(c, cfg);
  check_allgather(c, cfg);
  check_broadcast(c, cfg);
  check_send_recv(c, cfg);
  check_awaited(c, cfg);
  check_barrier(c, cfg);
  check_split(c, cfg);
  check_validation(c, cfg);
}

}  // namespace tetra::collectives::conformance
