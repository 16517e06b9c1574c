#pragma once
// CUDA streams and events, as PyTorch's torch.cuda.Stream / Event / stream(). A plain C++ header (no CUDA
// includes). Kiln launches every kernel, copy and library call on the current stream of the current
// device; each thread has its own current stream per device, initially the device's default stream (a
// non-blocking stream Kiln creates once per device).
//
//   cuda::Stream side = cuda::Stream::create();
//   {
//     cuda::StreamGuard guard(side);        // side becomes current (and its device) for the scope
//     y = matmul(x, w);                       // queued on `side`
//   }
//   cuda::Stream::current().wait(side);      // later work on the default stream waits for y
//   cuda::record_stream(y, cuda::Stream::current());  // see below
//
// Memory and streams: the caching allocator keeps each block on the stream it was allocated on and reuses
// it only for that stream. A tensor allocated on one stream and used by work on another must be
// record_stream'ed with that other stream before it is freed, or its memory may be handed out again while
// that work still reads it; or the allocating stream must wait for the other stream before the free.
//
// Without the CUDA backend every function here throws kiln::Error.
#include <kiln/core/tensor.h>

namespace kiln::cuda {

class Event;

class Stream {
 public:
  Stream() = default;  // no stream: every member but valid() throws
  // The current stream of `device` (-1: the current device) on this thread.
  static Stream current(int device = -1);
  // The default stream of `device` (-1: the current device).
  static Stream default_stream(int device = -1);
  // A new non-blocking stream on `device`; lower priority numbers run first (cudaDeviceGetStreamPriorityRange).
  // Streams are never destroyed (as PyTorch pools them): make a few and keep them.
  static Stream create(int device = -1, int priority = 0);

  bool valid() const { return handle_ != nullptr; }
  int device() const { return device_; }
  void* handle() const { return handle_; }  // the cudaStream_t
  void synchronize() const;                 // waits until all work queued on it is done
  bool query() const;                       // true when all work queued on it is done
  void wait(const Event& event) const;      // work queued on this stream later waits for `event`
  void wait(const Stream& other) const;     // ... for all work queued on `other` so far
  bool operator==(const Stream& o) const { return handle_ == o.handle_; }
  bool operator!=(const Stream& o) const { return handle_ != o.handle_; }

 private:
  Stream(int device, void* handle) : device_(device), handle_(handle) {}
  int device_ = -1;
  void* handle_ = nullptr;
  friend Stream make_stream(int device, void* handle);
};
Stream make_stream(int device, void* handle);  // for cuda/stream.cpp

// Makes `stream` the current stream of its device on this thread, and its device the current device, for
// a scope; restores both after.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_;
  int previous_device_ = 0;
};

// Sets the current stream of the stream's device on this thread (until changed again).
void set_current_stream(const Stream& stream);

class Event {
 public:
  // enable_timing: elapsed_ms works (timing events cost a little more to record).
  explicit Event(bool enable_timing = false) : timing_(enable_timing) {}
  ~Event();
  Event(Event&& o) noexcept;
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Records the event at the current point of `stream` (default: the current stream).
  void record(const Stream& stream = Stream::current());
  bool recorded() const { return handle_ != nullptr; }
  void synchronize() const;  // waits until the recorded work is done
  bool query() const;        // true when it is (or nothing was recorded)
  // Milliseconds from this event to `end` (both recorded with enable_timing, `end` completed).
  double elapsed_ms(const Event& end) const;
  void* handle() const { return handle_; }  // the cudaEvent_t

 private:
  bool timing_;
  int device_ = -1;
  void* handle_ = nullptr;
};

// Tells the caching allocator that work queued on `stream` uses t's memory: when t's storage is freed, the
// memory is not reused until that work is done (PyTorch's Tensor.record_stream). t must be a CUDA tensor.
void record_stream(const Tensor& t, const Stream& stream);

}  // namespace kiln::cuda
