#pragma once
// Passing tensor views to kernels: data pointer plus (collapsed) sizes and strides by value, and the
// offset of the i-th element in row-major order. Adjacent dims that are contiguous with each other are
// merged first, so most views need one or two dims and the index arithmetic stays cheap.
#include <cstdint>

#include <kiln/core/tensor.h>

namespace kiln::cuda {

constexpr int kMaxDims = 10;

struct StridedArg {
  int ndim;
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
};

// t's shape and strides with mergeable dims merged (size-1 dims dropped). Throws beyond kMaxDims.
StridedArg strided_arg(const Tensor& t);

#ifdef __CUDACC__
__host__ __device__ inline int64_t element_offset(const StridedArg& a, int64_t i) {
  int64_t off = 0;
  for (int d = a.ndim - 1; d >= 0; --d) {
    int64_t s = a.sizes[d];
    off += (i % s) * a.strides[d];
    i /= s;
  }
  return off;
}
#endif

}  // namespace kiln::cuda
