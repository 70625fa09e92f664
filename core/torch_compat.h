// The few LibTorch calls whose spelling changed between 1.13 (Debian) and 2.x (the CUDA
// build on GPU machines). Everything version-dependent lives here.
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/version.h>

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

}  // namespace tetra::core::compat
