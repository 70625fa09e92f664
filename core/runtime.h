// Process-level settings that decide every speed figure on a small CPU machine.
//
// Note [Thread pools and spinning]
// LibTorch's intra-op pool is OpenMP; Debian's LibTorch multiplies through OpenBLAS,
// whose pthread build keeps a second pool. Both pools spin when idle, and on two cores
// two spinning pools starve each other (up to 2.5x slower steps). libgomp reads
// OMP_WAIT_POLICY once, when it is loaded — before main() — so prepare_process() re-execs
// the binary once with OMP_WAIT_POLICY=PASSIVE when the user has not chosen a policy.
// set_threads() then sizes both pools from train.threads.
//
// Note [Allocator thresholds]
// glibc's malloc serves blocks above M_MMAP_THRESHOLD with mmap and returns them to the
// kernel on free, so every step maps, faults in and unmaps each large activation and
// gradient (and trims the heap top past M_TRIM_THRESHOLD). Raising both keeps those
// pages in the heap across steps: about 15% on a small MLP here. Tensors of 1 MiB and
// more do not reach malloc at all: they come from tetra's cache of big blocks (Note [Big
// blocks] in core/allocator.h), which neither faults them in afresh each step nor lets
// small allocations cut them up. TETRA_MALLOC_MMAP=1 maps and unmaps each big block (no
// cache); TETRA_MALLOC_DEFAULTS=1 keeps all of glibc's defaults and LibTorch's allocator,
// to measure them.
//
// Note [Stop requests]
// SIGTERM or SIGINT — what Slurm and Kubernetes send some time before they kill a job —
// asks the job to stop: every rank finishes the step it is in, writes the checkpoint of
// that step and exits with kExitPreempted (collectives/error.h, README "Exit status"), and
// the same command resumes it exactly. The request is one process-wide atomic that the
// signal handler sets and nothing else (async-signal-safe); the trainer reads it once per
// step into the step's one small allreduce over every rank (Note [One decision per step],
// core/trainer.cpp), so a signal to any one rank stops them all at the same step. Only
// main programs install the handlers (tetra::run, which `train` uses): a process that
// builds trainers for its own ends (the tests) keeps its own, and may still call
// request_stop(). A second SIGTERM or SIGINT ends the process at once with _exit(128 +
// signal) — or with stop_exit_status() once the trainer has the agreed checkpoint on
// disk, so that a launcher which ends the remaining ranks with SIGTERM after the first
// one exits (mpirun does) still reads 4 from each.
#pragma once

#include <mutex>
#include <string>

namespace tetra::core {

// LibTorch's default CPU generator is one per process. Thread-ranks (tests, replicas)
// share it: whoever seeds it, draws from it or puts its state back while other
// thread-ranks may do the same holds this lock for the whole of it (the trainer while it
// seeds and builds the model; a strategy that runs layers and restores the state after).
std::mutex& global_rng_mutex();

// Call first in main(). May replace the process image once (execv of /proc/self/exe)
// to set the OpenMP wait policy; then tunes the allocator. Idempotent.
void prepare_process(int argc, char** argv);

// Raises glibc malloc's mmap and trim thresholds and installs the cache of big blocks
// (Note [Allocator thresholds]).
void tune_allocator();

// Intra-op threads for LibTorch (OpenMP) and OpenBLAS, per rank. 0 picks
// default_threads(ranks_per_process). Returns the count set.
int set_threads(int threads, int ranks_per_process = 1);

// Usable cores divided by the ranks on this host: the processes the launcher put here
// times the ranks each runs as threads (replicas); at least 1.
int default_threads(int ranks_per_process = 1);

// Ranks on this host according to the launcher's variables (1 when none).
int local_ranks_from_env();

// Note [Stop requests]. The reason a stop was requested: a signal number, or
// kStopByProgram for request_stop() with no signal; 0 when none was.
inline constexpr int kStopByProgram = 1024;  // above every signal number
int stop_requested();
// Asks the job to stop after its current step. Async-signal-safe; `signo` 0 means the
// program asked (kStopByProgram). An earlier request is kept.
void request_stop(int signo = 0);
// Forgets a request and the exit status below (for programs that train again after a
// PreemptedError, and for tests).
void clear_stop_request();
// SIGTERM and SIGINT request a stop; a second one exits at once. Idempotent.
void install_stop_handlers();
// The status a second signal exits with from now on (0: 128 + the signal). The trainer
// sets kExitPreempted once the agreed checkpoint is written.
void set_stop_exit_status(int status);
// "SIGTERM", "SIGINT", "signal 10", "a stop request from the program".
std::string stop_reason(int reason);

// "OpenBLAS 0.3.21 (pthread, Haswell)" or "reference BLAS" etc., from the loaded library.
std::string blas_description();

}  // namespace tetra::core
