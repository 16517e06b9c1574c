#include <cuda_runtime.h>

#include <kiln/cuda/runtime.h>

namespace kiln::cuda {

int device_count() {
  int n = 0;
  // No driver or no device is not an error for discovery: it means zero devices.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error state
    return 0;
  }
  return n;
}

bool is_available() { return device_count() > 0; }

}  // namespace kiln::cuda
