// bench-collectives — collective bandwidth, in the manner of nccl-tests.
//
//   mpirun -np 2 bench-collectives --op allreduce --min-bytes 1M --max-bytes 64M [--in-place] [-c]
//   bench-collectives --backend local --ranks 2 ...
//
// Prints per size: bytes, element count, time (us), algbw and busbw (GB/s). busbw uses
// nccl-tests' factors: allreduce 2(n-1)/n, reduce_scatter and allgather (n-1)/n,
// broadcast and sendrecv 1. Sizes follow nccl-tests: the allreduce/broadcast buffer, the
// gathered (allgather) or scattered-from (reduce_scatter) buffer.
//   --bare        (mpi, allreduce) also times a bare MPI_Allreduce on the same buffers in
//                 the same mode and prints tetra/bare.
//   --bound       (local, allreduce) also measures add and copy bandwidth and prints the
//                 shared-memory bound 1 / (0.5/add + 0.5/copy) and busbw/bound.
//   --fused N     also time N tensors of --min-bytes: N separate calls vs one fused call.
//   --rounds R    times each size R times (alternating with --bare) and keeps the best.
//   -c            checks every result.   --json  one JSON object per size.
//   --calibrate FILE
//                 measures what the cost model needs (Note [Cost model]) and writes it as
//                 a calibration file for train --dry-run --calibration: alpha and beta of
//                 a link inside a host (two ranks of one host) and across hosts (rank 0
//                 and the first rank of another host), by ping-pong of tetra's send/recv
//                 (alpha: half the round trip of 8 bytes; beta: the slope between the two
//                 largest messages), and a rank's matmul rate on one thread while every
//                 rank computes (ranks that share a core share it here too). A link
//                 class the launch has no pair for keeps its default, and says so. Run it
//                 across the hosts the plan is for (tools/test-hosts.sh run -np 4 ...).
#include <CLI/CLI.hpp>
#define OMPI_SKIP_MPICXX 1  // the C API only: the C++ bindings need libmpi_cxx
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include "collectives/backends.h"
#include "collectives/error.h"
#include "collectives/launch.h"
#include "collectives/local.h"
#include "collectives/mpi.h"
#include "collectives/topology_gather.h"
#include "tools/bench/fused_allreduce.h"
#include "tools/planner/cost_model.h"
#include "core/runtime.h"
#include "hardware/host.h"

using namespace tetra::collectives;

namespace {

struct Args {
  std::string op = "allreduce", backend = "mpi", dtype = "float";
  std::string min_bytes = "1M", max_bytes = "64M";
  double factor = 2;
  int iters = 20, warmup = 5, ranks = 2, fused = 0, rounds = 1;
  bool in_place = false, check = false, json = false, bare = false, bound = false;
  std::string calibrate;  // a calibration file to write
};

int64_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  std::string unit = end ? end : "";
  double mul = 1;
  if (unit == "K" || unit == "KiB" || unit == "k") mul = 1024;
  else if (unit == "M" || unit == "MiB") mul = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB") mul = 1024.0 * 1024 * 1024;
  else if (!unit.empty() && unit != "B") throw tetra::ConfigError("bad byte size \"" + s + "\" (use e.g. 4096, 64K, 16M)");
  return static_cast<int64_t>(v * mul);
}

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "float" || s == "f32") return at::kFloat;
  if (s == "double" || s == "f64") return at::kDouble;
  if (s == "bf16") return at::kBFloat16;
  if (s == "half" || s == "f16") return at::kHalf;
  if (s == "int" || s == "i32") return at::kInt;
  if (s == "int64" || s == "i64") return at::kLong;
  if (s == "uint8" || s == "u8") return at::kByte;
  throw tetra::ConfigError("unknown dtype \"" + s + "\" (f32 f64 bf16 f16 i32 i64 u8)");
}

double bus_factor(const std::string& op, int n) {
  if (op == "allreduce") return n > 1 ? 2.0 * (n - 1) / n : 0;
  if (op == "reduce_scatter" || op == "allgather") return n > 1 ? double(n - 1) / n : 0;
  return 1;
}

using Clock = std::chrono::steady_clock;

// The buffers of one rank for one size, and the op that runs on them.
struct Case {
  at::Tensor in, out;
  std::function<void()> run;       // one tetra op, waited
  std::function<bool()> verify;    // after one run on fresh data
};

Case make_case(const Args& a, Communicator& comm, int64_t bytes, at::ScalarType dt) {
  const int n = comm.size(), r = comm.rank();
  const int64_t esz = c10::elementSize(dt);
  int64_t count = std::max<int64_t>(1, bytes / esz);
  Case c;
  // Where the backend carries tensors (Note [Two planes]): nccl's on its GPU.
  auto opts = at::TensorOptions().dtype(dt).device(comm.device());
  if (a.op == "allreduce") {
    c.in = at::full({count}, r + 1, opts);
    c.out = a.in_place ? c.in : at::empty({count}, opts);
    c.run = [&comm, in = c.in, out = c.out, ip = a.in_place] {
      (ip ? comm.allreduce(in) : comm.allreduce(in, out))->wait();
    };
    c.verify = [&comm, in = c.in, out = c.out, n, r, ip = a.in_place] {
      in.fill_(r + 1);
      (ip ? comm.allreduce(in) : comm.allreduce(in, out))->wait();
      return (out == n * (n + 1) / 2).all().item<bool>();
    };
  } else if (a.op == "reduce_scatter") {
    count = std::max<int64_t>(n, count / n * n);
    c.in = at::full({count}, r + 1, opts);
    c.out = at::empty({count / n}, opts);
    c.run = [&comm, in = c.in, out = c.out] { comm.reduce_scatter(in, out)->wait(); };
    c.verify = [&comm, in = c.in, out = c.out, n] {
      comm.reduce_scatter(in, out)->wait();
      return (out == n * (n + 1) / 2).all().item<bool>();
    };
  } else if (a.op == "allgather") {
    count = std::max<int64_t>(n, count / n * n);
    c.in = at::full({count / n}, r, opts);
    c.out = at::empty({count}, opts);
    c.run = [&comm, in = c.in, out = c.out] { comm.allgather(in, out)->wait(); };
    c.verify = [&comm, in = c.in, out = c.out, n] {
      comm.allgather(in, out)->wait();
      at::Tensor expect = at::arange(n, out.options()).repeat_interleave(out.numel() / n);
      return out.equal(expect);
    };
  } else if (a.op == "broadcast") {
    c.in = at::full({count}, r == 0 ? 7 : 0, opts);
    c.run = [&comm, in = c.in] { comm.broadcast(in)->wait(); };
    c.verify = [&comm, in = c.in, r] {
      in.fill_(r == 0 ? 7 : 0);
      comm.broadcast(in)->wait();
      return (in == 7).all().item<bool>();
    };
  } else if (a.op == "sendrecv") {
    c.in = at::full({count}, r, opts);
    c.out = at::empty({count}, opts);
    // Each edge of the ring (rank e to e + 1) has its own communicator: ops on one
    // communicator run one at a time, so a send above the eager limit would wait for a
    // receive queued behind it on every rank (the pipeline keeps one communicator per
    // direction for the same reason).
    std::vector<std::shared_ptr<tetra::collectives::Communicator>> edges;
    for (int e = 0; n > 1 && e < n; ++e) edges.push_back(comm.split(0, r, "sendrecv edge " + std::to_string(e)));
    c.run = [edges, in = c.in, out = c.out, n, r] {
      if (n == 1) return;
      auto s = edges[r]->send(in, (r + 1) % n);
      edges[(r + n - 1) % n]->recv(out, (r + n - 1) % n)->wait();
      s->wait();
    };
    c.verify = [run = c.run, out = c.out, n, r] {
      run();
      return n == 1 || (out == (r + n - 1) % n).all().item<bool>();
    };
  } else {
    throw tetra::ConfigError("unknown --op \"" + a.op + "\" (allreduce reduce_scatter allgather broadcast sendrecv)");
  }
  return c;
}

double time_loop(const std::function<void()>& fn, int warmup, int iters, const std::function<void()>& sync) {
  for (int i = 0; i < warmup; ++i) fn();
  sync();
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) fn();
  sync();
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kByte: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL;
  }
}

// Shared-memory bound per size: measured add and copy bandwidth, in bytes of the buffer
// per second. The add has the footprint of the allreduce it bounds: in place a += b (two
// buffers), out of place c = a + b (three).
std::pair<double, double> add_copy_bandwidth(int64_t count, at::ScalarType dt, int iters, bool in_place) {
  auto o = at::TensorOptions().dtype(dt);
  at::Tensor a = at::ones({count}, o), b = at::ones({count}, o), c = at::empty({count}, o);
  const double bytes = static_cast<double>(count * c10::elementSize(dt));
  auto add_us = time_loop([&] { in_place ? (void)a.add_(b) : (void)at::add_out(c, a, b); }, 2, iters, [] {});
  auto copy_us = time_loop([&] { c.copy_(a); }, 2, iters, [] {});
  return {bytes / add_us * 1e-3, bytes / copy_us * 1e-3};  // GB/s
}

int run_rank(const Args& a, Communicator& comm, bool print) {
  const at::ScalarType dt = parse_dtype(a.dtype);
  const int64_t lo = parse_bytes(a.min_bytes), hi = parse_bytes(a.max_bytes);
  const int n = comm.size();
  auto sync = [&] { comm.barrier()->wait(); };
  int failures = 0;
  if (print && !a.json) {
    std::printf("# bench-collectives: %s, backend %s, %d ranks, dtype %s, %s, iters %d, warmup %d\n",
                a.op.c_str(), comm.backend().c_str(), n, c10::toString(dt), a.in_place ? "in place" : "out of place",
                a.iters, a.warmup);
    std::printf("%12s %12s %10s %8s %8s %6s%s\n", "size (B)", "count", "time (us)", "algbw", "busbw", "check",
                a.bare ? "   bare us  bare busbw  ratio" : (a.bound ? "  add GB/s copy GB/s  bound  ratio" : ""));
  }
  for (int64_t bytes = std::max<int64_t>(lo, 1); bytes <= hi;
       bytes = std::max<int64_t>(bytes + 1, static_cast<int64_t>(bytes * a.factor))) {
    Case c = make_case(a, comm, bytes, dt);
    const int64_t size_bytes = (a.op == "allgather" ? c.out.numel() : c.in.numel()) * c10::elementSize(dt);
    std::string check = "-";
    if (a.check) {
      bool ok = c.verify();
      check = ok ? "ok" : "FAIL";
      failures += !ok;
    }
    const bool bare = a.bare && a.op == "allreduce" && comm.backend() == "mpi" && mpi_type(dt) != MPI_DATATYPE_NULL;
    auto bare_once = [&] {
      MPI_Allreduce(a.in_place ? MPI_IN_PLACE : c.in.data_ptr(), c.out.data_ptr(), static_cast<int>(c.in.numel()),
                    mpi_type(dt), MPI_SUM, MPI_COMM_WORLD);
    };
    // --rounds alternates tetra and bare timings and keeps each one's best, so both see
    // the same state of a shared, noisy machine.
    double us = 1e300, bare_us = 1e300;
    for (int round = 0; round < a.rounds; ++round) {
      us = std::min(us, time_loop(c.run, a.warmup, a.iters, sync));
      if (bare) bare_us = std::min(bare_us, time_loop(bare_once, a.warmup, a.iters, [] { MPI_Barrier(MPI_COMM_WORLD); }));
    }
    double algbw = size_bytes / us * 1e-3;  // GB/s
    double busbw = algbw * bus_factor(a.op, n);
    nlohmann::json rec = {{"op", a.op}, {"backend", comm.backend()}, {"ranks", n}, {"dtype", c10::toString(dt)},
                          {"in_place", a.in_place}, {"bytes", size_bytes}, {"count", c.in.numel()},
                          {"time_us", us}, {"algbw_gbs", algbw}, {"busbw_gbs", busbw}};
    if (a.check) rec["check"] = check;
    std::string extra;
    if (bare) {
      double bare_bus = size_bytes / bare_us * 1e-3 * bus_factor(a.op, n);
      rec["bare_time_us"] = bare_us;
      rec["bare_busbw_gbs"] = bare_bus;
      rec["ratio"] = busbw / bare_bus;
      char buf[96];
      std::snprintf(buf, sizeof buf, " %9.1f %11.2f %6.3f", bare_us, bare_bus, busbw / bare_bus);
      extra = buf;
    }
    if (a.bound && a.op == "allreduce" && comm.rank() == 0) {
      auto [add, copy] = add_copy_bandwidth(c.in.numel(), dt, std::max(3, a.iters / 2), a.in_place);
      // Each rank reduces half the buffer (add) and copies the other half in.
      double bound = 1.0 / (0.5 / add + 0.5 / copy);
      rec["add_gbs"] = add;
      rec["copy_gbs"] = copy;
      rec["bound_gbs"] = bound;
      rec["ratio"] = busbw / bound;
      char buf[96];
      std::snprintf(buf, sizeof buf, " %9.2f %9.2f %6.2f %6.3f", add, copy, bound, busbw / bound);
      extra = buf;
    }
    if (print) {
      if (a.json) std::printf("%s\n", rec.dump().c_str());
      else
        std::printf("%12lld %12lld %10.1f %8.2f %8.2f %6s%s\n", static_cast<long long>(size_bytes),
                    static_cast<long long>(c.in.numel()), us, algbw, busbw, check.c_str(), extra.c_str());
      std::fflush(stdout);
    }
    sync();
  }
  if (a.fused > 0) {
    const int64_t count = std::max<int64_t>(1, lo / c10::elementSize(dt));
    std::vector<at::Tensor> ts;
    for (int i = 0; i < a.fused; ++i)
      ts.push_back(at::full({count}, comm.rank() + 1, at::TensorOptions().dtype(dt).device(comm.device())));
    tetra::bench::FusedAllreduce fused;
    double sep = time_loop([&] { for (auto& t : ts) comm.allreduce(t)->wait(); }, a.warmup, a.iters, sync);
    double one = time_loop([&] { fused.run(comm, ts); }, a.warmup, a.iters, sync);
    // Issued all at once and waited together: what the bucketer does.
    double async = time_loop([&] {
      std::vector<WorkPtr> ws;
      for (auto& t : ts) ws.push_back(comm.allreduce(t));
      for (auto& w : ws) w->wait();
    }, a.warmup, a.iters, sync);
    if (print) {
      if (a.json)
        std::printf("%s\n", nlohmann::json({{"fused_tensors", a.fused}, {"tensor_bytes", count * c10::elementSize(dt)},
                                            {"separate_us", sep}, {"separate_async_us", async}, {"fused_us", one},
                                            {"speedup", sep / one}}).dump().c_str());
      else
        std::printf("# %d tensors of %lld B: %d separate calls %.1f us (issued together %.1f us), one fused call %.1f us: %.2fx\n",
                    a.fused, static_cast<long long>(count * c10::elementSize(dt)), a.fused, sep, async, one, sep / one);
    }
  }
  return failures;
}

// One rank's fp32 matmul rate on one thread, on the shape of a wide MLP layer's forward,
// with every rank computing at once (ranks that share cores share them here too, as they
// will in training): the mean over the ranks of each one's sustained rate over 30 calls.
double matmul_flops_per_s(Communicator& world) {
  const at::TensorOptions where = at::TensorOptions().device(world.device());
  at::Tensor x = at::randn({256, 1024}, where), w = at::randn({1024, 1024}, where);
  at::Tensor y = at::mm(x, w);
  world.barrier()->wait();
  const int calls = 30;
  const auto t0 = Clock::now();
  for (int i = 0; i < calls; ++i) at::mm_out(y, x, w);
  if (!world.device().is_cpu()) (void)y.sum().item<float>();  // a GPU's products are done
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  at::Tensor rate = at::full({1}, calls * 2.0 * 256 * 1024 * 1024 / s, where.dtype(at::kDouble));
  world.allreduce(rate)->wait();
  return rate.item<double>() / world.size();
}

// Note [Fitted collectives] (tools/planner/cost_model.h): each collective kind timed on the whole
// world at sizes from 8 bytes to 16 MiB, every rank taking part (so ranks that share
// cores share them here as in training), and fitted to the ring step's alpha and beta,
// twice. As in a step, an op follows a burst of compute (the same on every rank, started
// together): the time from a rank's end of it to the op's end includes waiting for the
// ranks that finish their share later, which ranks sharing cores always do. A second op
// follows the first at once: chained, it costs its own time only. Sends go in pairs and
// as a pipeline's stages send them: after compute, the sender computes while its message
// travels. Each size's time is the mean over the ranks of each one's median over the
// repetitions (what a step meets on a shared machine, not its luckiest run).
struct KindFits {
  std::map<std::string, tetra::planner::LinkCost> after_compute, chained;
};

KindFits fit_kinds(Communicator& world) {
  using K = Traffic;
  const int n = world.size();
  // 8 products of 128 x 512 x 512: half a GFLOP, about 10 ms of a core. Everything on the
  // device the world carries tensors on (Note [Two planes]).
  const at::TensorOptions where = at::TensorOptions().device(world.device());
  at::Tensor x = at::randn({128, 512}, where), w = at::randn({512, 512}, where), y = at::empty({128, 512}, where);
  auto burst = [&] {
    for (int i = 0; i < 8; ++i) at::mm_out(y, x, w);
    if (!world.device().is_cpu()) (void)y.sum().item<float>();  // a GPU's products run before the op is timed
  };
  const std::vector<int64_t> sizes = {8, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20};
  KindFits out;
  std::vector<K::Kind> kinds = {K::kAllreduce, K::kReduceScatter, K::kAllgather, K::kBroadcast};
  // Sends in pairs, rank r to r + n/2, every pair at once (a pipeline's stages send while
  // the other pairs do): across hosts, the pairs that leave one host share its link.
  if (n % 2 == 0) kinds.push_back(K::kSend);
  const int partner = (world.rank() + n / 2) % n;
  for (K::Kind kind : kinds) {
    std::vector<double> bytes, after, chained;
    for (int64_t b : sizes) {
      const int64_t elems = std::max<int64_t>(n, b / 4 / n * n);  // whole floats, a multiple of n
      at::Tensor whole = at::ones({elems}, where), part = at::ones({elems / n}, where);
      auto op = [&] {
        switch (kind) {
          case K::kAllreduce: world.allreduce(whole)->wait(); break;
          case K::kReduceScatter: world.reduce_scatter(whole, part)->wait(); break;
          case K::kAllgather: world.allgather(part, whole)->wait(); break;
          default: world.broadcast(whole)->wait(); break;
        }
      };
      const bool sender = world.rank() < n / 2;
      // A send as a pipeline's stage sends: posted, then the sender computes while it
      // travels (what it costs when the sender's progress thread must wait for a core);
      // chained, with both ends idle. Timed on the receiver, from a barrier both leave
      // together; a sender's time counts 0.
      auto send_timed = [&](bool busy) {
        world.barrier()->wait();
        const auto t0 = Clock::now();
        if (sender) {
          WorkPtr w = world.send(whole, partner);
          if (busy) burst();
          w->wait();
          return 0.0;
        }
        world.recv(whole, partner)->wait();
        return std::chrono::duration<double>(Clock::now() - t0).count();
      };
      const int reps = b <= (1 << 20) ? 15 : 5;
      std::vector<double> first, second;
      for (int i = 0; i < reps + 1; ++i) {
        double after_s = 0, chained_s = 0;
        if (kind == K::kSend) {
          after_s = send_timed(true);
          chained_s = send_timed(false);
        } else {
          world.barrier()->wait();
          burst();
          const auto t0 = Clock::now();
          op();
          const auto t1 = Clock::now();
          op();
          after_s = std::chrono::duration<double>(t1 - t0).count();
          chained_s = std::chrono::duration<double>(Clock::now() - t1).count();
        }
        if (i == 0) continue;  // a warm-up
        first.push_back(after_s);
        second.push_back(chained_s);
      }
      at::Tensor t = at::empty({2}, at::kDouble);
      for (auto [i, times] : {std::pair<int, std::vector<double>*>{0, &first}, {1, &second}}) {
        std::nth_element(times->begin(), times->begin() + times->size() / 2, times->end());
        t[i] = (*times)[times->size() / 2];
      }
      t = t.to(world.device());
      world.allreduce(t)->wait();  // the ranks' medians, summed
      t = t.cpu();
      const double timed = kind == K::kSend ? n / 2 : n;  // the ranks that timed it
      bytes.push_back(double(elems * 4));  // the payload as Note [Traffic counters] counts it
      after.push_back(t[0].item<double>() / timed);
      chained.push_back(t[1].item<double>() / timed);
    }
    out.after_compute[K::name(kind)] = tetra::planner::fit_collective(K::name(kind), n, bytes, after);
    out.chained[K::name(kind)] = tetra::planner::fit_collective(K::name(kind), n, bytes, chained);
  }
  return out;
}

// `world` the data plane measured, `host` its host plane (itself on the CPU; Note [Two planes]).
int calibrate(Communicator& world, Communicator& host_plane, const std::string& path) {
  const HostMap hosts = gather_hosts(host_plane);
  const int n = world.size();
  int intra_b = -1, inter_b = -1;
  for (int r = 1; r < n; ++r) {
    if (intra_b < 0 && hosts.host_of[static_cast<size_t>(r)] == hosts.host_of[0]) intra_b = r;
    if (inter_b < 0 && hosts.host_of[static_cast<size_t>(r)] != hosts.host_of[0]) inter_b = r;
  }
  tetra::planner::Calibration c;
  std::string notes;
  if (intra_b > 0) c.intra_host = tetra::planner::measure_link(world, 0, intra_b);
  else notes += "; no two ranks share a host: inside a host keeps the default";
  if (inter_b > 0) c.inter_host = tetra::planner::measure_link(world, 0, inter_b);
  else notes += "; every rank is on one host: across hosts keeps the default";
  // The collectives by kind on every rank: a group inside one host, or one that crosses.
  int intra_group = n;  // the group the intra-host kinds were fitted on
  auto keep = [&c](KindFits fits, bool across) {
    (across ? c.inter_kinds : c.intra_kinds) = std::move(fits.after_compute);
    (across ? c.inter_chained : c.intra_chained) = std::move(fits.chained);
  };
  if (n > 1) keep(fit_kinds(world), hosts.hosts.size() > 1);
  // The sends' pairs that leave one host at once shared its link: the link across is the
  // host's (Note [Cost model]), so their beta is that many times one pair's.
  if (hosts.hosts.size() > 1 && n % 2 == 0) {
    std::vector<int> leaving(hosts.hosts.size());
    for (int r = 0; r < n / 2; ++r)
      if (hosts.host_of[static_cast<size_t>(r)] != hosts.host_of[static_cast<size_t>(r + n / 2)])
        ++leaving[static_cast<size_t>(hosts.host_of[static_cast<size_t>(r)])];
    const int most = std::max(1, *std::max_element(leaving.begin(), leaving.end()));
    for (auto* fits : {&c.inter_kinds, &c.inter_chained})
      if (auto it = fits->find("send"); it != fits->end()) it->second.bytes_per_s *= most;
  }
  // Across hosts, the groups inside them too: each host's ranks as one group, every host
  // at once, as a data axis inside hosts runs beside the others (rank 0's host's fit).
  if (hosts.hosts.size() > 1 && hosts.ranks_on(hosts.host_of[0]) > 1) {
    const int mine = hosts.host_of[static_cast<size_t>(world.rank())];
    const auto host = world.split(mine, world.rank(), "calibration host " + std::to_string(mine));
    if (host->size() > 1) keep(fit_kinds(*host), false);
    intra_group = host->size();
    world.barrier()->wait();
  }
  c.flops_per_s = matmul_flops_per_s(world);
  // Hosts of one machine (test hosts, containers) share its cores (Note [Ranks sharing cores]).
  const int sharing = hosts.hosts_sharing_machine(0);
  c.cores_per_host = double(tetra::hardware::usable_cores()) / sharing;
  if (sharing > 1)
    notes += "; " + std::to_string(sharing) + " hosts share one machine (one boot id) and its " +
             std::to_string(tetra::hardware::usable_cores()) + " cores";
  if (world.rank() != 0) return 0;
  const std::string measured = "bench-collectives --calibrate, " + std::to_string(n) + " ranks on " +
                               std::to_string(hosts.hosts.size()) + " host" + (hosts.hosts.size() == 1 ? "" : "s") +
                               " (" + hosts.describe() + "), backend " + world.backend() + notes;
  std::ofstream out(path);
  out << tetra::planner::calibration_json(c, measured).dump(2) << "\n";
  if (!out) throw std::runtime_error("cannot write " + path);
  std::printf("inside a host  alpha %8.1f us  beta %8.3f GB/s%s\n", c.intra_host.alpha_s * 1e6, c.intra_host.bytes_per_s / 1e9,
              intra_b > 0 ? ("  (ranks 0 and " + std::to_string(intra_b) + ")").c_str() : "  (default: no pair)");
  std::printf("across hosts   alpha %8.1f us  beta %8.3f GB/s%s\n", c.inter_host.alpha_s * 1e6, c.inter_host.bytes_per_s / 1e9,
              inter_b > 0 ? ("  (ranks 0 and " + std::to_string(inter_b) + ")").c_str() : "  (default: no pair)");
  for (bool across : {false, true})
    for (const auto& [kind, l] : across ? c.inter_kinds : c.intra_kinds) {
      const auto& chained = (across ? c.inter_chained : c.intra_chained).at(kind);
      std::printf("%-14s alpha %8.1f us  beta %8.3f GB/s  chained: alpha %8.1f us  beta %8.3f GB/s  (fitted on %s)\n",
                  kind.c_str(), l.alpha_s * 1e6, l.bytes_per_s / 1e9, chained.alpha_s * 1e6, chained.bytes_per_s / 1e9,
                  across              ? ("all " + std::to_string(n) + " ranks, across hosts").c_str()
                  : intra_group == n ? ("all " + std::to_string(n) + " ranks, inside a host").c_str()
                                     : ("each host's " + std::to_string(intra_group) + " ranks, every host at once").c_str());
    }
  std::printf("compute        %8.1f GFLOP/s per rank (fp32 matmul, 1 thread, every rank at once)\n", c.flops_per_s / 1e9);
  std::printf("cores          %8g per host%s\nwrote %s\n", c.cores_per_host,
              sharing > 1 ? (" (" + std::to_string(sharing) + " hosts share one machine)").c_str() : "", path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  tetra::core::prepare_process(argc, argv);
  CLI::App app{"bench-collectives: collective bandwidth (nccl-tests style)", "bench-collectives"};
  Args a;
  app.add_option("--op", a.op, "allreduce | reduce_scatter | allgather | broadcast | sendrecv");
  app.add_option("--backend", a.backend, "mpi | local | gloo | nccl");
  app.add_option("--dtype", a.dtype, "f32 f64 bf16 f16 i32 i64 u8");
  app.add_option("-b,--min-bytes", a.min_bytes, "smallest size (e.g. 1M)");
  app.add_option("-e,--max-bytes", a.max_bytes, "largest size (e.g. 64M)");
  app.add_option("-f,--factor", a.factor, "size multiplier")->check(CLI::Range(1.01, 1e6));
  app.add_option("-n,--iters", a.iters, "timed iterations")->check(CLI::PositiveNumber);
  app.add_option("-w,--warmup", a.warmup, "untimed iterations first")->check(CLI::NonNegativeNumber);
  app.add_option("--rounds", a.rounds, "repeat each timing, alternating with --bare, keep the best")
      ->check(CLI::PositiveNumber);
  app.add_option("--ranks", a.ranks, "thread-ranks for --backend local")->check(CLI::Range(1, 64));
  app.add_option("--fused", a.fused, "also time this many --min-bytes tensors: separate vs fused");
  app.add_flag("--in-place", a.in_place, "allreduce in place");
  app.add_flag("-c,--check", a.check, "check every result");
  app.add_flag("--json", a.json, "one JSON object per size");
  app.add_flag("--bare", a.bare, "mpi allreduce: also time bare MPI_Allreduce");
  app.add_flag("--bound", a.bound, "local allreduce: also measure the shared-memory bound");
  app.add_option("--calibrate", a.calibrate, "measure alpha, beta (inside and across hosts) and compute; write this "
                                             "calibration file for train --dry-run --calibration");
  CLI11_PARSE(app, argc, argv);
  try {
    tetra::core::set_threads(1);
    int failures = 0;
    if (a.backend == "local") {
      if (!a.calibrate.empty())
        throw tetra::ConfigError("--calibrate measures the links between processes: run it under mpirun (across "
                                 "hosts: tools/test-hosts.sh run -np 4 bench-collectives --calibrate FILE)");
      std::vector<int> fails(a.ranks, 0);
      run_local_ranks(a.ranks, [&](int rank, Communicator& comm) { fails[rank] = run_rank(a, comm, rank == 0); });
      for (int f : fails) failures += f;
    } else {
      BackendRegistry registry;
      register_builtin_backends(registry);
      LaunchInfo launch = detect_launch();
      // The backend measured carries the buffers; what the ranks tell each other (their
      // hosts, failures) goes over its host plane (Note [Two planes]: mpi or gloo beside nccl).
      const Planes planes = registry.create_planes(a.backend, launch);
      const CommunicatorPtr& world = planes.data;
      if (!a.calibrate.empty()) return calibrate(*world, *planes.host, a.calibrate);
      failures = run_rank(a, *world, world->rank() == 0);
      at::Tensor f = at::full({1}, failures, at::kInt);
      planes.host->allreduce(f)->wait();
      failures = f.item<int>();
    }
    if (failures) {
      std::fprintf(stderr, "bench-collectives: %d wrong results\n", failures);
      return 1;
    }
    return 0;
  } catch (const tetra::ConfigError& e) {
    std::fprintf(stderr, "bench-collectives: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-collectives: error: %s\n", e.what());
    return 1;
  }
}
