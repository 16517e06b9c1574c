#pragma once
// Return-code checks for CUDA, cuBLAS(Lt) and cuDNN calls, and the check after every kernel launch.
// Each failure is a kiln::Error naming the call, the file and the line.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <kiln/core/error.h>

namespace kiln::cuda::detail {
[[noreturn]] void fail(const char* library, const char* error, const char* call, const char* file, int line);
// cudaGetLastError, and under sync-check a synchronize that names the kernel and op on failure.
void after_launch(const char* kernel, const char* op, const char* file, int line);
}  // namespace kiln::cuda::detail

#define KILN_CUDA_CHECK(call)                                                                           \
  do {                                                                                                  \
    cudaError_t kiln_err_ = (call);                                                                     \
    if (kiln_err_ != cudaSuccess)                                                                       \
      ::kiln::cuda::detail::fail("CUDA", cudaGetErrorString(kiln_err_), #call, __FILE__, __LINE__);     \
  } while (0)
#define KILN_CUBLAS_CHECK(call)                                                                         \
  do {                                                                                                  \
    cublasStatus_t kiln_st_ = (call);                                                                   \
    if (kiln_st_ != CUBLAS_STATUS_SUCCESS)                                                              \
      ::kiln::cuda::detail::fail("cuBLAS", cublasLtGetStatusString(kiln_st_), #call, __FILE__, __LINE__); \
  } while (0)
#define KILN_CUDNN_CHECK(call)                                                                          \
  do {                                                                                                  \
    cudnnStatus_t kiln_st_ = (call);                                                                    \
    if (kiln_st_ != CUDNN_STATUS_SUCCESS)                                                               \
      ::kiln::cuda::detail::fail("cuDNN", cudnnGetErrorString(kiln_st_), #call, __FILE__, __LINE__);    \
  } while (0)
// For cudaEventQuery / cudaStreamQuery: true when the work is done, false while it is not (clearing the
// "not ready" status, which is no error), a kiln::Error naming the call otherwise.
#define KILN_CUDA_QUERY(call)                                                                           \
  [&] {                                                                                                 \
    cudaError_t kiln_err_ = (call);                                                                     \
    if (kiln_err_ == cudaErrorNotReady) {                                                               \
      cudaGetLastError();                                                                               \
      return false;                                                                                     \
    }                                                                                                   \
    if (kiln_err_ != cudaSuccess)                                                                       \
      ::kiln::cuda::detail::fail("CUDA", cudaGetErrorString(kiln_err_), #call, __FILE__, __LINE__);     \
    return true;                                                                                        \
  }()
// Use right after `kernel<<<...>>>(...)`: KILN_LAUNCH_CHECK("softmax_rows", "softmax").
#define KILN_LAUNCH_CHECK(kernel, op) ::kiln::cuda::detail::after_launch(kernel, op, __FILE__, __LINE__)
