#pragma once
// A device-memory cache in the style of PyTorch's CUDA caching allocator, independent of CUDA so its
// logic is tested on any machine. Device allocations (cudaMalloc) are slow and synchronizing; the cache
// keeps freed blocks and hands them out again.
//
// - Requests round up to 512 bytes. Requests up to 1 MiB come from 2 MiB segments (the small pool),
//   larger ones from segments of their own size rounded up to 2 MiB (the large pool).
// - A free block is found best-fit (smallest that fits) among blocks of the same stream: memory freed on
//   one stream is only reused on that stream, so no cross-stream synchronization is needed.
// - record_stream(ptr, s): the block is also used by work queued on stream s (PyTorch's
//   Tensor.record_stream). When it is freed, an event is recorded on each such stream, and the block is
//   reused only once every event has completed (checked at the next allocation; a request the device
//   cannot serve first waits for them).
// - A block larger than needed is split; the remainder stays cached (small pool: when >= 512 bytes;
//   large pool: when > 1 MiB). Freed blocks merge with free neighbours of the same segment.
// - When the device refuses a segment, every cached segment that is wholly free is released and the
//   request is retried once; if it still fails, a kiln::Error gives the requested, allocated and
//   reserved bytes.
// - CUDA graphs (cuda/graph.h): while a graph is captured, requests on the capturing stream come from the
//   graph's private pool, whose blocks no other request is given (a replay rewrites them); a request on
//   another stream is refused. The pool goes back to the general cache when the graph is destroyed; until
//   then neither empty_cache nor an out-of-memory retry releases its segments.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace kiln {

// Where segments come from: allocate returns nullptr when the device is out of memory. The event
// functions serve record_stream: record an event on a stream (returns its handle), say whether it has
// completed, wait for it, destroy it. Without them record_stream is refused.
struct SegmentSource {
  std::function<void*(size_t)> allocate;
  std::function<void(void*)> release;
  std::function<void*(uintptr_t stream)> record_event = {};
  std::function<bool(void* event)> event_done = {};
  std::function<void(void* event)> wait_event = {};
  std::function<void(void* event)> destroy_event = {};
};

struct MemoryStats {
  size_t allocated = 0;       // bytes in blocks handed out (rounded sizes)
  size_t reserved = 0;        // bytes in segments obtained from the device
  size_t peak_allocated = 0;  // high-water mark of `allocated` since the last reset
  size_t peak_reserved = 0;
  uint64_t num_allocs = 0;    // requests served
  uint64_t num_segments = 0;  // device allocations made (cache misses)
  uint64_t num_ooms = 0;      // requests that failed even after freeing the cache
  size_t pending_frees = 0;   // blocks freed but waiting for other streams' work (record_stream)
};

class CachingAllocator {
 public:
  static constexpr size_t kRound = 512;
  static constexpr size_t kSmallRequest = 1 << 20;  // 1 MiB
  static constexpr size_t kSmallSegment = 2 << 20;  // 2 MiB
  static constexpr size_t kLargeRound = 2 << 20;

  CachingAllocator(std::string device_name, SegmentSource source);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  void* allocate(size_t nbytes, uintptr_t stream = 0);
  void free(void* ptr);
  // Marks the live block at ptr as used by work on `stream` too (a no-op for its own stream).
  void record_stream(void* ptr, uintptr_t stream);
  // Returns every wholly free segment to the device.
  void empty_cache();
  MemoryStats stats() const;
  void reset_peak_stats();

  // CUDA graph capture. From begin_capture_pool to end_capture_pool, requests on `stream` are served from
  // private pool `pool` (> 0) and blocks freed there return to it, so captured work reuses memory only
  // within its own graph (the pool adopts wholly free segments of the general cache before it asks the
  // device); a request on any other stream is refused with a kiln::Error (its memory would be outside the
  // graph's). Meanwhile no event is polled and no segment released (both are illegal while
  // a stream captures): a request the pool cannot serve takes a new segment or fails.
  void begin_capture_pool(int pool, uintptr_t stream);
  void end_capture_pool();
  // Hands every block of `pool` to the general cache (its graph is gone): free blocks are reusable at
  // once, live ones once freed.
  void release_pool(int pool);
  std::string summary() const;

 private:
  struct Block {
    uintptr_t stream;
    size_t size;
    char* ptr;
    bool allocated = false;
    bool small_pool;
    Block* prev = nullptr;  // neighbours within the segment
    Block* next = nullptr;
    std::vector<uintptr_t> stream_uses = {};  // other streams that use it (record_stream)
    int pool = 0;                             // 0: the general cache; > 0: a CUDA graph's private pool
  };
  struct PendingFree {
    Block* block;
    std::vector<void*> events;  // one per stream that used the block
  };
  struct BlockOrder {
    bool operator()(const Block* a, const Block* b) const {
      if (a->pool != b->pool) return a->pool < b->pool;
      if (a->stream != b->stream) return a->stream < b->stream;
      if (a->size != b->size) return a->size < b->size;
      return a->ptr < b->ptr;
    }
  };
  using Pool = std::set<Block*, BlockOrder>;

  Block* find_free(Pool& pool, int graph_pool, uintptr_t stream, size_t size);
  Block* adopt_free_segment(Pool& pool, int graph_pool, uintptr_t stream, size_t size);
  Block* new_segment(size_t segment_size, uintptr_t stream, bool small, int graph_pool);
  void release_free_segments(bool graph_pools = false);
  void update_peaks();
  void return_block(Block* b);  // to its pool, merged with free neighbours
  // Returns the pending blocks whose events have all completed (all of them, waiting, when wait).
  void process_pending(bool wait);

  std::string device_name_;
  SegmentSource source_;
  mutable std::mutex mutex_;
  Pool small_free_, large_free_;
  std::unordered_map<void*, Block*> live_;
  std::vector<PendingFree> pending_;
  std::vector<Block*> deferred_;  // freed during a capture with other streams' uses: events recorded at its end
  MemoryStats stats_;
  int capture_pool_ = 0;  // > 0 while a CUDA graph captures
  uintptr_t capture_stream_ = 0;
};

}  // namespace kiln
