// The few LibTorch calls whose spelling or default changed between 1.13 (Debian 12) and
// 2.x (Debian 13's 2.6, tools/check-libtorch2.sh; the CUDA build on GPU machines).
// Everything version-dependent lives here. Header-only, on LibTorch alone: the
// collectives layer, below core, includes it too.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <torch/version.h>

#include <cstring>

namespace tetra::core::compat {

// Autocast on the CPU or a GPU (`type` kCPU or kCUDA).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline void set_autocast(c10::DeviceType type, bool enabled, at::ScalarType dtype) {
  at::autocast::set_autocast_dtype(type, dtype);
  at::autocast::set_autocast_enabled(type, enabled);
}
#else
inline void set_autocast(c10::DeviceType type, bool enabled, at::ScalarType dtype) {
  if (type == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(enabled);
  }
}
#endif

// Whether autocast is on for `type` on this thread now.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline bool autocast_enabled(c10::DeviceType type) { return at::autocast::is_autocast_enabled(type); }
#else
inline bool autocast_enabled(c10::DeviceType type) {
  return type == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
}
#endif

// bf16 autocast on the job's device (Note [One device]) for the lifetime of the guard; a
// no-op when off.
class Autocast {
 public:
  explicit Autocast(bool on, c10::DeviceType type = c10::DeviceType::CPU) : on_(on), type_(type) {
    if (on_) set_autocast(type_, true, at::kBFloat16);
  }
  ~Autocast() {
    if (on_) {
      set_autocast(type_, false, at::kBFloat16);
      at::autocast::clear_cache();
    }
  }
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  bool on_;
  c10::DeviceType type_;
};

// A c10::Allocator written once for LibTorch 1.13 and 2.x: allocate() is const in 1.13 and
// not from 2.3 on, copy_data() is pure in 2.x and absent before. Both spellings are
// declared (without `override`, which only one could take): the base's virtual is
// overridden by the one it has, and the other is an overload nobody calls through the base.
class CpuAllocator : public c10::Allocator {
 public:
  virtual c10::DataPtr make(size_t n) const = 0;
  c10::DataPtr allocate(size_t n) const { return make(n); }
  c10::DataPtr allocate(size_t n) { return make(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const { std::memcpy(dest, src, count); }
};

// c10d's TCPStore (the gloo backend's rendezvous): from 2.4 its options ask for the libuv
// server by default, and a LibTorch built without libuv (Debian 13's 2.6) then refuses to
// serve ("use_libuv was requested but PyTorch was build without libuv support"). The
// classic server, the only one 1.13 has, is in every build: every version gets it. A
// template so that this header needs no c10d include.
template <class TCPStoreOptions>
void use_classic_tcp_store(TCPStoreOptions& options) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  options.useLibUV = false;
#else
  (void)options;
#endif
}

}  // namespace tetra::core::compat
