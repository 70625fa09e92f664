// The mpi backend (Note [mpi backend design] in mpi.h).
#include "collectives/mpi.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
// The C API only (no deprecated C++ bindings, which would need libmpi_cxx).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#include <sched.h>

#include <atomic>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/error.h"
#include "collectives/health.h"
#include "hardware/env.h"

namespace tetra::collectives {

namespace {

// ---- errors -------------------------------------------------------------------------

const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(text, static_cast<size_t>(len));
}

[[noreturn]] void throw_mpi(int code, const char* call, const char* file, int line) {
  std::ostringstream os;
  os << call << " failed: " << mpi_error_string(code) << " [" << base_name(file) << ":" << line << "]";
  throw CommError(os.str());
}

inline void check_mpi(int code, const char* call, const char* file, int line) {
  if (code != MPI_SUCCESS) throw_mpi(code, call, file, line);
}

// TETRA_MPI(MPI_Ibarrier, comm, &req): calls it and turns a failure into a CommError
// naming the call, MPI's error string and this file's line.
#define TETRA_MPI(fn, ...) check_mpi(fn(__VA_ARGS__), #fn, __FILE__, __LINE__)

// ---- waiting for a request ------------------------------------------------------------

// How a wait tests its request (Note [Awaited and background polls] in mpi.h), in
// microseconds. TETRA_MPI_POLL=spin,yield,sleep,background_spin overrides it, to measure;
// a negative background_spin polls every op as if awaited (the policy before).
struct PollPolicy {
  int64_t spin_us = 100, yield_us = 5000, sleep_us = 50, background_spin_us = 20;
};

const PollPolicy& poll_policy() {
  static const PollPolicy policy = [] {
    PollPolicy p;
    if (const std::optional<std::string> given = env::get(env::kMpiPoll)) {
      long long a = 0, b = 0, c = 0, d = 0;
      if (std::sscanf(given->c_str(), "%lld,%lld,%lld,%lld", &a, &b, &c, &d) == 4 && a >= 0 && b >= a && c > 0) {
        p = {a, b, c, d};
      } else {
        std::fprintf(stderr,
                     "tetra: TETRA_MPI_POLL=%s is not spin,yield,sleep,background_spin microseconds "
                     "(0 <= spin <= yield, sleep > 0); keeping %lld,%lld,%lld,%lld\n",
                     given->c_str(), static_cast<long long>(p.spin_us), static_cast<long long>(p.yield_us),
                     static_cast<long long>(p.sleep_us), static_cast<long long>(p.background_spin_us));
      }
    }
    return p;
  }();
  return policy;
}

// Tests `req` until it completes (true) or the deadline passes (false, still pending).
// While a caller waits on `comm` (or with no communicator): spins for small messages,
// yields while a large op runs, sleeps while a peer is late. While nobody waits (the
// caller computes): a short spin, then sleeps. A request that completes with an error
// throws, naming `call`.
bool poll_until(MPI_Request& req, Deadline deadline, const char* call, int line, MPI_Status* status,
                const Communicator* comm) {
  using namespace std::chrono;
  const PollPolicy& policy = poll_policy();
  const auto spin = microseconds(policy.spin_us), yield = microseconds(policy.yield_us),
             nap = microseconds(policy.sleep_us), background_spin = microseconds(policy.background_spin_us);
  const bool always_awaited = comm == nullptr || policy.background_spin_us < 0;
  auto start = Clock::now();
  bool was_awaited = always_awaited || comm->awaited();
  MPI_Status ignored;
  if (!status) status = &ignored;
  for (;;) {
    int done = 0;
    int rc = MPI_Test(&req, &done, status);
    if (rc != MPI_SUCCESS) {
      std::string what = std::string(call) + " (completed by MPI_Test)";
      throw_mpi(rc == MPI_ERR_IN_STATUS ? status->MPI_ERROR : rc, what.c_str(), __FILE__, line);
    }
    if (done) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    const bool awaited = always_awaited || comm->awaited();
    if (awaited && !was_awaited) start = now;  // a caller has just begun to wait: spin for it
    was_awaited = awaited;
    const auto waited = now - start;
    if (waited < (awaited ? spin : background_spin)) {
      continue;
    } else if (awaited && waited < yield) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(nap);
    }
  }
}

// ---- process-level runtime ------------------------------------------------------------

// A request given up on at its deadline, with the buffers MPI may still write.
struct Pending {
  MPI_Request request;
  std::vector<at::Tensor> keep;
  std::string what;
};

// The one place that initialises and finalises MPI. Never destroyed (it is used from
// the atexit handler and from communicators that outlive static destruction).
struct Runtime {
  std::mutex init_mu;  // init and mpi_world
  CommunicatorPtr world;
  bool initialized = false;
  bool owns_mpi = false;  // we called MPI_Init_thread, so we finalise
  bool exited = false;    // the atexit handler ran
  std::atomic<bool> failing{false};  // mpi_exit_without_finalize

  std::mutex mu;  // live communicators, orphans
  std::set<class MpiCommunicator*> live;
  // Abandoned (timed-out) requests of communicators that are gone, with the buffers
  // MPI may still write; checked at exit.
  std::vector<Pending> orphans;

  MPI_Datatype two_byte = MPI_DATATYPE_NULL;  // bf16 and f16
  MPI_Op half_ops[2][4] = {};                 // [bf16, f16][sum, prod, min, max]

  void init_locked();
};

Runtime& runtime() {
  static Runtime* rt = new Runtime;  // intentionally leaked
  return *rt;
}

void at_exit();

// bf16 / f16 reductions through float, rounded back with c10's conversion (nearest even).
template <typename T, int Kind>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) {
    const float x = static_cast<float>(a[i]);
    const float y = static_cast<float>(b[i]);
    float r;
    if constexpr (Kind == 0) r = x + y;
    else if constexpr (Kind == 1) r = x * y;
    else if constexpr (Kind == 2) r = (std::isnan(x) || x < y) ? x : y;
    else r = (std::isnan(x) || x > y) ? x : y;
    b[i] = T(r);
  }
}

template <typename T>
void create_half_ops(MPI_Op (&ops)[4]) {
  TETRA_MPI(MPI_Op_create, &half_reduce<T, 0>, 1, &ops[0]);
  TETRA_MPI(MPI_Op_create, &half_reduce<T, 1>, 1, &ops[1]);
  TETRA_MPI(MPI_Op_create, &half_reduce<T, 2>, 1, &ops[2]);
  TETRA_MPI(MPI_Op_create, &half_reduce<T, 3>, 1, &ops[3]);
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown thread level";
}

void Runtime::init_locked() {
  if (initialized) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) throw CommError("mpi: MPI was already finalised in this process; it cannot start again");
  int already = 0;
  MPI_Initialized(&already);
  int provided = MPI_THREAD_SINGLE;
  if (!already) {
    // libnbc's default iallreduce on < 4 ranks (and in place) is a binomial
    // reduce + bcast at about half the tuned blocking speed; its ring matches it.
    env::set(env::kOmpiIallreduceAlgorithm, "1", /*overwrite=*/false);
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) throw_mpi(rc, "MPI_Init_thread", __FILE__, __LINE__);
    owns_mpi = true;
    std::atexit(at_exit);
  } else {
    TETRA_MPI(MPI_Query_thread, &provided);
  }
  if (provided < MPI_THREAD_MULTIPLE)
    throw CommError(std::string("mpi: this MPI (") + mpi_library_version() + ") provides only " +
                    thread_level_name(provided) +
                    "; tetra's mpi backend needs MPI_THREAD_MULTIPLE (each communicator's "
                    "progress thread calls MPI)" +
                    (already ? " — MPI was initialised before tetra, call MPI_Init_thread with "
                               "MPI_THREAD_MULTIPLE"
                             : ""));
  TETRA_MPI(MPI_Type_contiguous, 2, MPI_BYTE, &two_byte);
  TETRA_MPI(MPI_Type_commit, &two_byte);
  create_half_ops<c10::BFloat16>(half_ops[0]);
  create_half_ops<c10::Half>(half_ops[1]);
  initialized = true;
}

// ---- types and ops --------------------------------------------------------------------

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBFloat16:
    case at::kHalf: return runtime().two_byte;
    default: throw CommError(std::string("mpi: dtype ") + c10::toString(t) + " has no MPI type");
  }
}

int op_index(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return 0;
    case ReduceOp::kProd: return 1;
    case ReduceOp::kMin: return 2;
    case ReduceOp::kMax: return 3;
  }
  return 0;
}

MPI_Op mpi_op(at::ScalarType t, ReduceOp op) {
  if (t == at::kBFloat16) return runtime().half_ops[0][op_index(op)];
  if (t == at::kHalf) return runtime().half_ops[1][op_index(op)];
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return MPI_SUM;
    case ReduceOp::kProd: return MPI_PROD;
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
  }
  return MPI_SUM;
}

int mpi_count(int64_t numel) {
  if (numel > INT_MAX)
    throw CommError("mpi: " + std::to_string(numel) + " elements is more than MPI's int count (" +
                    std::to_string(INT_MAX) + ") in one call; split the tensor");
  return static_cast<int>(numel);
}

int comm_rank(MPI_Comm c) {
  int r = 0;
  TETRA_MPI(MPI_Comm_rank, c, &r);
  return r;
}
int comm_size(MPI_Comm c) {
  int n = 0;
  TETRA_MPI(MPI_Comm_size, c, &n);
  return n;
}

std::string ms_string(Duration d) { return std::to_string(d.count()) + " ms"; }

// ---- the communicator ------------------------------------------------------------------

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (sets MPI_ERRORS_RETURN on it).
  static std::shared_ptr<MpiCommunicator> make(MPI_Comm comm, std::string name, Duration timeout) {
    TETRA_MPI(MPI_Comm_set_errhandler, comm, MPI_ERRORS_RETURN);
    auto c = std::shared_ptr<MpiCommunicator>(
        new MpiCommunicator(comm, comm_rank(comm), comm_size(comm), std::move(name), timeout));
    Runtime& rt = runtime();
    std::lock_guard<std::mutex> lock(rt.mu);
    rt.live.insert(c.get());
    return c;
  }

  void name_group(const std::string& identity) { set_identity(identity, true); }
  ~MpiCommunicator() override {
    shutdown();
    Runtime& rt = runtime();
    std::lock_guard<std::mutex> lock(rt.mu);
    rt.live.erase(this);
  }

  std::string backend() const override { return "mpi"; }
  // Note [Two planes]: Open MPI as Debian builds it reads host memory only.
  std::string refuses(const at::Tensor& t) const override {
    if (t.is_cpu()) return "";
    return "the mpi backend carries host tensors only (this Open MPI is not CUDA-aware); a job's device tensors go "
           "over its data plane (collectives.backend: nccl)";
  }

  // Stops the progress thread and frees the MPI communicator; abandoned requests that
  // are still pending go to the runtime. Idempotent (the destructor, and at exit).
  void shutdown() {
    stop_progress_thread();
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == MPI_COMM_NULL) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {
      comm_ = MPI_COMM_NULL;
      return;
    }
    Runtime& rt = runtime();
    for (auto& a : abandoned_) {
      int done = 0;
      if (MPI_Test(&a.request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done) continue;
      std::lock_guard<std::mutex> rlock(rt.mu);
      rt.orphans.push_back(std::move(a));
    }
    abandoned_.clear();
    if (ring_ != MPI_COMM_NULL) MPI_Comm_free(&ring_);
    MPI_Comm_free(&comm_);  // legal with requests pending: freed once they complete
    comm_ = MPI_COMM_NULL;
  }

  // MPI_COMM_TYPE_SHARED split, run on the caller's thread (see mpi_split_shared).
  CommunicatorPtr split_shared(Duration timeout) {
    Deadline deadline = Clock::now() + timeout;
    std::string label = name() + "/shared";
    try {
      arrive(deadline, "split_shared");
      MPI_Comm out = MPI_COMM_NULL;
      TETRA_MPI(MPI_Comm_split_type, comm_, MPI_COMM_TYPE_SHARED, rank(), MPI_INFO_NULL, &out);
      return make(out, label, default_timeout_);
    } catch (const TimeoutError& e) {
      throw TimeoutError(name() + ": mpi_split_shared: " + e.what());
    } catch (const std::exception& e) {
      throw CommError(name() + ": mpi_split_shared: " + e.what());
    }
  }

 protected:
  void backend_allreduce(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                         Deadline deadline) override {
    const bool in_place = input.data_ptr() == output.data_ptr();
    const int count = mpi_count(output.numel());
    if (size() == 1) {
      if (!in_place) output.copy_(input);
      return;
    }
    MPI_Request req;
    // libnbc's MPI_IN_PLACE allreduce is slow too: 152 ms for 64 MiB on two ranks against
    // 16 ms out of place (bench-collectives --in-place). Out of place into the kept
    // scratch, then back.
    const at::Tensor out = in_place ? scratch(input) : output;
    TETRA_MPI(MPI_Iallreduce, input.data_ptr(), out.data_ptr(), count, mpi_type(output.scalar_type()),
              mpi_op(output.scalar_type(), op), comm_, &req);
    await(req, deadline, "MPI_Iallreduce", __LINE__, {input, out});
    if (in_place) output.view({-1}).copy_(out);
    finish_average(output, op, size());
  }

  void backend_reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                              Deadline deadline) override {
    const int count = mpi_count(output.numel());
    mpi_count(input.numel());
    if (size() == 1) {
      if (input.data_ptr() != output.data_ptr()) output.copy_(input);
      return;
    }
    // Note [Reduce-scatter as a ring]
    // Open MPI 4.1.4's libnbc MPI_Ireduce_scatter_block is slow and partly wrong: on two
    // ranks a 64 MiB f32 reduce-scatter took 319 ms against 22 ms for MPI_Iallreduce of
    // the same 64 MiB (bench-collectives, shared memory), and it saturates u8 sums at 255
    // where the blocking one and MPI_Iallreduce wrap. An allreduce of the whole input
    // reduces every chunk on every rank (n times the arithmetic) and needed a scratch the
    // size of the input. So the reduce-scatter is the bandwidth-optimal ring, by hand: in
    // n - 1 steps each rank sends one chunk's running sum to the next rank, receives the
    // previous rank's running sum of another chunk and adds its own share of it; after the
    // last step it holds its own chunk's sum. (n - 1)/n of the input crosses each link, 1/n
    // of it is added per step, and the scratch is two chunks (none on two ranks). The sum of
    // chunk c is taken in ring order from rank c + 1: a fixed order for a given group, as a
    // tree's would be. Below kRingBytes (the loss, fingerprints) it stays one MPI
    // allreduce: one call, not n - 1 steps.
    if (input.nbytes() < kRingBytes) {
      MPI_Request req;
      at::Tensor full = scratch(input);
      TETRA_MPI(MPI_Iallreduce, input.data_ptr(), full.data_ptr(), mpi_count(input.numel()),
                mpi_type(input.scalar_type()), mpi_op(input.scalar_type(), op), comm_, &req);
      await(req, deadline, "MPI_Iallreduce (for a small reduce_scatter)", __LINE__, {input, full});
      output.view({-1}).copy_(full.narrow(0, static_cast<int64_t>(rank()) * count, count));
      finish_average(output, op, size());
      return;
    }
    const int n = size(), me = rank();
    const at::Tensor in = input.view({-1}), out = output.view({-1});
    auto chunk = [&](int c) { return in.narrow(0, static_cast<int64_t>((c % n + n) % n) * count, count); };
    // The output may lie inside the input (its own chunk): then the last sum lands in the
    // scratch first, and the own share is read before it is overwritten.
    const char* ib = static_cast<const char*>(in.data_ptr());
    const char* ob = static_cast<const char*>(out.data_ptr());
    const bool overlaps = ob < ib + in.nbytes() && ib < ob + out.nbytes();
    // Running sums alternate between two chunks of scratch; two ranks need none.
    const at::Tensor buf = n > 2 || overlaps ? scratch(input, 2 * static_cast<int64_t>(count)) : at::Tensor();
    at::Tensor sending = chunk(me - 1);
    for (int step = 0; step < n - 1; ++step) {
      const bool last = step == n - 2;
      const at::Tensor into = last && !overlaps ? out : buf.narrow(0, (step % 2) * static_cast<int64_t>(count), count);
      ring_step(sending, into, deadline, "a reduce-scatter", {input});
      reduce_into(into, chunk(me - step - 2), op);  // the running sum takes this rank's share
      sending = into;
    }
    if (overlaps) out.copy_(sending);
    finish_average(out, op, n);
  }

  void backend_allgather(const at::Tensor& input, const at::Tensor& output, Deadline deadline) override {
    const int count = mpi_count(input.numel());
    mpi_count(output.numel());
    const MPI_Datatype type = mpi_type(input.scalar_type());
    // The input already being this rank's chunk of the output is MPI's in-place case.
    const bool in_place = count > 0 && static_cast<const char*>(input.data_ptr()) ==
                                           static_cast<const char*>(output.data_ptr()) +
                                               static_cast<size_t>(rank()) * count * input.element_size();
    if (size() == 1) {
      if (!in_place && input.data_ptr() != output.data_ptr()) output.copy_(input);
      return;
    }
    if (output.nbytes() < kRingBytes) {
      MPI_Request req;
      TETRA_MPI(MPI_Iallgather, in_place ? MPI_IN_PLACE : input.data_ptr(), count, type, output.data_ptr(),
                count, type, comm_, &req);
      await(req, deadline, "MPI_Iallgather", __LINE__, {input, output});
      return;
    }
    // Note [Allgather as a ring]
    // libnbc's MPI_Iallgather keeps a temporary the size of the whole output on every rank
    // but the first: ZeRO's gathers of 64 MiB units left rank 1's peak RSS 64 MiB above
    // rank 0's. Large gathers are the ring by hand instead, straight into the output: in
    // step s each rank passes on the chunk it got in step s - 1 (its own first) and
    // receives the next one into its place. (n - 1)/n of the output crosses each link, and
    // nothing is allocated.
    const int n = size(), me = rank();
    const at::Tensor out = output.view({-1});
    auto chunk = [&](int c) { return out.narrow(0, static_cast<int64_t>((c % n + n) % n) * count, count); };
    if (!in_place) chunk(me).copy_(input.view({-1}));
    for (int step = 0; step < n - 1; ++step) ring_step(chunk(me - step), chunk(me - step - 1), deadline, "an allgather", {output});
  }

  void backend_broadcast(const at::Tensor& tensor, int root, Deadline deadline) override {
    const int count = mpi_count(tensor.numel());
    if (size() == 1) return;
    MPI_Request req;
    TETRA_MPI(MPI_Ibcast, tensor.data_ptr(), count, mpi_type(tensor.scalar_type()), root, comm_, &req);
    await(req, deadline, "MPI_Ibcast", __LINE__, {tensor});
  }

  void backend_send(const at::Tensor& tensor, int dst, int tag, Deadline deadline) override {
    check_tag(tag);
    MPI_Request req;
    TETRA_MPI(MPI_Isend, tensor.data_ptr(), mpi_count(tensor.numel()), mpi_type(tensor.scalar_type()), dst,
              tag, comm_, &req);
    await(req, deadline, "MPI_Isend", __LINE__, {tensor}, /*cancellable=*/true);
  }

  void backend_recv(const at::Tensor& tensor, int src, int tag, Deadline deadline) override {
    check_tag(tag);
    const int count = mpi_count(tensor.numel());
    const MPI_Datatype type = mpi_type(tensor.scalar_type());
    MPI_Request req;
    TETRA_MPI(MPI_Irecv, tensor.data_ptr(), count, type, src, tag, comm_, &req);
    MPI_Status status;
    await(req, deadline, "MPI_Irecv", __LINE__, {tensor}, /*cancellable=*/true, &status);
    int got = 0;
    TETRA_MPI(MPI_Get_count, &status, type, &got);
    if (got != count)
      throw CommError("rank " + std::to_string(src) + " sent " + std::to_string(got) +
                      " elements, the receiving tensor holds " + std::to_string(count));
  }

  void backend_barrier(Deadline deadline) override {
    if (size() == 1) return;
    arrive(deadline, "MPI_Ibarrier");
  }

  std::shared_ptr<Communicator> backend_split(int color, int key, const std::string& name,
                                              Deadline deadline) override {
    // MPI_Comm_split blocks: first make sure every rank has come (or time out).
    arrive(deadline, "MPI_Ibarrier (before MPI_Comm_split)");
    MPI_Comm out = MPI_COMM_NULL;
    TETRA_MPI(MPI_Comm_split, comm_, color < 0 ? MPI_UNDEFINED : color, key, &out);
    if (out == MPI_COMM_NULL) return nullptr;
    return make(out, name, default_timeout_);
  }

 private:
  MpiCommunicator(MPI_Comm comm, int rank, int size, std::string name, Duration timeout)
      : Communicator(rank, size, std::move(name)), comm_(comm), default_timeout_(timeout) {}

  void check_tag(int tag) {
    if (tag_ub_ < 0) {
      void* value = nullptr;
      int flag = 0;
      TETRA_MPI(MPI_Comm_get_attr, comm_, MPI_TAG_UB, &value, &flag);
      tag_ub_ = flag ? *static_cast<int*>(value) : 32767;
    }
    if (tag > tag_ub_)
      throw CommError("tag " + std::to_string(tag) + " is above this MPI's largest tag (MPI_TAG_UB = " +
                      std::to_string(tag_ub_) + ")");
  }

  // An MPI_Ibarrier up to the deadline (barrier, and before the blocking splits).
  void arrive(Deadline deadline, const char* call) {
    MPI_Request req;
    TETRA_MPI(MPI_Ibarrier, comm_, &req);
    await(req, deadline, call, __LINE__, {});
  }

  // One step of a ring (Note [Reduce-scatter as a ring], Note [Allgather as a ring]): sends
  // `send` to the next rank and receives `recv` from the previous one, on the ring's own
  // communicator (a dup, made on first use), so that they never meet a send/recv of the
  // program's on the same tag. A timeout on the receive keeps the send, with the tensors,
  // for MPI to finish.
  void ring_step(const at::Tensor& send, const at::Tensor& recv, Deadline deadline, const char* what,
                 std::vector<at::Tensor> keep) {
    if (ring_ == MPI_COMM_NULL) {
      MPI_Request req;
      TETRA_MPI(MPI_Comm_idup, comm_, &ring_, &req);
      await(req, deadline, "MPI_Comm_idup (the rings' communicator)", __LINE__, {});
    }
    const int n = size(), right = (rank() + 1) % n, left = (rank() + n - 1) % n;
    const MPI_Datatype type = mpi_type(send.scalar_type());
    const std::string call = std::string("MPI_Isend/MPI_Irecv (a step of ") + what + "'s ring)";
    keep.push_back(send);
    keep.push_back(recv);
    MPI_Request reqs[2];
    TETRA_MPI(MPI_Irecv, recv.data_ptr(), mpi_count(recv.numel()), type, left, 0, ring_, &reqs[0]);
    TETRA_MPI(MPI_Isend, send.data_ptr(), mpi_count(send.numel()), type, right, 0, ring_, &reqs[1]);
    try {
      await(reqs[0], deadline, call.c_str(), __LINE__, keep, /*cancellable=*/true);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      abandoned_.push_back({reqs[1], std::move(keep), name() + ": " + call});
      throw;
    }
    await(reqs[1], deadline, call.c_str(), __LINE__, std::move(keep), /*cancellable=*/true);
  }

  // Waits for `req` up to the deadline. On the deadline a cancellable (p2p) request is
  // cancelled; one that cannot be is kept, with the tensors MPI may still write, and
  // the op throws TimeoutError.
  void await(MPI_Request& req, Deadline deadline, const char* call, int line, std::vector<at::Tensor> keep,
             bool cancellable = false, MPI_Status* status = nullptr) {
    const auto start = Clock::now();
    if (poll_until(req, deadline, call, line, status, this)) return;
    const auto waited = std::chrono::duration_cast<Duration>(Clock::now() - start);
    bool gone = false;
    if (cancellable && MPI_Cancel(&req) == MPI_SUCCESS) {
      // A cancelled recv completes at once; a send that MPI cannot cancel stays pending.
      try {
        gone = poll_until(req, Clock::now() + std::chrono::milliseconds(100), call, line, nullptr, nullptr);
      } catch (const std::exception&) {
        gone = true;
      }
    }
    if (!gone) {
      std::lock_guard<std::mutex> lock(mu_);
      abandoned_.push_back({req, std::move(keep), name() + ": " + call});
    }
    throw TimeoutError("rank " + std::to_string(rank()) + " of " + std::to_string(size()) + ": " + call +
                       " did not complete within " + ms_string(waited) +
                       " (a peer did not join this op, or is slower than the timeout)");
  }

  std::mutex mu_;  // comm_ and ring_ at shutdown, abandoned_
  MPI_Comm comm_;
  MPI_Comm ring_ = MPI_COMM_NULL;  // the rings' sends (Note [Reduce-scatter as a ring])
  // Reduce-scatters and allgathers of at least this many bytes run as rings by hand.
  static constexpr size_t kRingBytes = 1 << 20;
  // The scratch of in-place allreduces (the whole tensor) and of reduce-scatters (two
  // chunks), kept across ops: a fresh one was faulted in by both ranks on every op. Only
  // the progress thread touches it.
  at::Tensor scratch_;
  // `numel` elements of t's dtype (1-D; default: t's numel) in the kept scratch.
  at::Tensor scratch(const at::Tensor& t, int64_t numel = -1) {
    if (numel < 0) numel = t.numel();
    if (!scratch_.defined() || scratch_.scalar_type() != t.scalar_type() || scratch_.numel() < numel)
      scratch_ = at::empty({numel}, t.options());
    return scratch_.narrow(0, 0, numel);
  }
  Duration default_timeout_;
  int tag_ub_ = -1;
  std::vector<Pending> abandoned_;
};

// At exit: drop the world, shut down the communicators still alive, then finalise —
// unless an abandoned op is still pending (MPI_Finalize's fence could wait forever for
// the peer that never came; mpirun ends the job when this process is gone).
void at_exit() {
  Runtime& rt = runtime();
  CommunicatorPtr world;
  {
    std::lock_guard<std::mutex> lock(rt.init_mu);
    rt.exited = true;
    world = std::move(rt.world);
  }
  world.reset();
  std::vector<MpiCommunicator*> live;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    live.assign(rt.live.begin(), rt.live.end());
  }
  for (MpiCommunicator* c : live) c->shutdown();
  std::vector<std::string> pending;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    for (auto& p : rt.orphans) {
      int done = 0;
      if (MPI_Test(&p.request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done) pending.push_back(p.what);
    }
  }
  if (!rt.owns_mpi || rt.failing) return;
  if (!pending.empty()) {
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::fprintf(stderr,
                 "tetra mpi: rank %d exits with %zu timed-out op(s) still pending (first: %s); not "
                 "calling MPI_Finalize, which would wait for the missing peer; mpirun ends the job\n",
                 rank, pending.size(), pending.front().c_str());
    std::fflush(stderr);
    return;
  }
  if (rt.initialized) {
    for (auto& ops : rt.half_ops)
      for (MPI_Op& op : ops) MPI_Op_free(&op);
    MPI_Type_free(&rt.two_byte);
  }
  MPI_Finalize();
}

}  // namespace

void mpi_exit_without_finalize() { runtime().failing = true; }

namespace {

std::string short_version(const std::string& full) {
  std::string s = full.substr(0, full.find(','));
  auto v = s.find(" v");
  if (v != std::string::npos && v + 2 < s.size() && std::isdigit(static_cast<unsigned char>(s[v + 2])))
    s.erase(v + 1, 1);
  return s;
}

}  // namespace

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return "MPI (unknown version)";
  std::string s(text, static_cast<size_t>(len));
  s = s.substr(0, s.find('\n'));
  while (!s.empty() && (s.back() == ' ' || s.back() == '\0' || s.back() == '\r')) s.pop_back();
  return s;
}

// The same on every rank of this mpirun job, without communicating: the launcher's name
// for the job (PMIx namespace, Open MPI's job id), else the world's shape.
std::string job_identity() {
  for (const env::Knob* v : {&env::kPmixNamespace, &env::kOmpiJobId, &env::kSlurmJobId, &env::kOmpiSize})
    if (const std::optional<std::string> x = env::get(*v)) return std::string("mpi:") + v->name + "=" + *x;
  return "mpi:world";
}

CommunicatorPtr mpi_world(const WorldOptions& options) {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.init_mu);
  if (rt.world) return rt.world;
  if (rt.exited) throw CommError("mpi_world: called after MPI was shut down at exit");
  rt.init_locked();
  // Our own dup of MPI_COMM_WORLD, non-blocking so that set-up has a deadline too.
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req;
  TETRA_MPI(MPI_Comm_idup, MPI_COMM_WORLD, &dup, &req);
  if (!poll_until(req, Clock::now() + options.timeout, "MPI_Comm_idup", __LINE__, nullptr, nullptr)) {
    int rank = 0, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    throw TimeoutError("mpi world: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                       ": the other ranks did not join within " + ms_string(options.timeout));
  }
  auto world = MpiCommunicator::make(dup, "mpi world", options.timeout);
  world->name_group(job_identity());
  rt.world = with_health(world);  // Note [Health wrapper]
  return rt.world;
}

CommunicatorPtr mpi_split_shared(Communicator& comm, Duration timeout) {
  auto* m = dynamic_cast<MpiCommunicator*>(&comm.transport());
  if (!m)
    throw CommError("mpi_split_shared: " + comm.name() + " is a " + comm.backend() +
                    " communicator, not an mpi one");
  comm.synchronize();
  return with_health(m->split_shared(timeout));
}

void register_mpi_backend(BackendRegistry& registry) {
  BackendEntry e;
  e.name = "mpi";
  e.description = short_version(mpi_library_version());
  e.unavailable = [] { return std::string(); };
  e.create = [](const LaunchInfo& launch, const WorldOptions& options, const CommunicatorPtr&) {
    // A task srun started without a PMI plugin: Open MPI's MPI_Init would print a page
    // about building it with PMI support and abort. Say what to do instead.
    if (launch.launcher == "slurm" && !env::is_set(env::kPmixRank) && !env::is_set(env::kPmiRank))
      throw ConfigError(
          "the mpi backend under srun needs the PMIx plugin, which this step was started without (SLURM_MPI_TYPE=" +
          env::get(env::kSlurmMpiType).value_or("unset") +
          "): run `srun --mpi=pmix ...` (or set MpiDefault=pmix in slurm.conf), or use collectives.backend: gloo, "
          "which needs no PMI");
    return mpi_world(options);
  };
  registry.add(std::move(e));
}

}  // namespace tetra::collectives
