// kernels::split_f16 on the GPU (core/kernels/linalg.h): the f16 split of f32 operands for the three f16
// products that stand in for one f32 product (linalg::inverse_root_warm's A·q). Memory-bound: a grid column
// (blockIdx.x) a matrix, so that its scale is read once a thread; four elements a thread in 16-byte loads (8-byte f16
// stores) where the shapes and addresses allow, one at a time otherwise.
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

constexpr int kThreads = 256;

struct F16Out {  // an output view: element (b, i, j) at base + b·matrix_stride + i·row_stride + j
  uint16_t* base;
  int64_t matrix_stride, row_stride;
  __device__ uint16_t* at(int64_t b, int64_t i) const { return base + b * matrix_stride + i * row_stride; }
};

// VEC = 4: c % 4 == 0, x 16-byte aligned, every output row 8-byte aligned; lo.base or hi_again.base null: not
// written
template <int VEC>
__global__ void __launch_bounds__(kThreads) split_f16_kernel(const float* __restrict__ x, const float* __restrict__ bounds,
                                                             float* __restrict__ scales, int64_t r, int64_t c,
                                                             F16Out hi, F16Out lo, F16Out hi_again) {
  const int64_t b = blockIdx.x;
  const float s = split_f16_scale(bounds[b]);
  if (blockIdx.y == 0 && threadIdx.x == 0) scales[b] = s;
  const float* xb = x + b * r * c;
  const uint32_t groups = uint32_t(r * c / VEC), cols = uint32_t(c);  // a matrix's indices fit 32 bits (checked)
  for (uint32_t g = blockIdx.y * blockDim.x + threadIdx.x; g < groups; g += gridDim.y * blockDim.x) {
    const uint32_t e = g * VEC, i = e / cols, j = e % cols;
    if constexpr (VEC == 4) {
      const float4 v = *reinterpret_cast<const float4*>(xb + e);
      ushort4 h, l;
      split_f16_value(v.x, s, h.x, l.x);
      split_f16_value(v.y, s, h.y, l.y);
      split_f16_value(v.z, s, h.z, l.z);
      split_f16_value(v.w, s, h.w, l.w);
      *reinterpret_cast<ushort4*>(hi.at(b, i) + j) = h;
      if (lo.base != nullptr) *reinterpret_cast<ushort4*>(lo.at(b, i) + j) = l;
      if (hi_again.base != nullptr) *reinterpret_cast<ushort4*>(hi_again.at(b, i) + j) = h;
    } else {
      uint16_t h, l;
      split_f16_value(xb[e], s, h, l);
      hi.at(b, i)[j] = h;
      if (lo.base != nullptr) lo.at(b, i)[j] = l;
      if (hi_again.base != nullptr) hi_again.at(b, i)[j] = h;
    }
  }
}

// (matrices, blocks along a matrix): about 8 blocks an SM in all, at least one a matrix
dim3 grid_for(int64_t batch, int64_t per_matrix_threads) {
  KILN_CHECK(batch <= int64_t(INT32_MAX), "split_f16: ", batch, " matrices, more than a grid holds");
  const int64_t want = std::max<int64_t>(int64_t(sm_count()) * 8 / std::max<int64_t>(batch, 1), 1);
  const int64_t along = std::min<int64_t>((per_matrix_threads + kThreads - 1) / kThreads, want);
  return dim3(unsigned(batch), unsigned(std::max<int64_t>(along, 1)));
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void kernels::split_f16(const Tensor& x, const Tensor& bounds, const Tensor& scales, const Tensor& hi,
                        const Tensor& lo, const Tensor& hi_again) {
  NvtxRange range("split_f16");
  check_split_f16(x, bounds, scales, hi, lo, hi_again);
  const int64_t batch = x.size(0), r = x.size(1), c = x.size(2);
  if (batch == 0) return;  // (empty matrices: one block a matrix still writes its scale)
  KILN_CHECK(r * c <= int64_t(INT32_MAX), "split_f16: matrices of ", r, " x ", c, " elements, more than 2^31 - 1");
  DeviceGuard guard(x.device().index);
  auto out = [](const Tensor& t) {
    return F16Out{t.defined() ? static_cast<uint16_t*>(t.raw_data()) : nullptr, t.defined() ? t.stride(0) : 0,
                  t.defined() ? t.stride(1) : 0};
  };
  const F16Out h = out(hi), l = out(lo), again = out(hi_again);
  // 8-byte stores: every row of every output starts 8-byte aligned
  auto rows_aligned = [&](const F16Out& o) {
    return o.base == nullptr || (aligned(o.base, 8) && o.matrix_stride % 4 == 0 && o.row_stride % 4 == 0);
  };
  const float* px = static_cast<const float*>(x.raw_data());
  const float* pb = static_cast<const float*>(bounds.raw_data());
  float* ps = static_cast<float*>(scales.raw_data());
  if (c % 4 == 0 && aligned(px, 16) && rows_aligned(h) && rows_aligned(l) && rows_aligned(again)) {
    split_f16_kernel<4><<<grid_for(batch, r * c / 4), kThreads, 0, current_stream()>>>(px, pb, ps, r, c, h, l,
                                                                                       again);
  } else {
    split_f16_kernel<1><<<grid_for(batch, r * c), kThreads, 0, current_stream()>>>(px, pb, ps, r, c, h, l, again);
  }
  KILN_LAUNCH_CHECK("split_f16_kernel", "split_f16");
}

}  // namespace kiln::cuda
