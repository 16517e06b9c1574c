// kernels::kept_basis_expansion on the GPU (core/kernels/linalg.h; the linalg family's solvers are
// cuda/linalg.cpp): one read of B and one write of the middle matrix, where the expansion composed from
// general ops made ~20 passes over the factors (GPT-2 124M's 342 blocks are 1 GiB of f32).
//
// A block takes a pair of 32 x 32 tiles at a time, (I, J) and its mirror (J, I) (I >= J), both staged in shared
// memory: each entry pair (i, j), (j, i) takes the one of the two that B's pick names (the column of the smaller
// φ), and both halves of the middle are written from it, rows coalesced. Each row's coupling is summed along a
// fixed order (a tile's 32 terms by the warp's butterfly in B's dtype into one f64 partial a row and column
// tile, then the partials in tile order in f64 by a second kernel), so the result is the same every run.
#include <algorithm>
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

constexpr int kTile = 32;
constexpr int kTileRows = 8;  // a warp a row of the tile, each warp 4 rows
constexpr int kExpansionThreads = kTile * kTileRows;

// Row i, column j (i != j) of matrix k: the middle's entry F_ij·B_ij, and B_ij²/(φ_i·φ_j) added to `sum`,
// as (B_ij·φ_i^(−1/2)·φ_j^(−1/2))² in B's dtype (rs_i, rs_j the staged φ^(−1/2)): a few ulps of each term, where
// the f64 conversions and division had made the kernel compute-bound (2.2 ms for GPT-2's 342 blocks on an H200,
// ~4x its bytes' time). F_ij is F_ji bit for bit: the gap's sign flips exactly, and the quotient with it.
template <class T>
__device__ __forceinline__ T expansion_entry(T bij, T phi_i, T f_i, T rs_i, T phi_j, T f_j, T rs_j, T near,
                                            T exponent, T& sum) {
  const T gap = phi_i - phi_j, mean = T(0.5) * (phi_i + phi_j);
  // f'(mean) = −(1/p)·mean^(−1/p − 1) where the difference would cancel; exponent = −1/p
  const T divided = fabs(gap) <= near * mean ? exponent * pow(mean, exponent - T(1)) : (f_i - f_j) / gap;
  const T whitened = bij * rs_i * rs_j;
  sum += whitened * whitened;
  return divided * bij;
}

// Blocks stride over (matrix k, tile pair (I, J)); partial (batch, tiles, n): row r's coupling over column
// tile t at [k][t][r], a tile row's 32 terms summed by the warp's butterfly in B's dtype, stored in f64.
template <class T>
__global__ void __launch_bounds__(kExpansionThreads) kept_basis_expansion_kernel(
    const T* __restrict__ b, const T* __restrict__ phi, const T* __restrict__ f, const T* __restrict__ d, int64_t n,
    int64_t tiles, int64_t pairs, int64_t batch, T exponent, T* __restrict__ m, double* __restrict__ partial) {
  __shared__ T c_ij[kTile][kTile + 1], c_ji[kTile][kTile + 1], picked[kTile][kTile + 1];
  __shared__ T phi_s[2][kTile], f_s[2][kTile], rs_s[2][kTile];
  const int tx = int(threadIdx.x) % kTile, ty = int(threadIdx.x) / kTile;
  const T near = sizeof(T) == 8 ? T(1e-5) : T(1e-2);
  for (int64_t block = blockIdx.x; block < batch * pairs; block += gridDim.x) {
    const int64_t k = block / pairs, pair = block % pairs;
    // pair = I·(I+1)/2 + J, 0 <= J <= I
    int64_t I = int64_t((sqrt(8.0 * double(pair) + 1.0) - 1.0) / 2.0);
    while (I * (I + 1) / 2 > pair) --I;
    while ((I + 1) * (I + 2) / 2 <= pair) ++I;
    const int64_t J = pair - I * (I + 1) / 2;
    const int64_t i0 = I * kTile, j0 = J * kTile;
    const T* b_k = b + k * n * n;
    for (int r = ty; r < kTile; r += kTileRows) {
      c_ij[r][tx] = i0 + r < n && j0 + tx < n ? b_k[(i0 + r) * n + j0 + tx] : T(0);
      c_ji[r][tx] = j0 + r < n && i0 + tx < n ? b_k[(j0 + r) * n + i0 + tx] : T(0);
    }
    if (threadIdx.x < 2 * kTile) {
      const int side = int(threadIdx.x) / kTile;  // 0: I's rows, 1: J's
      const int64_t at = (side == 0 ? i0 : j0) + tx;
      const T phi_at = at < n ? phi[k * n + at] : T(1);
      phi_s[side][tx] = phi_at;
      f_s[side][tx] = at < n ? f[k * n + at] : T(1);
      rs_s[side][tx] = T(1) / sqrt(phi_at);
    }
    __syncthreads();
    // I's rows against J's columns: the pick, then the entry
    for (int r = ty; r < kTile; r += kTileRows) {
      const int64_t i = i0 + r, j = j0 + tx;
      T sum = 0;
      if (i < n && j < n) {
        T value;
        if (i == j) {
          value = d[k * n + i];
        } else {
          const T phi_i = phi_s[0][r], phi_j = phi_s[1][tx];
          const bool row_i = phi_i > phi_j || (phi_i == phi_j && i > j);  // the pair's entry at (r, c): core/kernels
          const T bij = row_i ? c_ij[r][tx] : c_ji[tx][r];
          picked[r][tx] = bij;
          value = expansion_entry(bij, phi_i, f_s[0][r], rs_s[0][r], phi_j, f_s[1][tx], rs_s[1][tx], near, exponent,
                                  sum);
        }
        m[k * n * n + i * n + j] = value;
      }
      sum = warp_allreduce(sum, SumOp{});
      if (tx == 0 && i < n) partial[(k * tiles + J) * n + i] = double(sum);
    }
    __syncthreads();
    if (I != J) {  // a diagonal tile is its own mirror
      // J's rows against I's columns, from the same picks
      for (int r = ty; r < kTile; r += kTileRows) {
        const int64_t j = j0 + r, i = i0 + tx;
        T sum = 0;
        if (i < n && j < n)
          m[k * n * n + j * n + i] = expansion_entry(picked[tx][r], phi_s[1][r], f_s[1][r], rs_s[1][r], phi_s[0][tx],
                                                     f_s[0][tx], rs_s[0][tx], near, exponent, sum);
        sum = warp_allreduce(sum, SumOp{});
        if (tx == 0 && j < n) partial[(k * tiles + I) * n + j] = double(sum);
      }
      __syncthreads();  // the staged tiles are read before the next pair's overwrite them
    }
  }
}

// coupling[k][r] = Σ_t partial[k][t][r], in tile order
template <class T>
__global__ void coupling_sum_kernel(const double* __restrict__ partial, int64_t batch, int64_t n, int64_t tiles,
                                    T* __restrict__ coupling) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= batch * n) return;
  const int64_t k = row / n, r = row % n;
  double sum = 0;
  for (int64_t t = 0; t < tiles; ++t) sum += partial[(k * tiles + t) * n + r];
  coupling[row] = T(sum);
}

template <class T>
void launch_expansion(const Tensor& coupled, const Tensor& floored, const Tensor& floored_roots,
                      const Tensor& diagonal_roots, double p, const Tensor& middle, const Tensor& coupling) {
  const int64_t n = coupled.size(-1), batch = coupled.size(0);
  const int64_t tiles = (n + kTile - 1) / kTile, pairs = tiles * (tiles + 1) / 2;
  const Tensor partial = empty({batch, tiles, n}, {.dtype = DType::f64, .device = coupled.device()});
  double* pp = static_cast<double*>(partial.raw_data());
  // at most 8 blocks an SM (256 threads, 13-26 KiB of tiles each), striding over the pairs
  const int64_t blocks = std::min<int64_t>(batch * pairs, int64_t(sm_count()) * 8);
  kept_basis_expansion_kernel<T><<<unsigned(blocks), kExpansionThreads, 0, current_stream()>>>(
      static_cast<const T*>(coupled.raw_data()), static_cast<const T*>(floored.raw_data()),
      static_cast<const T*>(floored_roots.raw_data()), static_cast<const T*>(diagonal_roots.raw_data()), n, tiles,
      pairs, batch, T(-1.0 / p), static_cast<T*>(middle.raw_data()), pp);
  KILN_LAUNCH_CHECK("kept_basis_expansion_kernel", "kept_basis_expansion");
  const int threads = 256;
  coupling_sum_kernel<T><<<unsigned((batch * n + threads - 1) / threads), threads, 0, current_stream()>>>(
      pp, batch, n, tiles, static_cast<T*>(coupling.raw_data()));
  KILN_LAUNCH_CHECK("coupling_sum_kernel", "kept_basis_expansion");
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
