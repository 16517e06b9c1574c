// kernels::kept_basis_expansion on the GPU (core/kernels/linalg.h; the linalg family's solvers are
// cuda/linalg.cpp): one read of B and one write of the middle matrix, where the expansion composed from
// general ops made ~20 passes over the factors (GPT-2 124M's 342 blocks are 1 GiB of f32).
//
// A block takes a pair of 32 x 32 tiles at a time, (I, J) and its mirror (J, I) (I >= J), both staged in shared
// memory: each entry pair (i, j), (j, i) takes the one of the two that B's pick names (the column of the smaller
// φ), and both halves of the middle are written from it, rows coalesced; the next pair's tiles are loaded into
// registers while a pair is worked. Each row's coupling is summed along a fixed order (a tile's 32 terms in
// column order in B's dtype into one f64 partial a row and column tile, then the partials in tile order in
// f64 by a second kernel), so the result is the same every run.
// What an entry needs of its row and column (φ, f(φ), 1/f(φ), φ^(−1/2)) is staged once a tile, offsets within a
// matrix are 32-bit, and for an integer p the divided difference is the closed form −f_i·f_j / S_ij (no
// power, no near-tie branch). Still bound by its instructions (ncu, H200, the 146 blocks of 1024: 669 µs,
// ~112 instructions an entry, 39% of the DRAM bandwidth; docs/optim.md, session 35, names what they are).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

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

// How F_ij is computed (core/kernels/linalg.h): kP = 4, the closed form for p = 4 with S factored; kAnyInteger,
// the closed form for the integer p passed at run time; kOtherP, the difference or f'(mean).
constexpr int kAnyInteger = 0, kOtherP = -1;

// What an entry needs of its row or column: φ, f(φ) = φ^(−1/p), v = 1/f(φ) = φ^(1/p) and φ^(−1/2)
template <class T>
struct alignas(4 * sizeof(T)) Quotient {
  T phi, f, v, rs;
};

// num / den: f32 by the approximate reciprocal (1 ulp; one MUFU instruction, where __fdividef added ~6 for its
// range checks), f64 exactly
__device__ __forceinline__ float quotient(float num, float den) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(den));
  return num * r;
}
__device__ __forceinline__ double quotient(double num, double den) { return num / den; }

// F_ij, the divided difference of f at φ_i, φ_j (exponent = −1/p, near the tie threshold of kOtherP)
template <int kP, class T>
__device__ __forceinline__ T divided_difference(const Quotient<T>& a, const Quotient<T>& b, int integer_p, T near,
                                                T exponent) {
  if constexpr (kP == kOtherP) {
    const T gap = a.phi - b.phi, mean = T(0.5) * (a.phi + b.phi);
    return fabs(gap) <= near * mean ? exponent * pow(mean, exponent - T(1)) : (a.f - b.f) / gap;
  } else if constexpr (kP == 4) {  // S = v_i³ + v_i²·v_j + v_i·v_j² + v_j³ = (v_i + v_j)·(v_i² + v_j²)
    return -quotient(a.f * b.f, (a.v + b.v) * (a.v * a.v + b.v * b.v));
  } else {
    return -quotient(a.f * b.f, integer_root_difference_sum(a.v, b.v, integer_p));
  }
}

constexpr int kRowsPerWarp = kTile / kTileRows;

// Block index → (matrix k, tile pair (I, J)), pair = I·(I+1)/2 + J, 0 <= J <= I
struct TilePair {
  int64_t k;
  int I, J;
};
__device__ __forceinline__ TilePair tile_pair(int64_t block, int pairs) {
  const int64_t k = block / pairs;
  const int pair = int(block - k * pairs);
  int I = int((sqrtf(8.0f * float(pair) + 1.0f) - 1.0f) * 0.5f);  // within one of I (corrected below)
  while (I * (I + 1) / 2 > pair) --I;
  while ((I + 1) * (I + 2) / 2 <= pair) ++I;
  return {k, I, pair - I * (I + 1) / 2};
}

// One thread's share of a tile pair, loaded into registers while the block works on the pair before it:
// rows ty + 8u of tiles (I, J) and (J, I), and (threads 0..63) φ and f(φ) of I's (0..31) or J's (32..63) rows.
template <class T>
struct Staged {
  T ij[kRowsPerWarp], ji[kRowsPerWarp];
  T phi, f;
  T scale;  // the matrix's
};

template <class T>
__device__ __forceinline__ void load_pair(Staged<T>& s, const T* __restrict__ b, const T* __restrict__ scales,
                                          const T* __restrict__ phi, const T* __restrict__ f, int n,
                                          const TilePair& t, int tx, int ty) {
  const T* b_k = b + t.k * n * n;
  s.scale = scales != nullptr ? scales[t.k] : T(1);
  const int i0 = t.I * kTile, j0 = t.J * kTile;
#pragma unroll
  for (int u = 0; u < kRowsPerWarp; ++u) {
    const int r = ty + u * kTileRows;
    s.ij[u] = i0 + r < n && j0 + tx < n ? b_k[(i0 + r) * n + j0 + tx] : T(0);
    s.ji[u] = j0 + r < n && i0 + tx < n ? b_k[(j0 + r) * n + i0 + tx] : T(0);
  }
  if (threadIdx.x < 2 * kTile) {
    const int at = (threadIdx.x < kTile ? i0 : j0) + tx;
    s.phi = at < n ? phi[t.k * n + at] : T(1);
    s.f = at < n ? f[t.k * n + at] : T(1);
  }
}

template <class T>
using TileOf = T[kTile][kTile + 1];

// One staged tile pair's entries: I's rows against J's columns, each pair's entry picked (the column of the
// smaller φ), then, off the diagonal, J's rows against I's columns from the same picks; the whitened squares
// into squares[0] and squares[1] for the row sums. kChecked: bounds and diagonal checks (a pair on the
// diagonal or at the matrix's edge). Barriers inside: every thread of the block calls it.
template <int kP, bool kChecked, class T>
__device__ __forceinline__ void expand_pair(const TileOf<T>& c_ij, const TileOf<T>& c_ji, TileOf<T>& picked,
                                            TileOf<T> (&squares)[2], const Quotient<T> (&quotients)[2][kTile],
                                            T* __restrict__ m_k, const T* __restrict__ d, const TilePair& cur, int n,
                                            int integer_p, T near, T exponent) {
  const int tx = int(threadIdx.x) % kTile, ty = int(threadIdx.x) / kTile;
  const int i0 = cur.I * kTile, j0 = cur.J * kTile;
  {
    const Quotient<T> qj = quotients[1][tx];  // this thread's column, every row
    const int j = j0 + tx;
#pragma unroll
    for (int u = 0; u < kRowsPerWarp; ++u) {
      const int r = ty + u * kTileRows, i = i0 + r;
      T square = 0;
      if (!kChecked || (i < n && j < n)) {
        T value;
        if (kChecked && i == j) {
          value = d[cur.k * n + i];
        } else {
          const Quotient<T> qi = quotients[0][r];
          const bool row_i = qi.phi > qj.phi || (qi.phi == qj.phi && i > j);  // the pair's entry at (r, c)
          const T from_ij = c_ij[r][tx], from_ji = c_ji[tx][r];
          const T bij = row_i ? from_ij : from_ji;
          picked[r][tx] = bij;
          value = divided_difference<kP>(qi, qj, integer_p, near, exponent) * bij;
          const T whitened = bij * (qi.rs * qj.rs);
          square = whitened * whitened;
        }
        m_k[i * n + j] = value;
      }
      squares[0][r][tx] = square;
    }
  }
  __syncthreads();
  if (cur.I == cur.J) return;  // a diagonal tile is its own mirror
  const Quotient<T> qi = quotients[0][tx];
  const int i = i0 + tx;
#pragma unroll
  for (int u = 0; u < kRowsPerWarp; ++u) {
    const int r = ty + u * kTileRows, j = j0 + r;
    T square = 0;
    if (!kChecked || (i < n && j < n)) {
      const Quotient<T> qj = quotients[1][r];
      const T bij = picked[tx][r];
      m_k[j * n + i] = divided_difference<kP>(qj, qi, integer_p, near, exponent) * bij;
      const T whitened = bij * (qj.rs * qi.rs);
      square = whitened * whitened;
    }
    squares[1][r][tx] = square;
  }
  __syncthreads();
}

// Blocks stride over (matrix k, tile pair (I, J)), the next pair's tiles loaded while this one is worked;
// partial (batch, tiles, n): row r's coupling over column tile t at [k][t][r], a tile row's 32 terms summed in
// B's dtype in column order by one thread (the squares staged in shared memory), stored in f64. B's entries
// are taken times the matrix's scale (1 where scales is null) as they are staged.
template <class T, int kP>
__global__ void __launch_bounds__(kExpansionThreads, sizeof(T) == 4 ? 4 : 1) kept_basis_expansion_kernel(
    const T* __restrict__ b, const T* __restrict__ scales, const T* __restrict__ phi, const T* __restrict__ f,
    const T* __restrict__ d, int n, int tiles, int pairs, int64_t batch, int integer_p, T exponent,
    T* __restrict__ m, double* __restrict__ partial) {
  __shared__ T c_ij[kTile][kTile + 1], c_ji[kTile][kTile + 1], picked[kTile][kTile + 1];
  __shared__ T squares[2][kTile][kTile + 1];  // whitened B²: [0] I's rows × J's columns, [1] J's rows × I's
  __shared__ Quotient<T> quotients[2][kTile];  // [0]: I's rows, [1]: J's
  const int tx = int(threadIdx.x) % kTile, ty = int(threadIdx.x) / kTile;
  const T near = sizeof(T) == 8 ? T(1e-5) : T(1e-2);
  const int64_t total = batch * pairs;
  int64_t block = blockIdx.x;
  if (block >= total) return;
  TilePair t = tile_pair(block, pairs);
  Staged<T> s;
  load_pair(s, b, scales, phi, f, n, t, tx, ty);
  for (; block < total; block += gridDim.x) {
    const TilePair cur = t;
#pragma unroll
    for (int u = 0; u < kRowsPerWarp; ++u) {
      c_ij[ty + u * kTileRows][tx] = s.ij[u] * s.scale;
      c_ji[ty + u * kTileRows][tx] = s.ji[u] * s.scale;
    }
    if (threadIdx.x < 2 * kTile)
      quotients[threadIdx.x / kTile][tx] = {s.phi, s.f, T(1) / s.f, T(1) / sqrt(s.phi)};
    __syncthreads();
    if (block + gridDim.x < total) {  // the next pair's loads in flight during this one's work
      t = tile_pair(block + gridDim.x, pairs);
      load_pair(s, b, scales, phi, f, n, t, tx, ty);
    }
    const int i0 = cur.I * kTile, j0 = cur.J * kTile;
    T* m_k = m + cur.k * n * n;
    // a tile pair off the diagonal and inside the matrix (all but the last row or column of tiles): no
    // bounds or diagonal checks an entry
    if (cur.I != cur.J && i0 + kTile <= n)
      expand_pair<kP, false>(c_ij, c_ji, picked, squares, quotients, m_k, d, cur, n, integer_p, near, exponent);
    else
      expand_pair<kP, true>(c_ij, c_ji, picked, squares, quotients, m_k, d, cur, n, integer_p, near, exponent);
    // each row's 32 terms in column order, a thread a row: warp 0 for I's rows, warp 1 for J's (the next
    // pair's staging waits for these warps at its barrier, and writes no squares before the one after it)
    if (ty < (cur.I != cur.J ? 2 : 1)) {
      const int row = (ty == 0 ? i0 : j0) + tx;
      T sum = 0;
#pragma unroll 8
      for (int c = 0; c < kTile; ++c) sum += squares[ty][tx][c];
      if (row < n) partial[(cur.k * tiles + (ty == 0 ? cur.J : cur.I)) * n + row] = double(sum);
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
void launch_expansion(const Tensor& coupled, const Tensor& coupled_scales, const Tensor& floored,
                      const Tensor& floored_roots, const Tensor& diagonal_roots, double p, const Tensor& middle,
                      const Tensor& coupling) {
  const int64_t n = coupled.size(-1), batch = coupled.size(0);
  KILN_CHECK(n * n <= int64_t(INT32_MAX), "kept_basis_expansion: ", coupled.str(),
             " has matrices of more than 2^31 entries (32-bit offsets within a matrix)");
  const int64_t tiles = (n + kTile - 1) / kTile, pairs = tiles * (tiles + 1) / 2;
  const Tensor partial = empty({batch, tiles, n}, {.dtype = DType::f64, .device = coupled.device()});
  double* pp = static_cast<double*>(partial.raw_data());
  const int integer_p = kept_basis_integer_p(p);
  auto launch = [&](auto kernel) {
    // as many blocks as fit at once (f32: 6 an SM, 40 registers a thread, 22 KiB of tiles), striding over the
    // pairs: one wave
    int resident = 0;
    KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kExpansionThreads, 0));
    const int64_t blocks = std::min<int64_t>(batch * pairs, int64_t(sm_count()) * std::max(resident, 1));
    kernel<<<unsigned(blocks), kExpansionThreads, 0, current_stream()>>>(
        static_cast<const T*>(coupled.raw_data()),
        coupled_scales.defined() ? static_cast<const T*>(coupled_scales.raw_data()) : nullptr,
        static_cast<const T*>(floored.raw_data()), static_cast<const T*>(floored_roots.raw_data()),
        static_cast<const T*>(diagonal_roots.raw_data()), int(n), int(tiles), int(pairs), batch, integer_p,
        T(-1.0 / p), static_cast<T*>(middle.raw_data()), pp);
  };
  bool specialised = false;
  if constexpr (std::is_same_v<T, float>) {
    specialised = integer_p == 4;  // Shampoo's matrices: order 2, p = 4
    if (specialised) launch(kept_basis_expansion_kernel<float, 4>);
  }
  if (!specialised) {
    if (integer_p != 0)
      launch(kept_basis_expansion_kernel<T, kAnyInteger>);
    else
      launch(kept_basis_expansion_kernel<T, kOtherP>);
  }
  KILN_LAUNCH_CHECK("kept_basis_expansion_kernel", "kept_basis_expansion");
  const int threads = 256;
  coupling_sum_kernel<T><<<unsigned((batch * n + threads - 1) / threads), threads, 0, current_stream()>>>(
      pp, batch, n, tiles, static_cast<T*>(coupling.raw_data()));
  KILN_LAUNCH_CHECK("coupling_sum_kernel", "kept_basis_expansion");
}

}  // namespace

void kernels::kept_basis_expansion(const Tensor& coupled, const Tensor& coupled_scales, const Tensor& floored,
                                   const Tensor& floored_roots, const Tensor& diagonal_roots, double p,
                                   const Tensor& middle, const Tensor& coupling) {
  NvtxRange range("kept_basis_expansion");
  check_kept_basis_expansion(coupled, coupled_scales, floored, floored_roots, diagonal_roots, middle, coupling);
  if (coupled.numel() == 0) return;
  DeviceGuard guard(coupled.device().index);
  if (coupled.dtype() == DType::f64)
    launch_expansion<double>(coupled, coupled_scales, floored, floored_roots, diagonal_roots, p, middle, coupling);
  else
    launch_expansion<float>(coupled, coupled_scales, floored, floored_roots, diagonal_roots, p, middle, coupling);
}

}  // namespace kiln::cuda
