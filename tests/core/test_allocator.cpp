// The cache of big blocks (Note [Big blocks], core/allocator.h): a freed big tensor's block
// serves the next tensor of its size class without a new mapping, small tensors stay with
// malloc, the raw interface (ideep's) works, and free blocks beyond the cap are unmapped.
#include "core/allocator.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstring>
#include <vector>

using namespace tetra::core;

namespace {

// Installed once for this test binary (it cannot be taken out again).
class BigBlocks : public testing::Test {
 protected:
  static void SetUpTestSuite() { install_big_block_cache(); }
};

at::Tensor floats(int64_t n) { return at::empty({n}, at::kFloat); }

}  // namespace

TEST_F(BigBlocks, SizeClassesRoundUpByAtMostAThirtySecond) {
  EXPECT_EQ(big_block_class(size_t{64} << 20), size_t{64} << 20);
  EXPECT_EQ(big_block_class((size_t{64} << 20) + 1), (size_t{66} << 20));
  for (size_t n : {size_t{1} << 20, size_t{3} << 20, (size_t{7} << 20) + 12345, size_t{1000} << 20}) {
    const size_t c = big_block_class(n);
    EXPECT_GE(c, n);
    EXPECT_LE(c - n, n / 32 + 4096) << n;
    EXPECT_EQ(c % 4096, 0u) << n;
  }
}

TEST_F(BigBlocks, AFreedBlockServesTheNextTensorOfItsClass) {
  const BigBlockStats before = big_block_stats();
  void* first = nullptr;
  {
    at::Tensor t = floats(4 << 20);  // 16 MiB
    first = t.data_ptr();
    t.fill_(1);
    EXPECT_EQ(big_block_stats().in_use - before.in_use, int64_t{16} << 20);
  }
  const BigBlockStats freed = big_block_stats();
  EXPECT_EQ(freed.in_use, before.in_use);
  EXPECT_GE(freed.cached, int64_t{16} << 20);
  at::Tensor again = floats(4 << 20);
  EXPECT_EQ(again.data_ptr(), first) << "the warm block was not reused";
  EXPECT_EQ(big_block_stats().mapped, freed.mapped) << "a new mapping for a size that was cached";
  // Another class maps a block of its own.
  at::Tensor other = floats(6 << 20);
  EXPECT_EQ(big_block_stats().mapped, freed.mapped + 1);
  EXPECT_NE(other.data_ptr(), first);
}

TEST_F(BigBlocks, SmallTensorsStayWithMallocAndTheRawInterfaceWorks) {
  const BigBlockStats before = big_block_stats();
  at::Tensor small = floats(1000);
  small.fill_(2);
  EXPECT_EQ(big_block_stats().in_use, before.in_use);
  c10::Allocator* a = c10::GetCPUAllocator();
  void* big = a->raw_allocate(size_t{2} << 20);
  void* tiny = a->raw_allocate(100);
  std::memset(big, 1, size_t{2} << 20);
  std::memset(tiny, 1, 100);
  EXPECT_EQ(big_block_stats().in_use, before.in_use + (int64_t{2} << 20));
  a->raw_deallocate(big);
  a->raw_deallocate(tiny);
  EXPECT_EQ(big_block_stats().in_use, before.in_use);
}

// Free blocks are kept up to max(256 MiB, a quarter of the bytes in use); beyond it the
// least recently freed are unmapped.
TEST_F(BigBlocks, TheCacheKeepsAtMostItsCap) {
  std::vector<at::Tensor> many;
  for (int i = 0; i < 24; ++i) many.push_back(floats((4 << 20) + (i << 18)));  // 24 classes, 16-39 MiB
  many.clear();
  const BigBlockStats s = big_block_stats();
  EXPECT_LE(s.cached, std::max<int64_t>(kCacheFloor, s.in_use / 4));
  EXPECT_GT(s.cached, 0);
}
