#pragma once
// Per-device state shared by the CUDA kernels: the current stream, the caching allocator, library
// handles. Created once per device on first use.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <kiln/core/caching_allocator.h>

namespace kiln::cuda {

// The stream Kiln launches on for the current device (a non-blocking stream made once per device).
cudaStream_t current_stream();
CachingAllocator& allocator(int device);
cublasLtHandle_t cublaslt_handle();  // current device
cudnnHandle_t cudnn_handle();        // current device, bound to current_stream()
// A device workspace for cuBLASLt (32 MiB), reused across calls on the current stream.
void* cublaslt_workspace(size_t* bytes);

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
