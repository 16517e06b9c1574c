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
  release_free_segments();
}

CachingAllocator::Block* CachingAllocator::find_free(Pool& pool, uintptr_t stream, size_t size) {
  Block key{stream, size, nullptr, false, false};
  auto it = pool.lower_bound(&key);
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  Block* b = *it;
  pool.erase(it);
  return b;
}

CachingAllocator::Block* CachingAllocator::new_segment(size_t segment_size, uintptr_t stream, bool small) {
  void* p = source_.allocate(segment_size);
  if (!p) {
    process_pending(/*wait=*/true);
    release_free_segments();
    p = source_.allocate(segment_size);
  }
  if (!p) return nullptr;
  stats_.reserved += segment_size;
  stats_.num_segments++;
  return new Block{stream, segment_size, static_cast<char*>(p), false, small};
}

void* CachingAllocator::allocate(size_t nbytes, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!pending_.empty()) process_pending(/*wait=*/false);
  size_t size = round_up(std::max<size_t>(nbytes, 1), kRound);
  bool small = size <= kSmallRequest;
  Pool& pool = small ? small_free_ : large_free_;
  Block* b = find_free(pool, stream, size);
  if (!b) {
    size_t segment = small ? kSmallSegment : round_up(size, kLargeRound);
    b = new_segment(segment, stream, small);
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

void CachingAllocator::release_free_segments() {
  for (Pool* pool : {&small_free_, &large_free_}) {
    std::vector<Block*> whole;
    for (Block* b : *pool)
      if (!b->prev && !b->next) whole.push_back(b);  // a free block spanning its whole segment
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
  process_pending(/*wait=*/true);
  release_free_segments();
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
