// The caching allocator's logic, run against a fake device with a fixed capacity.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include <kiln/core/caching_allocator.h>
#include <kiln/core/error.h>
#include <kiln/core/profiler.h>

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

namespace {

// Events on the fake device: recorded on a stream, completed when the test says so (or when waited for).
struct FakeEvents {
  std::map<void*, bool> done;
  std::vector<uintptr_t> recorded_on;
  int created = 0, destroyed = 0;

  kiln::SegmentSource add_to(kiln::SegmentSource s) {
    s.record_event = [this](uintptr_t stream) -> void* {
      void* e = new int(++created);
      done[e] = false;
      recorded_on.push_back(stream);
      return e;
    };
    s.event_done = [this](void* e) { return done.at(e); };
    s.wait_event = [this](void* e) { done.at(e) = true; };
    s.destroy_event = [this](void* e) {
      done.erase(e);
      delete static_cast<int*>(e);
      ++destroyed;
    };
    return s;
  }
  void complete_all() {
    for (auto& [e, d] : done) d = true;
  }
};

}  // namespace

TEST(CachingAllocator, RecordStreamDelaysReuseUntilTheOtherStreamsWorkIsDone) {
  FakeDevice dev(64 << 20);
  FakeEvents events;
  CachingAllocator alloc("fake:0", events.add_to(dev.source()));
  const uintptr_t main_stream = 1, side_stream = 2;
  void* a = alloc.allocate(4096, main_stream);
  alloc.record_stream(a, side_stream);
  alloc.record_stream(a, side_stream);  // once is enough
  alloc.record_stream(a, main_stream);  // its own stream: nothing to wait for
  alloc.free(a);
  EXPECT_EQ(alloc.stats().pending_frees, 1u);
  EXPECT_EQ(events.recorded_on, std::vector<uintptr_t>{side_stream});
  EXPECT_EQ(alloc.stats().allocated, 4096u) << "not reusable yet, so still counted";
  // While the side stream's event is pending, the block is not handed out again.
  void* b = alloc.allocate(4096, main_stream);
  EXPECT_NE(b, a);
  EXPECT_EQ(alloc.stats().pending_frees, 1u);
  // Once it has completed, the next allocation returns the block to the cache and can reuse it.
  events.complete_all();
  void* c = alloc.allocate(4096, main_stream);
  EXPECT_EQ(c, a);
  EXPECT_EQ(alloc.stats().pending_frees, 0u);
  EXPECT_EQ(events.destroyed, 1);
  alloc.free(b);
  alloc.free(c);
  EXPECT_EQ(alloc.stats().allocated, 0u);
}

TEST(CachingAllocator, EmptyCacheWaitsForPendingFrees) {
  FakeDevice dev(64 << 20);
  FakeEvents events;
  CachingAllocator alloc("fake:0", events.add_to(dev.source()));
  void* a = alloc.allocate(3 << 20, 1);  // a large block: a segment of its own
  alloc.record_stream(a, 7);
  alloc.free(a);
  EXPECT_EQ(dev.used, size_t(4) << 20);
  alloc.empty_cache();  // waits for the event, then returns the whole segment
  EXPECT_EQ(alloc.stats().pending_frees, 0u);
  EXPECT_EQ(dev.used, 0u);
}

TEST(CachingAllocator, RecordStreamNeedsEventsAndALiveBlock) {
  FakeDevice dev(64 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  void* a = alloc.allocate(100, 1);
  EXPECT_THROW(alloc.record_stream(a, 2), kiln::Error);
  alloc.free(a);
  FakeEvents events;
  CachingAllocator with_events("fake:1", events.add_to(dev.source()));
  EXPECT_THROW(with_events.record_stream(a, 2), kiln::Error);
}

// While the profiler runs, every allocation and free reports the bytes handed out as a counter (the memory
// timeline of a trace); off, nothing is recorded.
TEST(CachingAllocator, ReportsAllocatedBytesToTheProfiler) {
  FakeDevice dev(64 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  alloc.free(alloc.allocate(4096));  // not recorded
  kiln::profiler::start({.gpu = false});
  void* a = alloc.allocate(4096);
  void* b = alloc.allocate(2 << 20);
  alloc.free(a);
  const kiln::profiler::Trace trace = kiln::profiler::stop();
  alloc.free(b);
  std::vector<double> values;
  for (const auto& e : trace.events)
    if (e.category == "counter" && e.name == "fake:0 allocated bytes") values.push_back(e.value);
  ASSERT_EQ(values.size(), 3u);
  EXPECT_EQ(values[0], 4096.0);
  EXPECT_GT(values[1], values[0] + (2 << 20) - 1);
  EXPECT_EQ(values[2], values[1] - 4096.0);
}

// CUDA graph pools (cuda/graph.h): while a pool captures, the capturing stream's requests are served from
// the pool alone, other streams are refused, and the pool's blocks go back to the general cache on release.
TEST(CachingAllocator, CapturePoolKeepsItsBlocksApartFromTheGeneralCache) {
  FakeDevice dev(64 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  void* outside = alloc.allocate(1000, /*stream=*/7);
  alloc.free(outside);  // a free cached block of the general cache
  alloc.begin_capture_pool(1, 7);
  void* a = alloc.allocate(1000, 7);
  EXPECT_EQ(a, outside) << "the pool adopts a wholly free segment of the general cache";
  EXPECT_EQ(dev.mallocs, 1);
  void* partly = alloc.allocate(1000, 7);  // same pool, same segment
  EXPECT_NE(partly, a);
  alloc.free(partly);
  alloc.free(a);
  void* b = alloc.allocate(900, 7);  // freed during capture: reused within the pool
  EXPECT_EQ(b, a);
  try {
    alloc.allocate(1000, /*stream=*/8);
    ADD_FAILURE() << "a request on another stream during capture must be refused";
  } catch (const kiln::Error& e) {
    EXPECT_NE(std::string(e.what()).find("captured on stream"), std::string::npos) << e.what();
  }
  EXPECT_THROW(alloc.empty_cache(), kiln::Error);
  EXPECT_THROW(alloc.begin_capture_pool(2, 7), kiln::Error);  // captures do not nest
  alloc.end_capture_pool();
  // After capture the pool's memory is the graph's: ordinary requests do not get it.
  void* c = alloc.allocate(900, 7);
  EXPECT_NE(c, b);
  EXPECT_EQ(dev.mallocs, 2);
  alloc.free(b);
  void* d = alloc.allocate(900, 7);
  EXPECT_NE(d, b) << "a block of a live graph's pool was handed out";
  alloc.free(d);
  alloc.free(c);
  // Released (the graph is gone): its blocks serve the general cache again, no new segment needed.
  // Two wholly free 2 MiB segments now: four 1 MiB requests fit without a device allocation.
  alloc.release_pool(1);
  const int mallocs = dev.mallocs;
  std::vector<void*> halves;
  for (int k = 0; k < 4; ++k) halves.push_back(alloc.allocate(1 << 20, 7));
  EXPECT_EQ(dev.mallocs, mallocs);
  for (void* h : halves) alloc.free(h);
  alloc.empty_cache();
  EXPECT_EQ(dev.used, 0u);
}

TEST(CachingAllocator, CapturePoolBlockStillLiveAtReleaseReturnsToTheGeneralCacheWhenFreed) {
  FakeDevice dev(64 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  alloc.begin_capture_pool(3, 0);
  void* out = alloc.allocate(4 << 20, 0);  // a graph output that outlives the graph
  alloc.end_capture_pool();
  alloc.release_pool(3);
  alloc.free(out);
  void* again = alloc.allocate(4 << 20, 0);
  EXPECT_EQ(again, out);
  EXPECT_EQ(dev.mallocs, 1);
  alloc.free(again);
  alloc.empty_cache();
  EXPECT_EQ(dev.used, 0u);
  EXPECT_EQ(alloc.stats().allocated, 0u);
}

// A live graph's pool keeps its segments through empty_cache (its replays write them); released, they go.
TEST(CachingAllocator, EmptyCacheKeepsALiveGraphPoolsSegments) {
  FakeDevice dev(64 << 20);
  CachingAllocator alloc("fake:0", dev.source());
  alloc.begin_capture_pool(5, 0);
  void* temp = alloc.allocate(3 << 20, 0);  // a captured temporary, freed within the capture
  alloc.free(temp);
  alloc.end_capture_pool();
  alloc.empty_cache();
  EXPECT_EQ(dev.frees, 0) << "the pool's segment was released while its graph may replay";
  EXPECT_EQ(dev.used, size_t(4) << 20);
  alloc.release_pool(5);
  alloc.empty_cache();
  EXPECT_EQ(dev.frees, 1);
  EXPECT_EQ(dev.used, 0u);
}

// A block other streams used, freed while a graph captures: no event is recorded during the capture (it
// could join the graph); its events are recorded when the capture ends, and it is reused after them.
TEST(CachingAllocator, FreesWithOtherStreamsUsesDuringACaptureRecordTheirEventsAfterIt) {
  FakeDevice dev(64 << 20);
  FakeEvents events;
  CachingAllocator alloc("fake:0", events.add_to(dev.source()));
  void* a = alloc.allocate(4096, 1);
  alloc.record_stream(a, 2);
  alloc.begin_capture_pool(9, 1);
  alloc.free(a);
  EXPECT_TRUE(events.recorded_on.empty());
  alloc.end_capture_pool();
  EXPECT_EQ(events.recorded_on, std::vector<uintptr_t>{2});
  EXPECT_EQ(alloc.stats().pending_frees, 1u);
  events.complete_all();
  void* b = alloc.allocate(4096, 1);
  EXPECT_EQ(b, a);
  alloc.free(b);
  alloc.release_pool(9);
}
