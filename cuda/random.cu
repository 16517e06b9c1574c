// Random fills on the device, bit for bit the CPU's (core/cpu/random.cpp):
//   uniform: element e = a + (b - a) · u, u = top 24 bits of word e % 4 of Philox block offset + e / 4,
//            in double, then moved to the largest value of the dtype below b if rounding would reach b;
//   normal:  element e from block offset + e / 2, words (2 (e % 2), 2 (e % 2) + 1) = (w1, w2):
//            u1 = (w1 >> 8 + 1) / 2^24 in (0, 1], u2 = (w2 >> 8) / 2^24,
//            a + b · sqrt(-2 ln u1) · cos(2π u2) in double (Box-Muller).
// Uniform values are identical to the CPU's: the arithmetic is exact IEEE double with products and sums
// rounded separately (__dmul_rn/__dadd_rn: no FMA contraction, which the CPU build does not do either).
// Normal values can differ in the last place of the double, where CUDA's log and cos (1-2 ulp) differ
// from glibc's: after rounding into f32/f16/bf16 that is at most 1 ulp of the dtype, and rarely that.
// One thread per Philox block (4 uniform or 2 normal outputs). Bytes moved: n · element size, written.
// Under CUDA graph capture the seed and a base offset come from device memory at run time (PhiloxDraw).
#include <cmath>

#include <kiln/core/half.h>
#include <kiln/core/kernels/random.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/philox.cuh>

namespace kiln::cuda {

namespace {

// The value v takes once stored as D (the CPU's `rounded`).
template <class D>
__device__ __forceinline__ double rounded(double v) {
  if constexpr (std::is_same_v<D, double>) return v;
  else if constexpr (std::is_same_v<D, float>) return double(__double2float_rn(v));
  else if constexpr (std::is_same_v<D, __half>) return double(__half2float(__float2half_rn(__double2float_rn(v))));
  else return double(__bfloat162float(__float2bfloat16_rn(__double2float_rn(v))));
}

template <class D>
__device__ __forceinline__ D store_value(double v) {
  if constexpr (std::is_same_v<D, double>) return v;
  else if constexpr (std::is_same_v<D, float>) return __double2float_rn(v);
  else if constexpr (std::is_same_v<D, __half>) return __float2half_rn(__double2float_rn(v));
  else return __float2bfloat16_rn(__double2float_rn(v));
}

// uniform: a + diff · u, values that would round to b replaced by top (clamp_top: b > a).
template <class D>
__global__ void uniform_kernel(D* out, int64_t n, double a, double b, double diff, double top, bool clamp_top,
                               uint64_t seed, uint64_t offset, const uint64_t* replay_base) {
  if (replay_base) {
    seed = replay_base[0];
    offset += replay_base[1];
  }
  const int64_t blocks = (n + 3) / 4;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < blocks; j += int64_t(gridDim.x) * blockDim.x) {
    uint4 w = philox4x32(offset + uint64_t(j), seed);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      int64_t e = 4 * j + k;
      if (e >= n) break;
      // uint_to_unit_float: exact in float, hence in double
      double u = double(float(philox_word(w, k) >> 8) * (1.0f / 16777216.0f));
      double v = __dadd_rn(a, __dmul_rn(diff, u));
      if (clamp_top && rounded<D>(v) >= b) v = top;
      out[e] = store_value<D>(v);
    }
  }
}

template <class D>
__global__ void normal_kernel(D* out, int64_t n, double mean, double stddev, uint64_t seed, uint64_t offset,
                              const uint64_t* replay_base) {
  if (replay_base) {
    seed = replay_base[0];
    offset += replay_base[1];
  }
  const int64_t blocks = (n + 1) / 2;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < blocks; j += int64_t(gridDim.x) * blockDim.x) {
    uint4 w = philox4x32(offset + uint64_t(j), seed);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      int64_t e = 2 * j + k;
      if (e >= n) break;
      uint32_t w1 = philox_word(w, 2 * k), w2 = philox_word(w, 2 * k + 1);
      double u1 = (double(w1 >> 8) + 1.0) * (1.0 / 16777216.0);  // exact
      double u2 = double(w2 >> 8) * (1.0 / 16777216.0);          // exact
      double r = sqrt(-2.0 * log(u1));
      double c = cos(__dmul_rn(6.283185307179586, u2));
      out[e] = store_value<D>(__dadd_rn(mean, __dmul_rn(__dmul_rn(stddev, r), c)));
    }
  }
}

}  // namespace

void kernels::random(const Tensor& out, Distribution dist, double a, double b, const PhiloxDraw& draw) {
  NvtxRange range("random");
  KILN_CHECK(out.device().is_cuda(), "random: expected a CUDA tensor, got ", out.str());
  KILN_CHECK(out.is_contiguous(), "random: output ", out.str(), " must be contiguous");
  int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(out.device().index);
  const bool clamp_top = dist == Distribution::uniform && b > a;
  const double top = clamp_top ? largest_below(out.dtype(), b) : b;
  KILN_CUDA_DISPATCH_FLOATING(out.dtype(), "random", {
    using D = device_t<scalar_t>;
    D* p = static_cast<D*>(out.raw_data());
    if (dist == Distribution::uniform) {
      uniform_kernel<D><<<blocks_for((n + 3) / 4), 256, 0, current_stream()>>>(p, n, a, b, b - a, top, clamp_top, draw.seed,
                                                                                draw.offset, draw.replay_base);
      KILN_LAUNCH_CHECK("uniform_kernel", "random");
    } else {
      normal_kernel<D><<<blocks_for((n + 1) / 2), 256, 0, current_stream()>>>(p, n, a, b, draw.seed, draw.offset,
                                                                            draw.replay_base);
      KILN_LAUNCH_CHECK("normal_kernel", "random");
    }
  });
}

}  // namespace kiln::cuda
