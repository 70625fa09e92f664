#include "core/allocator.h"

#include <thread>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/torch_compat.h"

namespace tetra::core {

size_t big_block_class(size_t n) {
  size_t top = 1;
  while (top <= n / 2) top <<= 1;  // the power of two at or below n
  const size_t grain = std::max<size_t>(top / 32, 4096);
  return (n + grain - 1) / grain * grain;
}

namespace {

// The cache (Note [Big blocks]). Never destroyed: blocks may be freed at exit.
struct Cache {
  std::mutex mu;
  c10::Allocator* base = nullptr;
  c10::DeleterFnPtr base_raw_deleter = nullptr;
  bool keep = true;
  std::unordered_map<void*, size_t> live;  // block -> its class
  struct Free {
    void* block;
    size_t size;
  };
  std::list<Free> free_order;  // least recently freed first
  std::unordered_map<size_t, std::vector<std::list<Free>::iterator>> free_by_class;
  BigBlockStats stats;
};

Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

void* map_block(size_t size) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "tetra's big-block allocator: cannot map ", size,
              " bytes: ", std::strerror(errno));
  madvise(p, size, MADV_HUGEPAGE);  // advice only: fewer faults and TLB misses where THP is on
  return p;
}

void free_block(void* p) {
  Cache& c = cache();
  std::vector<Cache::Free> unmap;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.live.find(p);
    TORCH_CHECK(it != c.live.end(),
                "tetra's big-block allocator: freeing a block it did not give out");
    const size_t size = it->second;
    c.live.erase(it);
    c.stats.in_use -= static_cast<int64_t>(size);
    if (!c.keep) {
      unmap.push_back({p, size});
    } else {
      c.free_order.push_back({p, size});
      c.free_by_class[size].push_back(std::prev(c.free_order.end()));
      c.stats.cached += static_cast<int64_t>(size);
      const int64_t cap = std::max<int64_t>(static_cast<int64_t>(kCacheFloor), c.stats.in_use / 4);
      while (c.stats.cached > cap && !c.free_order.empty()) {
        auto oldest = c.free_order.begin();
        auto& same = c.free_by_class[oldest->size];
        same.erase(std::find(same.begin(), same.end(), oldest));
        c.stats.cached -= static_cast<int64_t>(oldest->size);
        unmap.push_back(*oldest);
        c.free_order.erase(oldest);
      }
    }
  }
  for (const auto& f : unmap) munmap(f.block, f.size);
}

// A raw_allocate'd block (ideep's, say) comes back here: ours, or the wrapped allocator's.
void raw_free(void* p) {
  Cache& c = cache();
  bool ours = false;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    ours = c.live.count(p) > 0;
  }
  if (ours)
    free_block(p);
  else if (c.base_raw_deleter)
    c.base_raw_deleter(p);
}

c10::DataPtr allocate_block(size_t n) {
  Cache& c = cache();
  if (n < kBigBlock) return c.base->allocate(n);
  const size_t size = big_block_class(n);
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.free_by_class.find(size);
    if (it != c.free_by_class.end() && !it->second.empty()) {
      auto entry = it->second.back();  // the most recently freed: warmest
      it->second.pop_back();
      p = entry->block;
      c.free_order.erase(entry);
      c.stats.cached -= static_cast<int64_t>(size);
    }
  }
  const bool fresh = p == nullptr;
  if (fresh) p = map_block(size);
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (fresh) ++c.stats.mapped;
    c.live.emplace(p, size);
    c.stats.in_use += static_cast<int64_t>(size);
    c.stats.peak_in_use = std::max(c.stats.peak_in_use, c.stats.in_use);
  }
  return {p, p, &free_block, c10::Device(c10::DeviceType::CPU)};
}

class BigBlockAllocator final : public compat::CpuAllocator {
 public:
  c10::DataPtr make(size_t n) const override { return allocate_block(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_free; }
};

}  // namespace

void install_big_block_cache(bool keep) {
  Cache& c = cache();
  static BigBlockAllocator* allocator = new BigBlockAllocator;
  std::lock_guard<std::mutex> lock(c.mu);
  c.keep = keep;
  if (c.base) return;
  c.base = c10::GetCPUAllocator();
  c.base_raw_deleter = c.base->raw_deleter();
  // Above the default allocator's priority (0), so LibTorch's tensors come here.
  c10::SetCPUAllocator(allocator, /*priority=*/1);
}

BigBlockStats big_block_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  BigBlockStats s = c.stats;
  return s;
}

// ---- counting (Note [Kept bytes]) -----------------------------------------------------

namespace {

struct Counter {
  std::mutex scope;  // one CountedBytes at a time
  std::mutex mu;
  c10::Allocator* base = nullptr;
  std::thread::id counting;          // the thread whose allocations count
  std::unordered_map<void*, std::pair<c10::DataPtr, size_t>> counted;  // by data pointer
  int64_t live = 0, peak = 0;
  uint8_t priority = 0;  // the CPU allocator's, found when the scope began
};
Counter& counter() {
  static Counter* c = new Counter;  // never destroyed: tensors counted may be freed at exit
  return *c;
}

void free_counted(void* p) {
  Counter& c = counter();
  c10::DataPtr inner;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.counted.find(p);
    if (it == c.counted.end()) return;
    c.live -= static_cast<int64_t>(it->second.second);
    inner = std::move(it->second.first);
    c.counted.erase(it);
  }
  // `inner` frees the bytes through the allocator that made them, here.
}

class CountingAllocator final : public compat::CpuAllocator {
 public:
  c10::DataPtr make(size_t n) const override {
    Counter& c = counter();
    c10::DataPtr d = c.base->allocate(n);
    if (std::this_thread::get_id() != c.counting || d.get() == nullptr) return d;
    void* p = d.get();
    std::lock_guard<std::mutex> lock(c.mu);
    c.live += static_cast<int64_t>(n);
    c.peak = std::max(c.peak, c.live);
    c.counted.emplace(p, std::make_pair(std::move(d), n));
    return {p, p, &free_counted, c10::Device(c10::DeviceType::CPU)};
  }
  // A raw block (ideep's) of this thread's is counted too; another's is the base's.
  c10::DeleterFnPtr raw_deleter() const override { return &raw_free_counted; }
  static void raw_free_counted(void* p) {
    Counter& c = counter();
    {
      std::lock_guard<std::mutex> lock(c.mu);
      if (c.counted.count(p) == 0) {
        c10::DeleterFnPtr base = c.base ? c.base->raw_deleter() : nullptr;
        if (base) base(p);
        return;
      }
    }
    free_counted(p);
  }
};

}  // namespace

CountedBytes::CountedBytes() {
  Counter& c = counter();
  c.scope.lock();
  static CountingAllocator* allocator = new CountingAllocator;
  std::lock_guard<std::mutex> lock(c.mu);
  c.base = c10::GetCPUAllocator();
  c.counting = std::this_thread::get_id();
  c.live = c.peak = 0;
  // At the priority of what is installed (LibTorch's 0, the big-block cache's 1, a
  // program's own): c10 keeps the allocator of the highest priority set and does not say
  // which that is, so the lowest that takes is it; putting the allocator back at the same
  // priority leaves both as they were.
  for (int p = 0; p <= 255; ++p) {
    c10::SetCPUAllocator(allocator, static_cast<uint8_t>(p));
    if (c10::GetCPUAllocator() == allocator) {
      c.priority = static_cast<uint8_t>(p);
      break;
    }
  }
}

CountedBytes::~CountedBytes() {
  Counter& c = counter();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    c10::SetCPUAllocator(c.base, c.priority);
    c.counting = std::thread::id();
  }
  c.scope.unlock();
}

int64_t CountedBytes::live() const {
  Counter& c = counter();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.live;
}

int64_t CountedBytes::peak() const {
  Counter& c = counter();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.peak;
}

}  // namespace tetra::core
