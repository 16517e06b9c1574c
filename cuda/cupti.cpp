// The profiler's GPU side (core/profiler.h): CUPTI's activity API records every CUDA kernel and memcpy with
// its start and end on the GPU; the records arrive in buffers CUPTI fills and hands back, and are converted
// to profiler events on the profiler's clock (CUPTI's timestamps less their value at start()).
#ifdef KILN_WITH_CUPTI
#include <cupti.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include <kiln/core/profiler.h>
#include <kiln/cuda/check.h>

namespace kiln::profiler {

namespace {

std::mutex mutex;
std::vector<Event> events;
int64_t offset_ns = 0;  // CUPTI's timestamp at the profiler's zero

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t(8) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::vector<Event> got;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      got.push_back({.name = k->name ? k->name : "kernel", .category = "kernel",
                     .start_ns = int64_t(k->start) - offset_ns, .duration_ns = int64_t(k->end - k->start),
                     .thread = int64_t(k->streamId), .device = int(k->deviceId), .shapes = ""});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      got.push_back({.name = "memcpy " + std::to_string(m->bytes) + " B", .category = "memcpy",
                     .start_ns = int64_t(m->start) - offset_ns, .duration_ns = int64_t(m->end - m->start),
                     .thread = int64_t(m->streamId), .device = int(m->deviceId), .shapes = ""});
    }
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(mutex);
  events.insert(events.end(), got.begin(), got.end());
}

std::string cupti_error(CUptiResult r) {
  const char* s = nullptr;
  cuptiGetResultString(r, &s);
  return s ? s : "unknown CUPTI error";
}

}  // namespace

bool gpu::start(std::string* why_not) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    events.clear();
  }
  CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  if (r == CUPTI_SUCCESS) r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  if (r == CUPTI_SUCCESS) r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  if (r != CUPTI_SUCCESS) {
    *why_not = "CUPTI: " + cupti_error(r);
    return false;
  }
  uint64_t now = 0;
  cuptiGetTimestamp(&now);
  offset_ns = int64_t(now) - detail::now_ns();
  return true;
}

std::vector<Event> gpu::stop() {
  cudaDeviceSynchronize();  // every kernel launched while profiling has run
  cuptiActivityFlushAll(1);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMCPY);
  std::lock_guard<std::mutex> lock(mutex);
  return std::move(events);
}

}  // namespace kiln::profiler
#endif  // KILN_WITH_CUPTI
