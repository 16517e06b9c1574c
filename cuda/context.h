#pragma once
// Per-device state shared by the CUDA kernels: the current stream, the caching allocator, library
// handles. Created once per device on first use.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <kiln/core/caching_allocator.h>

namespace kiln::cuda {

// The stream Kiln launches on: this thread's current stream of the current device (cuda/stream.h), the
// device's default stream (a non-blocking stream made once per device) unless a StreamGuard set another.
cudaStream_t current_stream();
cudaStream_t current_stream(int device);
cudaStream_t default_stream(int device);
void set_current_stream(int device, cudaStream_t stream);  // nullptr: back to the default stream
CachingAllocator& allocator(int device);
cublasLtHandle_t cublaslt_handle();  // current device
cudnnHandle_t cudnn_handle();        // current device, bound to current_stream() at each call
// A device workspace for cuBLASLt (32 MiB) of the current stream, reused across calls on it.
void* cublaslt_workspace(size_t* bytes);

// The deferred device error: kernels that meet bad input (a target or index out of range) record the
// first such problem here instead of forcing a host synchronization after every launch. The host reads it
// only where it already synchronizes (device-to-host copies, cuda::synchronize(), and after every launch
// under KILN_SYNC_CHECK=1) and turns it into a kiln::Error naming the op, then clears it.
enum class DeviceErrorCode : int {
  none = 0,
  cross_entropy_target = 1,  // value: the target, bound: the number of classes
  index_select = 2,          // value: the index, bound: the size of the indexed dim
  gather = 3,
  index_add = 4,
  scatter_add = 5,
};
struct DeviceError {
  int code;  // DeviceErrorCode; set once (atomicCAS from 0: the first problem wins)
  int pad;
  long long value, bound;
};
// The current device's error word in device memory (zeroed at creation and after each report).
DeviceError* device_error_word();
// Under sync-check and at synchronization points: enqueue a copy of the word to pinned host memory on the
// current stream (before the synchronization), then, once synchronized, check_device_error() throws
// kiln::Error when a kernel set it (and clears it on the device).
void stage_device_error();
void check_device_error();

// Launch geometry for a grid-stride loop over n items.
inline unsigned blocks_for(int64_t n, int threads = 256, int64_t max_blocks = 65535LL * 8) {
  int64_t b = (n + threads - 1) / threads;
  return unsigned(b < 1 ? 1 : (b > max_blocks ? max_blocks : b));
}

}  // namespace kiln::cuda

namespace kiln::cuda {

// Makes `device` current for a scope (kernels launch on the current device's stream).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (device != prev_) cudaSetDevice(device);
    changed_ = device != prev_;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

}  // namespace kiln::cuda
