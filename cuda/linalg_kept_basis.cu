// kernels::kept_basis_expansion on the GPU (core/kernels/linalg.h; the linalg family's solvers are
// cuda/linalg.cpp): one read of B and one write of the middle matrix, where the expansion composed from
// general ops made ~20 passes over the factors (GPT-2 124M's 342 blocks are 1 GiB of f32).
//
// A warp a row of B, in 16-byte units where the rows allow; the row's coupling summed in f64 along a fixed
// order (lane-strided, then the warp's butterfly), so the result is the same every run.
#include <cmath>
#include <cstdint>

#include <kiln/core/kernels/linalg.h>
#include <kiln/core/tensor.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

constexpr int kExpansionThreads = 256;  // 8 rows a block

// Row `row` (matrix k = row / n, i = row % n), element j: the middle's entry, and B_ij²/(φ_i·φ_j) off the
// diagonal added to `sum`.
template <class T>
__device__ __forceinline__ T expansion_entry(T bij, int64_t i, int64_t j, T phi_i, T f_i, const T* phi_k,
                                            const T* f_k, T diagonal, T near, T exponent, double& sum) {
  if (j == i) return diagonal;
  const T phi_j = phi_k[j], gap = phi_i - phi_j, mean = T(0.5) * (phi_i + phi_j);
  // f'(mean) = −(1/p)·mean^(−1/p − 1) where the difference would cancel; exponent = −1/p
  const T divided = fabs(gap) <= near * mean ? exponent * pow(mean, exponent - T(1)) : (f_i - f_k[j]) / gap;
  const double scaled = double(bij) * double(bij) / (double(phi_i) * double(phi_j));
  sum += scaled;
  return divided * bij;
}

template <class T>
__global__ void __launch_bounds__(kExpansionThreads) kept_basis_expansion_kernel(
    const T* __restrict__ b, const T* __restrict__ phi, const T* __restrict__ f, const T* __restrict__ d,
    int64_t rows, int64_t n, T exponent, bool vec, T* __restrict__ m, T* __restrict__ coupling) {
  constexpr int kPer = 16 / int(sizeof(T));
  struct alignas(16) Unit {
    T v[kPer];
  };
  const int64_t row = int64_t(blockIdx.x) * (kExpansionThreads / 32) + int64_t(threadIdx.x >> 5);
  const int lane = int(threadIdx.x) & 31;
  if (row >= rows) return;  // a whole warp: the butterfly below is within the warp
  const int64_t k = row / n, i = row % n;
  const T* phi_k = phi + k * n;
  const T* f_k = f + k * n;
  const T phi_i = phi_k[i], f_i = f_k[i], diagonal = d[row];
  const T near = sizeof(T) == 8 ? T(1e-5) : T(1e-2);
  const T* b_row = b + row * n;
  T* m_row = m + row * n;
  double sum = 0;
  if (vec) {
    const Unit* in = reinterpret_cast<const Unit*>(b_row);
    Unit* out = reinterpret_cast<Unit*>(m_row);
    for (int64_t u = lane; u < n / kPer; u += 32) {
      const Unit x = in[u];
      Unit y;
#pragma unroll
      for (int e = 0; e < kPer; ++e)
        y.v[e] = expansion_entry(x.v[e], i, u * kPer + e, phi_i, f_i, phi_k, f_k, diagonal, near, exponent, sum);
      out[u] = y;
    }
  } else {
    for (int64_t j = lane; j < n; j += 32)
      m_row[j] = expansion_entry(b_row[j], i, j, phi_i, f_i, phi_k, f_k, diagonal, near, exponent, sum);
  }
  sum = warp_allreduce(sum, SumOp{});
  if (lane == 0) coupling[row] = T(sum);
}

template <class T>
void launch_expansion(const Tensor& coupled, const Tensor& floored, const Tensor& floored_roots,
                      const Tensor& diagonal_roots, double p, const Tensor& middle, const Tensor& coupling) {
  const int64_t n = coupled.size(-1), rows = coupled.numel() / n;
  const int64_t per = 16 / int64_t(sizeof(T));
  // rows of whole 16-byte units (the allocator's blocks start 16-byte aligned)
  const bool vec = n % per == 0 && reinterpret_cast<uintptr_t>(coupled.raw_data()) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(middle.raw_data()) % 16 == 0;
  const int64_t blocks = (rows + kExpansionThreads / 32 - 1) / (kExpansionThreads / 32);
  kept_basis_expansion_kernel<T><<<unsigned(blocks), kExpansionThreads, 0, current_stream()>>>(
      static_cast<const T*>(coupled.raw_data()), static_cast<const T*>(floored.raw_data()),
      static_cast<const T*>(floored_roots.raw_data()), static_cast<const T*>(diagonal_roots.raw_data()), rows, n,
      T(-1.0 / p), vec, static_cast<T*>(middle.raw_data()), static_cast<T*>(coupling.raw_data()));
  KILN_LAUNCH_CHECK("kept_basis_expansion_kernel", "kept_basis_expansion");
}

}  // namespace

void kernels::kept_basis_expansion(const Tensor& coupled, const Tensor& floored, const Tensor& floored_roots,
                                   const Tensor& diagonal_roots, double p, const Tensor& middle,
                                   const Tensor& coupling) {
  NvtxRange range("kept_basis_expansion");
  check_kept_basis_expansion(coupled, floored, floored_roots, diagonal_roots, middle, coupling);
  if (coupled.numel() == 0) return;
  DeviceGuard guard(coupled.device().index);
  if (coupled.dtype() == DType::f64)
    launch_expansion<double>(coupled, floored, floored_roots, diagonal_roots, p, middle, coupling);
  else
    launch_expansion<float>(coupled, floored, floored_roots, diagonal_roots, p, middle, coupling);
}

}  // namespace kiln::cuda
