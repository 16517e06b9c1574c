// Streams, events and record_stream (cuda/stream.h) over the runtime's per-thread current streams
// (cuda/context.h).
#include <kiln/cuda/stream.h>

#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>

namespace kiln::cuda {

namespace {

int resolve(int device) {
  const int d = device < 0 ? current_device() : device;
  KILN_CHECK(d < device_count(), "cuda::Stream: device ", d, " does not exist (", device_count(), " CUDA devices)");
  return d;
}

cudaStream_t raw(const Stream& s, const char* what) {
  KILN_CHECK(s.valid(), what, ": no stream (a default-constructed cuda::Stream)");
  return static_cast<cudaStream_t>(s.handle());
}

}  // namespace

Stream make_stream(int device, void* handle) { return Stream(device, handle); }

Stream Stream::current(int device) {
  const int d = resolve(device);
  return make_stream(d, current_stream(d));
}

Stream Stream::default_stream(int device) {
  const int d = resolve(device);
  return make_stream(d, cuda::default_stream(d));
}

Stream Stream::create(int device, int priority) {
  const int d = resolve(device);
  DeviceGuard guard(d);
  int least = 0, greatest = 0;
  KILN_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  KILN_CHECK(priority <= least && priority >= greatest, "cuda::Stream::create: priority ", priority,
             " is outside this device's range [", greatest, ", ", least, "]");
  cudaStream_t s = nullptr;
  KILN_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  return make_stream(d, s);
}

void Stream::synchronize() const {
  check_not_capturing("Stream::synchronize");
  KILN_CUDA_CHECK(cudaStreamSynchronize(raw(*this, "Stream::synchronize"))); }

bool Stream::query() const { return KILN_CUDA_QUERY(cudaStreamQuery(raw(*this, "Stream::query"))); }

void Stream::wait(const Event& event) const {
  cudaStream_t s = raw(*this, "Stream::wait");
  if (!event.recorded()) return;  // nothing to wait for, as in PyTorch
  KILN_CUDA_CHECK(cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(event.handle()), 0));
}

void Stream::wait(const Stream& other) const {
  if (other == *this) return;
  Event e;
  e.record(other);
  wait(e);
}

void set_current_stream(const Stream& stream) {
  raw(stream, "set_current_stream");
  cuda::set_current_stream(stream.device(), static_cast<cudaStream_t>(stream.handle()));
}

StreamGuard::StreamGuard(const Stream& stream) : previous_device_(current_device()) {
  raw(stream, "StreamGuard");
  previous_ = Stream::current(stream.device());
  if (stream.device() != previous_device_) set_device(stream.device());
  set_current_stream(stream);
}

StreamGuard::~StreamGuard() {
  cuda::set_current_stream(previous_.device(), static_cast<cudaStream_t>(previous_.handle()));
  if (previous_device_ != previous_.device()) cudaSetDevice(previous_device_);
}

Event::~Event() {
  if (handle_) cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
}

Event::Event(Event&& o) noexcept : timing_(o.timing_), device_(o.device_), handle_(o.handle_) { o.handle_ = nullptr; }

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (handle_) cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
    timing_ = o.timing_;
    device_ = o.device_;
    handle_ = o.handle_;
    o.handle_ = nullptr;
  }
  return *this;
}

void Event::record(const Stream& stream) {
  cudaStream_t s = raw(stream, "Event::record");
  KILN_CHECK(!handle_ || device_ == stream.device(), "Event::record: the event belongs to cuda:", device_,
             ", the stream to cuda:", stream.device());
  if (!handle_) {
    DeviceGuard guard(stream.device());
    cudaEvent_t e = nullptr;
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing_ ? cudaEventDefault : cudaEventDisableTiming));
    handle_ = e;
    device_ = stream.device();
  }
  KILN_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), s));
}

void Event::synchronize() const {
  check_not_capturing("Event::synchronize");
  if (handle_) KILN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
}

bool Event::query() const { return !handle_ || KILN_CUDA_QUERY(cudaEventQuery(static_cast<cudaEvent_t>(handle_))); }

double Event::elapsed_ms(const Event& end) const {
  KILN_CHECK(timing_ && end.timing_, "Event::elapsed_ms: both events need enable_timing");
  KILN_CHECK(handle_ && end.handle_, "Event::elapsed_ms: both events must be recorded");
  float ms = 0;
  KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(handle_), static_cast<cudaEvent_t>(end.handle_)));
  return double(ms);
}

void record_stream(const Tensor& t, const Stream& stream) {
  KILN_CHECK(t.defined() && t.device().is_cuda(), "record_stream: expected a CUDA tensor, got ",
             t.defined() ? t.str() : "an undefined tensor");
  raw(stream, "record_stream");
  KILN_CHECK(stream.device() == t.device().index, "record_stream: ", t.str(), " is on ", t.device().str(),
             ", the stream on cuda:", stream.device());
  void* base = t.impl().storage->data;
  if (!base) return;  // an empty tensor owns no memory
  allocator(t.device().index).record_stream(base, uintptr_t(static_cast<cudaStream_t>(stream.handle())));
}

}  // namespace kiln::cuda
