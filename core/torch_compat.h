// The few LibTorch calls whose spelling changed between 1.13 (Debian) and 2.x (the CUDA
// build on GPU machines). Everything version-dependent lives here.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <torch/version.h>

#include <cstring>

namespace tetra::core::compat {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline void set_cpu_autocast(bool enabled, at::ScalarType dtype) {
  at::autocast::set_autocast_dtype(at::kCPU, dtype);
  at::autocast::set_autocast_enabled(at::kCPU, enabled);
}
#else
inline void set_cpu_autocast(bool enabled, at::ScalarType dtype) {
  at::autocast::set_autocast_cpu_dtype(dtype);
  at::autocast::set_cpu_enabled(enabled);
}
#endif

// Autocast on the CPU for the lifetime of the guard (bf16 training); a no-op when off.
class CpuAutocast {
 public:
  explicit CpuAutocast(bool on) : on_(on) {
    if (on_) set_cpu_autocast(true, at::kBFloat16);
  }
  ~CpuAutocast() {
    if (on_) {
      set_cpu_autocast(false, at::kBFloat16);
      at::autocast::clear_cache();
    }
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool on_;
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

}  // namespace tetra::core::compat
