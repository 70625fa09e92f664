// Note [Pretend device]
// The two-planes test (Note [Two planes], collectives/backends.h) asks of every collective
// of a job what NCCL asks: is this tensor device memory? On a GPU the answer is the tensor's
// device. Here every tensor is host memory, so the test makes the distinction a GPU makes,
// by where each tensor's bytes came from:
//   - The job trains on the pretend device cpu:0 (TrainerOptions::device). LibTorch's CPU
//     kernels take it as the CPU, but every factory that names it (a parameter, a bucket,
//     a ZeRO unit, a pipeline's inbox, a batch moved with .to(device)) says so in its
//     arguments.
//   - An observer of every ATen op (a RecordFunction callback with the op's inputs and
//     outputs) marks the fresh bytes an op returns as device memory when the op names the
//     pretend device, or names no device and reads device memory (a product of a weight, a
//     gradient, a view's copy), as a GPU's kernel writes its output on its inputs' device.
//     An op that names the host (at::empty(..., kCPU), torch::tensor, at::full without a
//     device) makes host memory, as it would beside a GPU.
//   - Bytes are told apart by allocation: a CPU allocator wrapped around LibTorch's (and
//     tetra's) keeps every live block's range, its mark set by the observer and dropped when
//     the block is freed, so a host tensor that reuses a freed device block is host memory.
// holds(t) is then what t.is_cuda() would be on a GPU, for every tensor a strategy or core
// hands a communicator. What it cannot see: a device tensor "copied" to the host with a
// no-op .to(kCPU) on the pretend device shares the device bytes (on a GPU it would be a new
// host tensor), and memory not from the allocator (from_blob) is host memory.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/torch_compat.h"

namespace tetra::doubles {

class PretendDevice {
 public:
  static c10::Device device() { return c10::Device(c10::kCPU, 0); }

  // Wraps the CPU allocator and starts the observer, once per process; call before the
  // job's tensors exist (it is never undone: blocks made before it are host memory).
  static void install() {
    static const bool once = [] {
      static Wrapper wrapper(c10::GetCPUAllocator());
      c10::SetCPUAllocator(&wrapper, /*priority=*/2);  // above tetra's own (core/allocator.cpp: 1)
      at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                .needsInputs(true)
                                .needsOutputs(true)
                                .scopes({at::RecordScope::FUNCTION}));
      return true;
    }();
    (void)once;
  }

  // Whether t's bytes are device memory (Note [Pretend device]). A tensor without bytes
  // (empty, or on the meta device) is neither; it counts as device memory.
  static bool holds(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage() || t.storage().nbytes() == 0 || !t.storage().data()) return true;
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    const Block* b = r.find(t.storage().data());
    return b && b->device;
  }

 private:
  struct Block {
    size_t size = 0;
    bool device = false;
    std::shared_ptr<c10::DataPtr> inner;  // the wrapped allocator's, freed with the block
  };
  struct Registry {
    std::mutex mu;
    std::map<uintptr_t, Block> blocks;  // by start address
    // The live block that holds p (a storage may start inside a block: ZeRO-3 points its
    // parameters into a gathered unit).
    Block* find(const void* p, uintptr_t* start = nullptr) {
      const auto a = reinterpret_cast<uintptr_t>(p);
      auto it = blocks.upper_bound(a);
      if (it == blocks.begin()) return nullptr;
      --it;
      if (a >= it->first + std::max<size_t>(1, it->second.size)) return nullptr;
      if (start) *start = it->first;
      return &it->second;
    }
  };
  static Registry& registry() {
    static Registry* r = new Registry;  // outlives every tensor freed at exit
    return *r;
  }

  // The context of each DataPtr is its data, as LibTorch's raw_allocate wants (a kernel's
  // scratch buffer comes through it): the block's entry keeps the wrapped DataPtr.
  class Wrapper final : public core::compat::CpuAllocator {
   public:
    explicit Wrapper(c10::Allocator* inner) : inner_(inner) {}
    c10::DataPtr make(size_t n) const override {
      auto held = std::make_shared<c10::DataPtr>(inner_->allocate(n));
      void* data = held->get();
      if (!data) return std::move(*held);  // no bytes: nothing to tell apart
      {
        Registry& r = registry();
        std::lock_guard<std::mutex> lock(r.mu);
        r.blocks[reinterpret_cast<uintptr_t>(data)] = Block{n, false, std::move(held)};
      }
      return c10::DataPtr(data, data, &Wrapper::release, c10::Device(c10::kCPU));
    }
    c10::DeleterFnPtr raw_deleter() const override { return &Wrapper::release; }

   private:
    static void release(void* data) {
      std::shared_ptr<c10::DataPtr> inner;
      {
        Registry& r = registry();
        std::lock_guard<std::mutex> lock(r.mu);
        auto it = r.blocks.find(reinterpret_cast<uintptr_t>(data));
        if (it == r.blocks.end()) return;
        inner = std::move(it->second.inner);
        r.blocks.erase(it);
      }
      // `inner` frees the bytes through the wrapped allocator as it goes, outside the lock.
    }
    c10::Allocator* inner_;
  };

  // What the observer saw of an op's inputs.
  struct Seen : at::ObserverContext {
    std::vector<uintptr_t> inputs;  // the blocks the op read (or writes in place)
    bool reads_device = false;
    int named = 0;  // the device the op names: 0 none, 1 the pretend device, -1 another
  };

  template <typename F>
  static void each_tensor(const c10::IValue& v, F&& f) {
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) f(t);
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) each_tensor(e, f);
    } else if (v.isTuple()) {
      for (const c10::IValue& e : v.toTupleRef().elements()) each_tensor(e, f);
    }
  }

  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    auto seen = std::make_unique<Seen>();
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const c10::IValue& v : fn.inputs()) {
      if (v.isDevice()) {
        seen->named = v.toDevice() == device() ? 1 : -1;
        continue;
      }
      each_tensor(v, [&](const at::Tensor& t) {
        if (!t.defined() || !t.has_storage() || !t.storage().data()) return;
        uintptr_t start = 0;
        if (const Block* b = r.find(t.storage().data(), &start)) {
          seen->inputs.push_back(start);
          seen->reads_device = seen->reads_device || b->device;
        }
      });
    }
    return seen;
  }

  static void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
    const auto* seen = static_cast<const Seen*>(ctx);
    if (!seen) return;
    const bool device = seen->named ? seen->named > 0 : seen->reads_device;
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const c10::IValue& v : fn.outputs())
      each_tensor(v, [&](const at::Tensor& t) {
        if (!t.defined() || !t.has_storage() || !t.storage().data()) return;
        uintptr_t start = 0;
        Block* b = r.find(t.storage().data(), &start);
        if (!b) return;
        for (uintptr_t in : seen->inputs)
          if (in == start) return;  // in place or a view: its bytes keep what they are
        if (device) b->device = true;
        else if (seen->named < 0) b->device = false;  // made on the host it names
      });
  }
};

}  // namespace tetra::doubles
