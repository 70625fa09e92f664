// Where the bytes of big tensors come from.
//
// Note [Big blocks]
// A training step allocates and frees the same big tensors again and again: each weight's
// gradient as backward makes it (64 MiB for a 4096 x 4096 layer), activations, buffers on
// their way through the collectives. glibc's malloc serves them one of two ways, both bad
// here. Mapped (its default above 32 MiB), every step maps, faults in and unmaps them:
// the 104M-parameter MLP of bench-zero spent most of its step in the kernel. From the heap
// (M_MMAP_MAX = 0, tetra's setting before this), a freed 64 MiB block is soon cut up by
// small allocations that land in it, and the next 64 MiB gradient extends the heap: peak
// RSS grew by 64 MiB at a time over the first steps (up to 192 MiB on a ZeRO rank, traced
// with an allocation tracer), which is what the OS counts, whatever the model state is.
//
// So LibTorch's CPU allocator is wrapped, as PyTorch's CUDA caching allocator does on a
// GPU: a tensor of at least kBigBlock bytes gets a block of its size class (rounded up by
// at most 1/32) from a cache of mappings tetra keeps; freed, the block goes back to the
// cache for the next tensor of that class, never to the heap, where nothing can cut it up.
// A step that makes the same tensors every time reuses the same blocks, already faulted
// in: no page faults, no fragmentation. Blocks are advised as transparent huge pages.
// The cache keeps at most max(kCacheFloor, a quarter of the bytes in use) of free blocks:
// beyond that the least recently freed are unmapped, so a run whose sizes change (an
// evaluation's batch) does not hoard the old ones. Smaller tensors stay with malloc.
//
// Installed by tune_allocator() (core/runtime.h) in the programs tetra starts; a library
// user's program keeps LibTorch's allocator unless it calls install_big_block_cache().
// TETRA_MALLOC_DEFAULTS=1 installs nothing (glibc's defaults, to measure them);
// TETRA_MALLOC_MMAP=1 maps every big block afresh and unmaps it when freed (no cache).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tetra::core {

inline constexpr size_t kBigBlock = size_t{1} << 20;      // 1 MiB: smaller ones stay with malloc
inline constexpr size_t kCacheFloor = size_t{256} << 20;  // free blocks always allowed in the cache

// The size class a big request of n bytes gets: n rounded up to a multiple of 1/32 of
// the power of two below it (and of the page).
size_t big_block_class(size_t n);

// Wraps LibTorch's CPU allocator with the cache (idempotent). `cache` false: map and unmap
// each big block (TETRA_MALLOC_MMAP=1).
void install_big_block_cache(bool cache = true);

struct BigBlockStats {
  int64_t in_use = 0;  // bytes of big blocks held by tensors now (their classes)
  int64_t cached = 0;  // bytes of free blocks kept for reuse
  int64_t peak_in_use = 0;
  int64_t mapped = 0;  // mappings made so far (a reused block makes none)
};
BigBlockStats big_block_stats();

// Note [Kept bytes]: counts the bytes of the CPU tensors this thread allocates while the
// scope lives (their requested sizes, whatever block serves them), for measuring what a
// layer's forward keeps for its backward. Tensors allocated meanwhile by other threads are
// not counted. One scope at a time in the process (a second waits for the first).
class CountedBytes {
 public:
  CountedBytes();   // wraps the CPU allocator (at its priority: what it is stays installed)
  ~CountedBytes();  // puts the allocator back; what it counted still frees correctly
  CountedBytes(const CountedBytes&) = delete;
  CountedBytes& operator=(const CountedBytes&) = delete;
  int64_t live() const;  // bytes allocated in the scope and not yet freed
  int64_t peak() const;  // the most live() has been
};

}  // namespace tetra::core
