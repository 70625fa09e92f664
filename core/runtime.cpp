#include "core/runtime.h"

#include <algorithm>

#include <dlfcn.h>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "hardware/env.h"
#include "hardware/host.h"

namespace tetra::core {

// Thread-ranks take turns seeding the generator and drawing their initial parameters, so
// every rank draws exactly what a single process draws.
std::mutex& global_rng_mutex() {
  static std::mutex mu;
  return mu;
}

namespace {

template <typename Fn>
Fn find_symbol(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

}  // namespace

void prepare_process(int argc, char** argv) {
  (void)argc;
  // Note [Thread pools and spinning]: libgomp has already read its environment.
  if (!env::is_set(env::kOmpWaitPolicy) && !env::is_set(env::kNoReexec)) {
    env::set(env::kOmpWaitPolicy, env::kOmpWaitPolicy.fallback);
    env::set(env::kNoReexec, "1");  // never loop, whatever happens below
    execv("/proc/self/exe", argv);
    // execv only returns on failure: carry on with the spinning default.
  }
  tune_allocator();
}

void tune_allocator() {
  // TETRA_MALLOC_DEFAULTS=1 keeps glibc's defaults (to measure what the tuning buys).
  if (env::flag(env::kMallocDefaults)) return;
  // 32 MiB is glibc's ceiling for the mmap threshold on 64-bit (HEAP_MAX_SIZE / 2).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 64 << 20);
  const bool map_each = env::flag(env::kMallocMmap);
  // What malloc still serves above 32 MiB (not tensors: those are big blocks) stays off mmap.
  if (!map_each) mallopt(M_MMAP_MAX, 0);
  install_big_block_cache(/*cache=*/!map_each);  // Note [Big blocks]
}

int local_ranks_from_env() {
  // The first set to a positive number; one set to anything else is passed over.
  for (const env::Knob* k : {&env::kOmpiLocalSize, &env::kTorchLocalWorldSize, &env::kMpiLocalNRanks,
                             &env::kSlurmNTasksPerNode, &env::kPmixLocalSize})
    if (const std::optional<int64_t> n = env::integer_value(*k, /*min=*/1)) return static_cast<int>(*n);
  return 1;
}

int default_threads(int ranks_per_process) {
  int n = hardware::usable_cores() / (local_ranks_from_env() * std::max(1, ranks_per_process));
  return n < 1 ? 1 : n;
}

int set_threads(int threads, int ranks_per_process) {
  if (threads <= 0) threads = default_threads(ranks_per_process);
  at::set_num_threads(threads);
  // Whichever BLAS serves LibTorch: OpenBLAS's pool, or BLIS's (one thread unless told).
  using SetFn = void (*)(int);
  if (auto fn = find_symbol<SetFn>("openblas_set_num_threads")) fn(threads);
  using BlisSetFn = void (*)(int64_t);  // dim_t
  if (auto fn = find_symbol<BlisSetFn>("bli_thread_set_num_threads")) {
    fn(threads);
  } else if (!env::is_set(env::kBlisNumThreads)) {
    // BLIS behind Debian's libblas.so.3 hides its API and reads this once, at its first call
    // (a process's later set_threads cannot change it; BLIS alone runs one thread otherwise).
    env::set(env::kBlisNumThreads, std::to_string(threads));
  }
  return threads;
}

// Note [Stop requests]: the handler touches two lock-free atomics and nothing else.
namespace {
std::atomic<int> g_stop{0};
std::atomic<int> g_second_exit{0};
static_assert(std::atomic<int>::is_always_lock_free, "the stop request must be async-signal-safe");

extern "C" void on_stop_signal(int signo) {
  int none = 0;
  if (g_stop.compare_exchange_strong(none, signo)) return;  // the first: stop after this step
  const int status = g_second_exit.load();
  _exit(status != 0 ? status : 128 + signo);  // the second: now
}
}  // namespace

int stop_requested() { return g_stop.load(); }

void request_stop(int signo) {
  int none = 0;
  g_stop.compare_exchange_strong(none, signo > 0 ? signo : kStopByProgram);
}

void clear_stop_request() {
  g_stop.store(0);
  g_second_exit.store(0);
}

void set_stop_exit_status(int status) { g_second_exit.store(status); }

void install_stop_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // reads, writes and MPI's polls carry on after the handler
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

std::string stop_reason(int reason) {
  if (reason == SIGTERM) return "SIGTERM";
  if (reason == SIGINT) return "SIGINT";
  if (reason == kStopByProgram) return "a stop request from the program";
  return "signal " + std::to_string(reason);
}

std::string blas_description() {
  // The library that serves sgemm_, which LibTorch calls through libblas.so.3: OpenBLAS
  // may be loaded beside another BLAS (as the LAPACK behind liblapack.so.3), so finding
  // its symbols proves nothing.
  Dl_info info{};
  void* gemm = dlsym(RTLD_DEFAULT, "sgemm_");
  const std::string lib = gemm && dladdr(gemm, &info) && info.dli_fname ? info.dli_fname : "";
  // RTLD_NOLOAD takes a reference to the loaded library; the guard gives it back.
  std::unique_ptr<void, int (*)(void*)> handle(lib.empty() ? nullptr : dlopen(lib.c_str(), RTLD_LAZY | RTLD_NOLOAD),
                                               [](void* h) { return h ? dlclose(h) : 0; });
  // That library and what it loads (Debian's OpenBLAS libblas.so.3 forwards to libopenblas.so.0).
  auto in_gemm_lib = [&](const char* name) -> void* { return handle ? dlsym(handle.get(), name) : nullptr; };
  using StrFn = char* (*)();
  if (auto config = reinterpret_cast<StrFn>(in_gemm_lib("openblas_get_config"))) {
    // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ..." -> "OpenBLAS 0.3.21 (Haswell)"
    std::string c = config();
    std::string s = c.substr(0, c.find(' ', c.find(' ') + 1));
    if (auto core = reinterpret_cast<StrFn>(in_gemm_lib("openblas_get_corename"))) s += std::string(" (") + core() + ")";
    return s;
  }
  if (auto version = reinterpret_cast<StrFn>(in_gemm_lib("bli_info_get_version_str"))) {
    std::string s = std::string("BLIS ") + version();
    using ArchFn = int (*)();  // arch_t, an enum
    using NameFn = char* (*)(int);
    auto arch = reinterpret_cast<ArchFn>(in_gemm_lib("bli_arch_query_id"));
    auto name = reinterpret_cast<NameFn>(in_gemm_lib("bli_arch_string"));
    if (arch && name) s += std::string(" (") + name(arch()) + ")";
    return s;
  }
  if (in_gemm_lib("mkl_get_version")) return "Intel MKL";
  // Debian's blis-*/libblas.so.3 exports the BLAS alone (no bli_* symbols): known by its path.
  if (lib.find("blis") != std::string::npos) return "BLIS (" + lib + ")";
  if (lib.empty()) return "no BLAS found";
  return "reference BLAS (slow: install libblis4-pthread or libopenblas0-pthread): " + lib;
}

}  // namespace tetra::core
