#include "collectives/nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <ATen/ATen.h>

#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "collectives/error.h"
#include "collectives/health.h"
#include "collectives/mpi.h"

namespace tetra::collectives {

namespace {

// Every CUDA and NCCL return code is checked where it is returned, with file and line.
#define TETRA_CUDA(call)                                                                 \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess)                                                               \
      throw CommError(std::string(#call) + " failed: " + cudaGetErrorString(e_) + " (" + \
                      __FILE__ + ":" + std::to_string(__LINE__) + ")");                  \
  } while (0)

#define TETRA_NCCL(call)                                                                   \
  do {                                                                                     \
    ncclResult_t r_ = (call);                                                              \
    if (r_ != ncclSuccess && r_ != ncclInProgress)                                         \
      throw CommError(std::string(#call) + " failed: " + ncclGetErrorString(r_) + " (" +   \
                      __FILE__ + ":" + std::to_string(__LINE__) + ")");                    \
  } while (0)

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    default: throw CommError(std::string("nccl: unsupported dtype ") + c10::toString(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kProd: return ncclProd;
  }
  return ncclSum;
}

void require_cuda(const at::Tensor& t, int device) {
  if (!t.is_cuda())
    throw CommError(std::string("the nccl backend needs CUDA tensors, got one on ") + t.device().str());
  if (t.get_device() != device)
    throw CommError("the nccl backend of this rank runs on cuda:" + std::to_string(device) +
                    ", got a tensor on " + t.device().str());
}

// Note [Streams]
// ~~~~~~~~~~~~~~
// Each NCCL communicator runs its ops on a CUDA stream of its own, created non-blocking so
// that it does not wait for, nor hold up, the stream LibTorch's kernels run on: a bucket's
// allreduce or a ZeRO gather overlaps the backward and forward kernels queued after it, as
// DDP's and FSDP's do. Order is kept by events, the way c10d's ProcessGroupNCCL keeps it:
//
//  - before: as an op is issued (on the issuing thread), an event is recorded on the
//    compute stream; the progress thread makes the communicator's stream wait for it
//    before it enqueues the NCCL call. The op reads its tensors only after every kernel
//    the issuer queued before issuing it (the copy into the bucket, the backward that
//    wrote the gradients) has run; kernels queued after it run meanwhile.
//  - after: the progress thread polls the communicator's stream until the op is done
//    (launch()) and only then finishes the op's Work, so a caller that waits on the Work
//    and then queues kernels reads the result, as on the host backends.
//
// The compute stream is the legacy default stream: tetra sets no other stream, and
// LibTorch's current stream is that one unless the caller set one (an application that
// runs tetra's step under its own stream guard must synchronise it before the step). A
// LibTorch built for CPU and a CUDA one both link this: it uses the CUDA runtime only.
class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int size, std::string name, int device, ncclComm_t comm)
      : Communicator(rank, size, std::move(name)), device_(device), comm_(comm) {
    TETRA_CUDA(cudaSetDevice(device_));
    TETRA_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));  // Note [Streams]
  }
  void name_group(const std::string& identity) { set_identity(identity, true); }
  ~NcclCommunicator() override {
    stop_progress_thread();
    if (stream_) cudaStreamDestroy(stream_);
    if (comm_) aborted_ ? ncclCommAbort(comm_) : ncclCommDestroy(comm_);
  }
  std::string backend() const override { return "nccl"; }
  at::Device device() const override { return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_)); }
  std::string refuses(const at::Tensor& t) const override {
    if (t.is_cuda()) return "";
    return "the nccl backend carries CUDA tensors only; a job's host tensors go over its host plane (Note [Two "
           "planes]: Mesh::host, or the world TrainerOptions::host)";
  }

 protected:
  void backend_allreduce(const at::Tensor& in, const at::Tensor& out, ReduceOp op, Deadline d) override {
    require_cuda(in, device_);
    require_cuda(out, device_);
    launch(d, [&] {
      TETRA_NCCL(ncclAllReduce(in.data_ptr(), out.data_ptr(), in.numel(), nccl_type(in.scalar_type()),
                               nccl_op(op), comm_, stream_));
    });
  }
  void backend_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op, Deadline d) override {
    require_cuda(in, device_);
    require_cuda(out, device_);
    launch(d, [&] {
      TETRA_NCCL(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_type(in.scalar_type()),
                                   nccl_op(op), comm_, stream_));
    });
  }
  void backend_allgather(const at::Tensor& in, const at::Tensor& out, Deadline d) override {
    require_cuda(in, device_);
    require_cuda(out, device_);
    launch(d, [&] {
      TETRA_NCCL(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), nccl_type(in.scalar_type()),
                               comm_, stream_));
    });
  }
  void backend_broadcast(const at::Tensor& t, int root, Deadline d) override {
    require_cuda(t, device_);
    launch(d, [&] {
      TETRA_NCCL(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), root,
                               comm_, stream_));
    });
  }
  void backend_send(const at::Tensor& t, int dst, int, Deadline d) override {
    require_cuda(t, device_);
    launch(d, [&] {
      TETRA_NCCL(ncclSend(t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), dst, comm_, stream_));
    });
  }
  void backend_recv(const at::Tensor& t, int src, int, Deadline d) override {
    require_cuda(t, device_);
    launch(d, [&] {
      TETRA_NCCL(ncclRecv(t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), src, comm_, stream_));
    });
  }
  void backend_barrier(Deadline d) override {
    if (!scratch_.defined()) {
      scratch_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
      TETRA_CUDA(cudaStreamSynchronize(cudaStreamLegacy));  // its fill ran on the compute stream
    }
    backend_allreduce(scratch_, scratch_, ReduceOp::kSum, d);
  }
  // Note [Streams]: the op waits for an event recorded now, on the issuing thread.
  std::function<void(Deadline)> order_after_issuer(std::function<void(Deadline)> run) override {
    int previous = 0;
    TETRA_CUDA(cudaGetDevice(&previous));
    TETRA_CUDA(cudaSetDevice(device_));
    cudaEvent_t raw = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&raw, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(raw, cudaStreamLegacy);
    cudaSetDevice(previous);
    // Destroyed when the op has run, or is dropped unrun (the communicator shut down).
    std::shared_ptr<CUevent_st> ready(raw, [](cudaEvent_t ev) {
      if (ev) cudaEventDestroy(ev);
    });
    TETRA_CUDA(e);
    return [this, ready = std::move(ready), run = std::move(run)](Deadline d) {
      TETRA_CUDA(cudaSetDevice(device_));
      TETRA_CUDA(cudaStreamWaitEvent(stream_, ready.get(), 0));
      run(d);
    };
  }
  std::shared_ptr<Communicator> backend_split(int color, int key, const std::string& name, Deadline d) override {
    ncclComm_t sub = nullptr;
    TETRA_CUDA(cudaSetDevice(device_));
    TETRA_NCCL(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr));
    if (color < 0 || !sub) return nullptr;
    int r = 0, n = 0;
    TETRA_NCCL(ncclCommUserRank(sub, &r));
    TETRA_NCCL(ncclCommCount(sub, &n));
    return std::make_shared<NcclCommunicator>(r, n, name, device_, sub);
  }

 private:
  // Enqueues on the stream, then polls it until done or the deadline (then aborts).
  template <typename F>
  void launch(Deadline deadline, F&& enqueue) {
    TETRA_CUDA(cudaSetDevice(device_));
    enqueue();
    for (int spins = 0;; ++spins) {
      cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) TETRA_CUDA(q);
      ncclResult_t async = ncclSuccess;
      TETRA_NCCL(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess && async != ncclInProgress)
        throw CommError(std::string("nccl: asynchronous error: ") + ncclGetErrorString(async));
      if (Clock::now() > deadline) {
        aborted_ = true;
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw TimeoutError("nccl op did not complete before its deadline; the NCCL communicator was aborted");
      }
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  int device_;
  ncclComm_t comm_;
  cudaStream_t stream_ = nullptr;
  bool aborted_ = false;
  at::Tensor scratch_;
};

}  // namespace

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "NCCL (unknown version)";
  return "NCCL " + std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." + std::to_string(v % 100);
}

std::string nccl_unavailable_reason() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return std::string("no usable CUDA driver (") + cudaGetErrorString(e) + ")";
  if (n == 0) return "no CUDA device";
  if (!at::hasCUDA()) return "this LibTorch has no CUDA (Debian's is CPU-only)";
  return "";
}

CommunicatorPtr nccl_from(Communicator& bootstrap, int device, const WorldOptions& options) {
  ncclUniqueId id;
  if (bootstrap.rank() == 0) TETRA_NCCL(ncclGetUniqueId(&id));
  at::Tensor bytes = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
  if (bootstrap.rank() == 0) std::memcpy(bytes.data_ptr(), &id, sizeof(id));
  BroadcastOptions b;
  b.timeout = options.timeout;
  bootstrap.broadcast(bytes, b)->wait();
  std::memcpy(&id, bytes.data_ptr(), sizeof(id));
  TETRA_CUDA(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  TETRA_NCCL(ncclCommInitRank(&comm, bootstrap.size(), id, bootstrap.rank()));
  auto world = std::make_shared<NcclCommunicator>(bootstrap.rank(), bootstrap.size(), "nccl world", device, comm);
  world->name_group("nccl:" + bootstrap.group()->identity);
  return with_health(world);  // Note [Health wrapper]
}

void register_nccl_backend(BackendRegistry& registry) {
  BackendEntry e;
  e.name = "nccl";
  e.description = nccl_version();
  e.carries_host = false;  // Note [Two planes]: the job's host tensors go over a host backend beside it
  e.unavailable = [] { return nccl_unavailable_reason(); };
  e.create = [](const LaunchInfo& launch, const WorldOptions& options, const CommunicatorPtr& host) -> CommunicatorPtr {
    int devices = 0;
    TETRA_CUDA(cudaGetDeviceCount(&devices));
    // The unique id goes over the host plane (mpi under mpirun or srun, gloo under torchrun).
    return nccl_from(host ? *host : *mpi_world(options), launch.local_rank % devices, options);
  };
  registry.add(std::move(e));
}

}  // namespace tetra::collectives
