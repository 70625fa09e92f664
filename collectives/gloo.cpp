#include "collectives/gloo.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "collectives/error.h"
#include "collectives/health.h"
#include "core/torch_compat.h"
#include "hardware/env.h"

namespace tetra::collectives {

namespace {

c10d::ReduceOp c10d_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return c10d::ReduceOp::SUM;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kProd: return c10d::ReduceOp::PRODUCT;
  }
  return c10d::ReduceOp::SUM;
}

Duration left(Deadline d) {
  auto ms = std::chrono::duration_cast<Duration>(d - Clock::now());
  return ms.count() < 1 ? Duration(1) : ms;
}

// c10d's waits throw c10::Error (timeouts included): make them tetra's.
template <typename W>
void wait_for(W&& work, Deadline d, const char* what) {
  try {
    work->wait(left(d));
  } catch (const std::exception& e) {
    std::string m = e.what();
    if (m.find("imed out") != std::string::npos || m.find("Timeout") != std::string::npos ||
        Clock::now() >= d)
      throw TimeoutError(std::string("gloo ") + what + ": " + m.substr(0, m.find('\n')));
    throw CommError(std::string("gloo ") + what + ": " + m.substr(0, m.find('\n')));
  }
}

template <typename Fn>
void wait_for_fn(Fn&& wait, Deadline d, const char* what) {
  struct Waiter {
    Fn& fn;
    void wait(Duration left) { fn(left); }
  } w{wait};
  wait_for(&w, d, what);
}

// Gloo reduces only some dtypes; others go through f32 (exact for what fits in 24 bits).
bool gloo_reduces(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kInt || t == at::kLong ||
         t == at::kByte;
}

// Gloo moves only some dtypes; bf16 travels as the f16 of the same bytes (moving data
// never looks at the values).
at::Tensor movable(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t; }

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(int rank, int size, std::string name, c10::intrusive_ptr<c10d::Store> store,
                   Duration timeout)
      : Communicator(rank, size, std::move(name)), store_(std::move(store)), timeout_(timeout) {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    // GLOO_SOCKET_IFNAME=eth0[,eth1] picks the interfaces, as torch.distributed does;
    // else the address this host's name resolves to (loopback when it resolves to none).
    const std::string ifnames = env::text(env::kGlooSocketIfname);
    std::stringstream names(ifnames);
    for (std::string ifname; std::getline(names, ifname, ',');) {
      if (ifname.empty()) continue;
      try {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } catch (const std::exception& e) {
        std::string m = e.what();
        throw ConfigError("GLOO_SOCKET_IFNAME=" + ifnames + ": no usable interface '" + ifname +
                          "' on this host (" + m.substr(0, m.find('\n')) + ")");
      }
    }
    if (opts->devices.empty()) opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    opts->threads = 1;
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank, size, opts);
  }
  void name_group(const std::string& identity) { set_identity(identity, true); }
  ~GlooCommunicator() override {
    stop_progress_thread();
    try {
      reap(true, Clock::now() + std::min<Duration>(timeout_, std::chrono::seconds(10)));
    } catch (...) {
      // A send nobody received: nothing to report to at shutdown.
    }
  }
  std::string backend() const override { return "gloo"; }

 protected:
  // Gloo divides by the element count in places: empty tensors never reach it (every rank
  // skips them alike, since the sizes agree).
  void backend_allreduce(const at::Tensor& in, const at::Tensor& out, ReduceOp op, Deadline d) override {
    if (in.numel() == 0) return;
    at::Tensor t = out;
    if (!in.is_same(out)) out.copy_(in);
    const bool cast = !gloo_reduces(t.scalar_type());
    std::vector<at::Tensor> ts = {cast ? t.to(at::kFloat) : t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d_op(op);
    o.timeout = left(d);
    wait_for(pg_->allreduce(ts, o), d, "allreduce");
    if (cast) t.copy_(ts[0]);
    finish_average(t, op, size());
  }
  void backend_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op, Deadline d) override {
    if (in.numel() == 0) return;
    at::Tensor all = in.clone();
    backend_allreduce(all, all, op, d);
    out.copy_(all.view({-1}).narrow(0, rank() * out.numel(), out.numel()).view(out.sizes()));
  }
  void backend_allgather(const at::Tensor& in, const at::Tensor& out, Deadline d) override {
    if (in.numel() == 0) return;
    std::vector<at::Tensor> inputs = {movable(in)};
    std::vector<std::vector<at::Tensor>> outputs(1);
    at::Tensor flat = movable(out).view({-1});
    for (int r = 0; r < size(); ++r) outputs[0].push_back(flat.narrow(0, r * in.numel(), in.numel()).view(in.sizes()));
    c10d::AllgatherOptions o;
    o.timeout = left(d);
    wait_for(pg_->allgather(outputs, inputs, o), d, "allgather");
  }
  void backend_broadcast(const at::Tensor& t, int root, Deadline d) override {
    if (t.numel() == 0) return;
    std::vector<at::Tensor> ts = {movable(t)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = left(d);
    wait_for(pg_->broadcast(ts, o), d, "broadcast");
  }
  // Gloo's send completes only when the peer has posted the matching recv; ops on one
  // communicator run one at a time, so a ring of sends would deadlock. Sends are
  // therefore buffered, as the local backend's: the data is copied, the send posted, and
  // its completion collected later (before the next op, at the latest at shutdown).
  void backend_send(const at::Tensor& t, int dst, int tag, Deadline d) override {
    if (t.numel() == 0) return;
    reap(false, d);
    std::vector<at::Tensor> ts = {movable(t).clone()};
    auto work = pg_->send(ts, dst, tag);
    pending_.push_back({std::move(ts), [work](Duration left) { return work->wait(left); },
                        [work] { return work->isCompleted(); }, d});
  }
  void backend_recv(const at::Tensor& t, int src, int tag, Deadline d) override {
    if (t.numel() == 0) return;
    std::vector<at::Tensor> ts = {movable(t)};
    wait_for(pg_->recv(ts, src, tag), d, "recv");
  }
  void backend_barrier(Deadline d) override {
    c10d::BarrierOptions o;
    o.timeout = left(d);
    wait_for(pg_->barrier(o), d, "barrier");
  }
  std::shared_ptr<Communicator> backend_split(int color, int key, const std::string& name, Deadline d) override {
    // Everyone learns everyone's (color, key); each new group rendezvouses under its own
    // prefix of the parent's store.
    at::Tensor mine = at::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)}, at::kLong);
    at::Tensor all = at::empty({2 * size()}, at::kLong);
    backend_allgather(mine, all, d);
    const int64_t split_id = splits_++;
    if (color < 0) return nullptr;
    std::vector<std::pair<int64_t, int>> members;  // (key, old rank)
    auto a = all.accessor<int64_t, 1>();
    for (int r = 0; r < size(); ++r)
      if (a[2 * r] == color) members.push_back({a[2 * r + 1], r});
    std::sort(members.begin(), members.end());
    int new_rank = 0;
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i].second == rank()) new_rank = static_cast<int>(i);
    auto prefix = c10::make_intrusive<c10d::PrefixStore>(
        "split" + std::to_string(split_id) + "/" + std::to_string(color), store_);
    return std::make_shared<GlooCommunicator>(new_rank, static_cast<int>(members.size()), name, prefix, timeout_);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  Duration timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  int64_t splits_ = 0;

  struct PendingSend {
    std::vector<at::Tensor> data;  // kept alive until gloo has sent it
    std::function<bool(Duration)> wait;
    std::function<bool()> completed;
    Deadline deadline;
  };
  std::vector<PendingSend> pending_;

  // Collects finished sends (all of them when `all`), surfacing their errors.
  void reap(bool all, Deadline d) {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (all || it->completed()) {
        auto& p = *it;
        wait_for_fn(p.wait, std::min(d, p.deadline), "send");
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }
};

// Every rank signs in under its own key, then waits for all the others. A rank that never
// comes (not started, killed while starting, another WORLD_SIZE or MASTER_PORT) is named
// when the wait ends, instead of c10d's "2/3 clients joined" or a hang in gloo's own
// connect, which waits for each peer's address with no name. Two processes given the same
// rank (torchrun on two nodes without --node_rank) are named at once: each rank counts
// itself in, and the second of a number sees 2. Whoever decides posts the verdict; rank 0
// serves the store, so when it decides (or reads a verdict) it gives the others a moment
// to read it before it leaves (its leaving closes the store).
void await_everyone(c10d::Store& store, int rank, int size, const std::string& where, Duration timeout) {
  const std::string prefix = "tetra/joined/", counted = "tetra/count/", failed = "tetra/rendezvous_failed",
                    seen = "tetra/failures_seen", twice = "twice: ";
  auto bytes = [](const std::string& t) { return std::vector<uint8_t>(t.begin(), t.end()); };
  auto text = [](const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); };
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(prefix + std::to_string(r));
  // The verdict `why` is out: wait (rank 0) until those who came have read it, and leave.
  // Readers are counted, not named by rank: two processes may hold one rank.
  auto leave = [&](const std::string& why) {
    if (rank == 0) {
      int64_t readers = 0;  // every process that counted itself in, but this one
      for (int r = 1; r < size; ++r) readers += store.add(counted + std::to_string(r), 0);
      for (const Deadline linger = Clock::now() + std::chrono::seconds(5);
           store.add(seen, 0) < readers && Clock::now() < linger;)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } else {
      store.add(seen, 1);
    }
    if (why.rfind(twice, 0) == 0) throw ConfigError(where + ": " + why.substr(twice.size()));
    throw PeerLostError(where + ": " + why);
  };
  try {
    const std::string me = process_description();
    if (store.add(counted + std::to_string(rank), 1) > 1) {
      std::string first = "another process";
      for (const Deadline d = Clock::now() + std::chrono::seconds(2); Clock::now() < d;) {
        if (store.check({keys[static_cast<size_t>(rank)]})) {
          first = text(store.get(keys[static_cast<size_t>(rank)]));
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      const std::string why = twice + "rank " + std::to_string(rank) + " was given to two processes: " + first +
                              " and " + me +
                              ". Every process needs a rank of its own (torchrun on several nodes: --node_rank; "
                              "the variables RANK, WORLD_SIZE of each process)";
      store.set(failed, bytes(why));
      leave(why);
    }
    store.set(keys[static_cast<size_t>(rank)], bytes(me));
    // The others defer to rank 0's verdict, so they wait a little longer than it does.
    const Deadline end = Clock::now() + timeout + (rank == 0 ? Duration(0) : std::chrono::seconds(10));
    for (auto nap = std::chrono::milliseconds(1);; nap = std::min(nap * 2, std::chrono::milliseconds(100))) {
      if (store.check({failed})) leave(text(store.get(failed)));
      if (store.check(keys)) return;
      if (Clock::now() >= end) break;
      std::this_thread::sleep_for(nap);
    }
    std::vector<int> missing;
    for (int r = 0; r < size; ++r)
      if (!store.check({keys[static_cast<size_t>(r)]})) missing.push_back(r);
    if (missing.empty()) return;  // the last one came as the time ran out
    std::string names;
    for (size_t i = 0; i < missing.size() && i < 16; ++i) names += (i ? ", " : "") + std::to_string(missing[i]);
    if (missing.size() > 16) names += ", ... (" + std::to_string(missing.size()) + " in all)";
    const std::string why =
        std::string("rank") + (missing.size() > 1 ? "s " : " ") + names + " of " + std::to_string(size) +
        " never joined within " + std::to_string(timeout.count() / 1000) + " s (" +
        std::to_string(size - static_cast<int>(missing.size())) +
        " did). Was every rank started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE? "
        "A rank that died while starting says why in its own output";
    if (rank == 0) store.set(failed, bytes(why));
    leave(why);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    // The store is rank 0's: a broken connection means rank 0 went away.
    const std::string m = e.what();
    throw PeerLostError(where + ": rank 0, which serves the rendezvous, went away (" + m.substr(0, m.find('\n')) +
                        "); its own output says why");
  }
}

}  // namespace

CommunicatorPtr gloo_world(int rank, int size, const std::string& addr, int port, const WorldOptions& options,
                           bool agent_store, int restart, const std::string& source) {
  const std::string where = "gloo: rendezvous at " + addr + ":" + std::to_string(port) +
                            (agent_store ? " (torchrun's agent's store)" : "") +
                            (source.empty() ? "" : " (" + source + ")") + " as rank " + std::to_string(rank) +
                            " of " + std::to_string(size);
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(port);
  so.isServer = rank == 0 && !agent_store;
  so.numWorkers = static_cast<std::size_t>(size);
  so.waitWorkers = false;  // await_everyone waits, and names who is missing
  so.timeout = options.timeout;
  tetra::core::compat::use_classic_tcp_store(so);  // 2.6 asks for libuv, which Debian builds without
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(addr, so);
    if (agent_store)
      store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(restart), store);
  } catch (const std::exception& e) {
    std::string m = e.what();
    throw CommError(where + ": " + m.substr(0, m.find('\n')) +
                    (agent_store ? " (torchrun's agent serves the rendezvous: is it still running?)"
                     : rank == 0 ? " (rank 0 serves the rendezvous there: is the port another job's? MASTER_PORT "
                                   "chooses another)"
                                 : " (rank 0 serves the rendezvous: did it start, at that address and port?)"));
  }
  await_everyone(*store, rank, size, where, options.timeout);
  try {
    auto world = std::make_shared<GlooCommunicator>(rank, size, "gloo world", store, options.timeout);
    world->name_group("gloo:" + addr + ":" + std::to_string(port));
    return with_health(world);  // Note [Health wrapper]
  } catch (const std::exception& e) {
    std::string m = e.what();
    throw CommError(where + ": " + m.substr(0, m.find('\n')));
  }
}

void register_gloo_backend(BackendRegistry& registry) {
  BackendEntry e;
  e.name = "gloo";
  e.description = "c10d ProcessGroupGloo (LibTorch)";
  e.unavailable = [] { return std::string(); };
  e.create = [](const LaunchInfo& l, const WorldOptions& options, const CommunicatorPtr&) -> CommunicatorPtr {
    if (l.world_size == 0)
      throw ConfigError("the gloo backend needs the world size (set WORLD_SIZE, or launch with torchrun or mpirun)");
    std::string addr = l.master_addr;
    int port = l.master_port;
    if (addr.empty()) {
      // All ranks on this host (mpirun -np N on one machine): rendezvous on loopback.
      if (l.local_world_size != l.world_size)
        throw ConfigError("the gloo backend needs MASTER_ADDR and MASTER_PORT when ranks span hosts (" +
                          l.launcher + ": " + l.evidence + ")");
      addr = "127.0.0.1";
    }
    if (port == 0) port = 29500;
    return gloo_world(l.rank, l.world_size, addr, port, options, l.agent_store, l.restart, l.master_source);
  };
  registry.add(std::move(e));
}

}  // namespace tetra::collectives
