#include <kiln/core/caching_allocator.h>

#include <sstream>
#include <vector>

#include <kiln/core/error.h>
#include <kiln/core/profiler.h>

namespace kiln {

namespace {
size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
std::string mib(size_t bytes) {
  std::ostringstream os;
  os.precision(2);
  os << std::fixed << double(bytes) / double(1 << 20) << " MiB";
  return os.str();
}
}  // namespace

CachingAllocator::CachingAllocator(std::string device_name, SegmentSource source)
    : device_name_(std::move(device_name)), source_(std::move(source)) {}

CachingAllocator::~CachingAllocator() {
  // Blocks still handed out belong to tensors that outlive the allocator (static destruction order);
  // only cached segments are returned.
  std::lock_guard<std::mutex> lock(mutex_);
  if (!pending_.empty() && source_.wait_event) process_pending(/*wait=*/true);
  release_free_segments(/*graph_pools=*/true);
}

CachingAllocator::Block* CachingAllocator::find_free(Pool& pool, int graph_pool, uintptr_t stream, size_t size) {
  Block key{stream, size, nullptr, false, false};
  key.pool = graph_pool;
  auto it = pool.lower_bound(&key);
  if (it == pool.end() || (*it)->pool != graph_pool || (*it)->stream != stream) return nullptr;
  Block* b = *it;
  pool.erase(it);
  return b;
}

CachingAllocator::Block* CachingAllocator::new_segment(size_t segment_size, uintptr_t stream, bool small,
                                                       int graph_pool) {
  void* p = source_.allocate(segment_size);
  if (!p && !capture_pool_) {  // during a capture nothing may wait or be released
    process_pending(/*wait=*/true);
    release_free_segments();
    p = source_.allocate(segment_size);
  }
  if (!p) return nullptr;
  stats_.reserved += segment_size;
  stats_.num_segments++;
  Block* b = new Block{stream, segment_size, static_cast<char*>(p), false, small};
  b->pool = graph_pool;
  return b;
}

void* CachingAllocator::allocate(size_t nbytes, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  int graph_pool = 0;
  if (capture_pool_) {
    KILN_CHECK(stream == capture_stream_, device_name_, " allocator: a request for ", mib(nbytes), " on stream 0x",
               std::hex, stream, " while a CUDA graph is being captured on stream 0x", capture_stream_, std::dec,
               ": memory the graph's work uses must come from its pool, so allocate on the capturing stream (or "
               "before capture_begin)");
    graph_pool = capture_pool_;
  } else if (!pending_.empty()) {
    process_pending(/*wait=*/false);
  }
  size_t size = round_up(std::max<size_t>(nbytes, 1), kRound);
  bool small = size <= kSmallRequest;
  Pool& pool = small ? small_free_ : large_free_;
  Block* b = find_free(pool, graph_pool, stream, size);
  if (!b && graph_pool) b = adopt_free_segment(pool, graph_pool, stream, size);
  if (!b) {
    size_t segment = small ? kSmallSegment : round_up(size, kLargeRound);
    b = new_segment(segment, stream, small, graph_pool);
    if (!b) {
      stats_.num_ooms++;
      KILN_FAIL(device_name_, " out of memory: tried to allocate ", mib(nbytes), " (", nbytes, " bytes); ",
                mib(stats_.allocated), " allocated by Kiln, ", mib(stats_.reserved),
                " reserved by its cache (the cache was emptied and the allocation retried once)");
    }
  }
  // Split off the tail when the remainder is worth keeping.
  size_t remaining = b->size - size;
  if ((b->small_pool && remaining >= kRound) || (!b->small_pool && remaining > kSmallRequest)) {
    Block* rest = new Block{stream, remaining, b->ptr + size, false, b->small_pool, b, b->next};
    rest->pool = b->pool;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    pool.insert(rest);
  }
  b->allocated = true;
  live_[b->ptr] = b;
  stats_.allocated += b->size;
  stats_.num_allocs++;
  update_peaks();
  if (profiler::is_enabled()) profiler::counter(device_name_ + " allocated bytes", double(stats_.allocated));
  return b->ptr;
}

void CachingAllocator::free(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  KILN_CHECK(it != live_.end(), device_name_, " allocator: free of a pointer it did not allocate");
  Block* b = it->second;
  live_.erase(it);
  if (!b->stream_uses.empty() && capture_pool_) {
    // While a stream captures, an event recorded now could become part of the graph: record it at the end.
    deferred_.push_back(b);
    return;
  }
  if (!b->stream_uses.empty()) {
    // Work queued on the other streams may still read or write it: reuse it once that work is done.
    PendingFree pending{b, {}};
    for (uintptr_t s : b->stream_uses) pending.events.push_back(source_.record_event(s));
    b->stream_uses.clear();
    pending_.push_back(std::move(pending));
    return;
  }
  return_block(b);
}

void CachingAllocator::record_stream(void* ptr, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  KILN_CHECK(it != live_.end(), device_name_, " allocator: record_stream of a pointer it did not allocate");
  KILN_CHECK(source_.record_event && source_.event_done && source_.wait_event && source_.destroy_event, device_name_,
             " allocator: record_stream needs events, which this device has none of");
  Block* b = it->second;
  if (stream == b->stream) return;
  for (uintptr_t s : b->stream_uses)
    if (s == stream) return;
  b->stream_uses.push_back(stream);
}

void CachingAllocator::process_pending(bool wait) {
  std::vector<PendingFree> still;
  for (PendingFree& p : pending_) {
    bool done = true;
    for (void* e : p.events) {
      if (wait) source_.wait_event(e);
      else if (!source_.event_done(e)) done = false;
    }
    if (!done) {
      still.push_back(std::move(p));
      continue;
    }
    for (void* e : p.events) source_.destroy_event(e);
    return_block(p.block);
  }
  pending_ = std::move(still);
}

void CachingAllocator::return_block(Block* b) {
  b->allocated = false;
  stats_.allocated -= b->size;
  if (profiler::is_enabled()) profiler::counter(device_name_ + " allocated bytes", double(stats_.allocated));
  Pool& pool = b->small_pool ? small_free_ : large_free_;
  // Merge with free neighbours in the same segment.
  if (b->prev && !b->prev->allocated) {
    Block* p = b->prev;
    pool.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    delete b;
    b = p;
  }
  if (b->next && !b->next->allocated) {
    Block* n = b->next;
    pool.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    delete n;
  }
  pool.insert(b);
}

void CachingAllocator::release_free_segments(bool graph_pools) {
  for (Pool* pool : {&small_free_, &large_free_}) {
    std::vector<Block*> whole;
    // a free block spanning its whole segment; a live graph's pool keeps its segments (its replays write
    // them) unless the allocator itself is going away
    for (Block* b : *pool)
      if (!b->prev && !b->next && (graph_pools || b->pool == 0)) whole.push_back(b);
    for (Block* b : whole) {
      pool->erase(b);
      source_.release(b->ptr);
      stats_.reserved -= b->size;
      delete b;
    }
  }
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  KILN_CHECK(!capture_pool_, device_name_, " allocator: empty_cache during a CUDA graph capture (it would free memory "
             "the graph uses and wait for the device)");
  process_pending(/*wait=*/true);
  release_free_segments();
}

CachingAllocator::Block* CachingAllocator::adopt_free_segment(Pool& pool, int graph_pool, uintptr_t stream,
                                                             size_t size) {
  // A wholly free segment of the general cache is nobody's: the graph's pool may take it (a segment
  // partly in use stays where it is, as its blocks merge only with neighbours of their own pool).
  Block key{stream, size, nullptr, false, false};
  for (auto it = pool.lower_bound(&key); it != pool.end() && (*it)->pool == 0 && (*it)->stream == stream; ++it) {
    Block* b = *it;
    if (b->prev || b->next) continue;
    pool.erase(it);
    b->pool = graph_pool;
    return b;
  }
  return nullptr;
}

void CachingAllocator::begin_capture_pool(int pool, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  KILN_CHECK(pool > 0, device_name_, " allocator: graph pools are numbered from 1, got ", pool);
  KILN_CHECK(!capture_pool_, device_name_, " allocator: a CUDA graph capture is already under way (pool ", capture_pool_,
             "); captures on one device do not nest");
  capture_pool_ = pool;
  capture_stream_ = stream;
}

void CachingAllocator::end_capture_pool() {
  std::lock_guard<std::mutex> lock(mutex_);
  capture_pool_ = 0;
  capture_stream_ = 0;
  for (Block* b : deferred_) {  // frees of blocks other streams used, held back during the capture
    PendingFree pending{b, {}};
    for (uintptr_t s : b->stream_uses) pending.events.push_back(source_.record_event(s));
    b->stream_uses.clear();
    pending_.push_back(std::move(pending));
  }
  deferred_.clear();
}

void CachingAllocator::release_pool(int pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  KILN_CHECK(pool != capture_pool_, device_name_, " allocator: release_pool of the pool being captured");
  for (Pool* free_set : {&small_free_, &large_free_}) {
    std::vector<Block*> mine;
    for (Block* b : *free_set)
      if (b->pool == pool) mine.push_back(b);
    for (Block* b : mine) {
      free_set->erase(b);
      b->pool = 0;
    }
    for (Block* b : mine) free_set->insert(b);  // re-keyed: its neighbours in the segment are of the same pool
  }
  for (auto& [ptr, b] : live_)
    if (b->pool == pool) b->pool = 0;
  for (PendingFree& p : pending_)
    if (p.block->pool == pool) p.block->pool = 0;
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  MemoryStats s = stats_;
  s.pending_frees = pending_.size();
  return s;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_allocated = stats_.allocated;
  stats_.peak_reserved = stats_.reserved;
}

void CachingAllocator::update_peaks() {
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
}

std::string CachingAllocator::summary() const {
  MemoryStats s = stats();
  size_t cached_small = 0, cached_large = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Block* b : small_free_) cached_small += b->size;
    for (Block* b : large_free_) cached_large += b->size;
  }
  std::ostringstream os;
  os << "Kiln memory summary (" << device_name_ << ")\n"
     << "  allocated:      " << mib(s.allocated) << " (peak " << mib(s.peak_allocated) << ")\n"
     << "  reserved:       " << mib(s.reserved) << " (peak " << mib(s.peak_reserved) << ")\n"
     << "  cached free:    " << mib(cached_small) << " small pool, " << mib(cached_large) << " large pool\n"
     << "  requests:       " << s.num_allocs << " served, " << s.num_segments << " device allocations, " << s.num_ooms
     << " out-of-memory\n";
  return os.str();
}

}  // namespace kiln
