// The linalg kernels on the GPU (core/kernels/linalg.h): cuSOLVER's symmetric eigensolvers on the current
// stream. f32 (Shampoo's factors): the batched solver, one call for the whole batch (cusolverDnXsyevBatched),
// for speed. f64: divide and conquer a matrix at a time (cusolverDnXsyevd), LAPACK's algorithm, for callers
// who ask f64 for accuracy (both passed tests/cuda/linalg_test.cpp against Eigen on an H200).
#include <cusolverDn.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <kiln/core/kernels/linalg.h>
#include <kiln/core/tensor.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/graph.h>

namespace kiln::cuda {

namespace {

#define KILN_CUSOLVER_CHECK(call)                                                                         \
  do {                                                                                                    \
    cusolverStatus_t kiln_st_ = (call);                                                                   \
    if (kiln_st_ != CUSOLVER_STATUS_SUCCESS)                                                              \
      ::kiln::cuda::detail::fail("cuSOLVER", ("status " + std::to_string(int(kiln_st_))).c_str(), #call, \
                                 __FILE__, __LINE__);                                                     \
  } while (0)

// One cuSOLVER handle and parameter set per device, made on first use and kept (as the cuBLASLt handle).
struct Solver {
  cusolverDnHandle_t handle = nullptr;
  cusolverDnParams_t params = nullptr;
};

Solver& solver(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, Solver> solvers;
  std::lock_guard<std::mutex> lock(mutex);
  Solver& s = solvers[device];
  if (!s.handle) {
    KILN_CUSOLVER_CHECK(cusolverDnCreate(&s.handle));
    KILN_CUSOLVER_CHECK(cusolverDnCreateParams(&s.params));
  }
  return s;
}

}  // namespace

// cuSOLVER is column-major: it reads the row-major lower triangle as its upper one, and writes each
// eigenvector as a column of its layout, which is a row of ours.
void kernels::eigh(const Tensor& a, const Tensor& w, const Tensor& v, const Tensor& info) {
  const int device = a.device().index;
  DeviceGuard guard(device);
  const int64_t n = a.size(-1), batch = a.numel() / std::max<int64_t>(n * n, 1);
  if (batch == 0 || n == 0) return;
  KILN_CUDA_CHECK(cudaMemcpyAsync(v.raw_data(), a.raw_data(), size_t(a.numel()) * element_size(a.dtype()),
                                  cudaMemcpyDeviceToDevice, current_stream()));
  const cudaDataType type = a.dtype() == DType::f64 ? CUDA_R_64F : CUDA_R_32F;
  Solver& s = solver(device);
  KILN_CUSOLVER_CHECK(cusolverDnSetStream(s.handle, current_stream()));
  size_t device_bytes = 0, host_bytes = 0;
  CachingAllocator& alloc = allocator(device);
  const uintptr_t stream = uintptr_t(current_stream());
  if (a.dtype() == DType::f64) {
    KILN_CUSOLVER_CHECK(cusolverDnXsyevd_bufferSize(s.handle, s.params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER,
                                                    n, type, v.raw_data(), n, type, w.raw_data(), type, &device_bytes,
                                                    &host_bytes));
    void* work = device_bytes ? alloc.allocate(device_bytes, stream) : nullptr;
    std::vector<char> host(host_bytes);
    for (int64_t b = 0; b < batch; ++b) {
      auto* vb = static_cast<double*>(v.raw_data()) + b * n * n;
      auto* wb = static_cast<double*>(w.raw_data()) + b * n;
      KILN_CUSOLVER_CHECK(cusolverDnXsyevd(s.handle, s.params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, type,
                                           vb, n, type, wb, type, work, device_bytes, host.data(), host_bytes,
                                           static_cast<int*>(info.raw_data()) + b));
      // the host workspace may be read while the call runs: the next matrix reuses it only after
      if (host_bytes) {
        check_not_capturing("eigh (cuSOLVER with a host workspace)");
        KILN_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
      }
    }
    if (work) alloc.free(work);
    return;
  }
  KILN_CUSOLVER_CHECK(cusolverDnXsyevBatched_bufferSize(s.handle, s.params, CUSOLVER_EIG_MODE_VECTOR,
                                                        CUBLAS_FILL_MODE_UPPER, n, type, v.raw_data(), n, type,
                                                        w.raw_data(), type, &device_bytes, &host_bytes, batch));
  void* work = device_bytes ? alloc.allocate(device_bytes, stream) : nullptr;
  std::vector<char> host(host_bytes);
  KILN_CUSOLVER_CHECK(cusolverDnXsyevBatched(s.handle, s.params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n,
                                             type, v.raw_data(), n, type, w.raw_data(), type, work, device_bytes,
                                             host.data(), host_bytes, static_cast<int*>(info.raw_data()), batch));
  // cuSOLVER may read the host workspace while the call runs on the stream: keep it until then
  if (host_bytes) {
    check_not_capturing("eigh (cuSOLVER with a host workspace)");
    KILN_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
  }
  if (work) alloc.free(work);  // stream-ordered: the block is reused only by later work on this stream
}

}  // namespace kiln::cuda
