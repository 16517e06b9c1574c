// kernels::split_tf32 on the GPU (core/kernels/linalg.h): x into its TF32 part and the f32 remainder, for three
// TF32 products that stand in for one f32 product, or x rounded to TF32 alone (linalg::inverse_root_warm's q for
// qᵀ·(A·q) on TF32). Memory-bound: four floats a thread in 16-byte loads and stores where the tensors allow, one
// at a time otherwise.
#include <algorithm>
#include <cstdint>

#include <kiln/core/kernels/linalg.h>
#include <kiln/core/tensor.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

constexpr int kSplitThreads = 256;

// lo null: x rounded alone (hi may be x: each element is read before it is written, by the same thread)
__global__ void __launch_bounds__(kSplitThreads) split_tf32_vec4_kernel(const float4* x, float4* hi, float4* lo,
                                                                         int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = x[i];
    float4 h, l;
    split_tf32_value(v.x, h.x, l.x);
    split_tf32_value(v.y, h.y, l.y);
    split_tf32_value(v.z, h.z, l.z);
    split_tf32_value(v.w, h.w, l.w);
    hi[i] = h;
    if (lo != nullptr) lo[i] = l;
  }
}

__global__ void __launch_bounds__(kSplitThreads) split_tf32_kernel(const float* x, float* hi, float* lo, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float h, l;
    split_tf32_value(x[i], h, l);
    hi[i] = h;
    if (lo != nullptr) lo[i] = l;
  }
}

}  // namespace

void kernels::split_tf32(const Tensor& x, const Tensor& hi, const Tensor& lo) {
  NvtxRange range("split_tf32");
  check_split_tf32(x, hi, lo);
  const int64_t n = x.numel();
  if (n == 0) return;
  DeviceGuard guard(x.device().index);
  const float* px = static_cast<const float*>(x.raw_data());
  float* ph = static_cast<float*>(hi.raw_data());
  float* pl = lo.defined() ? static_cast<float*>(lo.raw_data()) : nullptr;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  // at most 8 blocks an SM, each thread striding over the rest
  const int64_t sms = int64_t(sm_count()) * 8;
  if (n % 4 == 0 && aligned(px) && aligned(ph) && (pl == nullptr || aligned(pl))) {
    const int64_t n4 = n / 4, blocks = std::min<int64_t>((n4 + kSplitThreads - 1) / kSplitThreads, sms);
    split_tf32_vec4_kernel<<<unsigned(blocks), kSplitThreads, 0, current_stream()>>>(
        reinterpret_cast<const float4*>(px), reinterpret_cast<float4*>(ph), reinterpret_cast<float4*>(pl), n4);
  } else {
    const int64_t blocks = std::min<int64_t>((n + kSplitThreads - 1) / kSplitThreads, sms);
    split_tf32_kernel<<<unsigned(blocks), kSplitThreads, 0, current_stream()>>>(px, ph, pl, n);
  }
  KILN_LAUNCH_CHECK("split_tf32_kernel", "split_tf32");
}

}  // namespace kiln::cuda
