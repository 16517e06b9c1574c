// The caching allocator's logic, run against a fake device with a fixed capacity.
#include <gtest/gtest.h>

#include <map>

#include <kiln/core/caching_allocator.h>
#include <kiln/core/error.h>

using kiln::CachingAllocator;

namespace {

struct FakeDevice {
  explicit FakeDevice(size_t cap) : capacity(cap) {}
  size_t capacity;
  size_t used = 0;
  int mallocs = 0, frees = 0;
  std::map<char*, size_t> live;
  uintptr_t cursor = 1 << 20;

  kiln::SegmentSource source() {
    return {[this](size_t n) -> void* {
              if (used + n > capacity) return nullptr;
              used += n;
              ++mallocs;
              char* p = reinterpret_cast<char*>(cursor);
              cursor += n + 4096;
              live[p] = n;
              return p;
            },
            [this](void* p) {
              auto it = live.find(static_cast<char*>(p));
              ASSERT_NE(it, live.end());
              used -= it->second;
              live.erase(it);
              ++frees;
            }};
  }
};

}  // namespace

TEST(CachingAllocator, ReusesFreedBlocksWithoutNewDeviceAllocations) {
  FakeDevice dev(64 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  void* a = alloc.allocate(1000);
  EXPECT_EQ(dev.mallocs, 1);
  alloc.free(a);
  void* b = alloc.allocate(900);  // same rounded size class: the cached block comes back
  EXPECT_EQ(b, a);
  EXPECT_EQ(dev.mallocs, 1);
  alloc.free(b);
}

TEST(CachingAllocator, SplitsSegmentsAndMergesOnFree) {
  FakeDevice dev(64 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  // Four small requests share one 2 MiB segment.
  void* p[4];
  for (auto& q : p) q = alloc.allocate(100 << 10);
  EXPECT_EQ(dev.mallocs, 1);
  EXPECT_EQ(alloc.stats().reserved, CachingAllocator::kSmallSegment);
  EXPECT_EQ(alloc.stats().allocated, 4 * size_t(100 << 10));
  for (auto& q : p) alloc.free(q);
  EXPECT_EQ(alloc.stats().allocated, 0u);
  // After merging, the whole segment is one free block again: a 1 MiB request fits without a new segment.
  void* big = alloc.allocate(1 << 20);
  EXPECT_EQ(dev.mallocs, 1);
  EXPECT_EQ(big, p[0]);
  alloc.free(big);
  alloc.empty_cache();
  EXPECT_EQ(dev.used, 0u);
  EXPECT_EQ(alloc.stats().reserved, 0u);
}

TEST(CachingAllocator, BlocksAreReusedOnlyOnTheirStream) {
  FakeDevice dev(64 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  void* a = alloc.allocate(4 << 20, /*stream=*/1);
  alloc.free(a);
  void* b = alloc.allocate(4 << 20, /*stream=*/2);
  EXPECT_NE(a, b);
  EXPECT_EQ(dev.mallocs, 2);
  void* c = alloc.allocate(4 << 20, /*stream=*/1);
  EXPECT_EQ(c, a);
  alloc.free(b);
  alloc.free(c);
}

TEST(CachingAllocator, PeakStatsAndReset) {
  FakeDevice dev(64 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  void* a = alloc.allocate(4 << 20);
  void* b = alloc.allocate(6 << 20);
  alloc.free(a);
  auto s = alloc.stats();
  EXPECT_EQ(s.allocated, size_t(6 << 20));
  EXPECT_EQ(s.peak_allocated, size_t(10 << 20));
  alloc.reset_peak_stats();
  EXPECT_EQ(alloc.stats().peak_allocated, size_t(6 << 20));
  alloc.free(b);
  EXPECT_NE(alloc.summary().find("allocated"), std::string::npos);
}

TEST(CachingAllocator, OutOfMemoryFreesTheCacheRetriesThenReportsBytes) {
  FakeDevice dev(10 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  void* a = alloc.allocate(6 << 20);
  alloc.free(a);  // 6 MiB now cached
  // 8 MiB does not fit next to the cached 6 MiB: the cache is released and the request retried.
  void* b = alloc.allocate(8 << 20);
  EXPECT_NE(b, nullptr);
  EXPECT_EQ(dev.frees, 1);
  // 4 MiB more cannot fit at all: an Error with the requested, allocated and reserved bytes.
  try {
    alloc.allocate(4 << 20);
    FAIL() << "expected an out-of-memory error";
  } catch (const kiln::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("out of memory"), std::string::npos) << m;
    EXPECT_NE(m.find("4.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("8.00 MiB allocated"), std::string::npos) << m;
    EXPECT_NE(m.find("8.00 MiB reserved"), std::string::npos) << m;
  }
  EXPECT_EQ(alloc.stats().num_ooms, 1u);
  alloc.free(b);
}

TEST(CachingAllocator, FreeOfAForeignPointerIsAnError) {
  FakeDevice dev(10 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  int x = 0;
  EXPECT_THROW(alloc.free(&x), kiln::Error);
}
