// kernels::column_norm_gap on the GPU (core/kernels/linalg.h): max_j |‖q_j‖² − 1| of each basis in one read.
// A block a 32-column tile of one matrix: its 8 warps stride over the rows, lanes along the columns (128-byte
// rows of the tile), each column's squares summed in f64 by its 8 threads and then by one in a fixed order;
// the tile's largest gap, then a second kernel's over the tiles in order. NaN wins every max, so a basis with
// one is never taken for a kept one.
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
constexpr int kRowLanes = 8;

// block (matrix k, tile t) -> partial[k][t]
template <class T>
__global__ void __launch_bounds__(kTile * kRowLanes) column_gap_tile_kernel(const T* __restrict__ q, int64_t n,
                                                                            int64_t tiles, double* __restrict__ partial) {
  __shared__ double sums[kRowLanes][kTile];
  const int tx = int(threadIdx.x) % kTile, ty = int(threadIdx.x) / kTile;
  const int64_t k = blockIdx.x, t = blockIdx.y, j = t * kTile + tx;
  const T* qk = q + k * n * n;
  double sum = 0;
  if (j < n)
    for (int64_t i = ty; i < n; i += kRowLanes) {
      const double v = double(qk[i * n + j]);
      sum += v * v;
    }
  sums[ty][tx] = sum;
  __syncthreads();
  if (ty != 0) return;
  double norm = 0;
  for (int r = 0; r < kRowLanes; ++r) norm += sums[r][tx];
  const double gap = warp_allreduce(j < n ? fabs(norm - 1.0) : 0.0, NanMaxOp{});
  if (tx == 0) partial[k * tiles + t] = gap;
}

template <class T>
__global__ void column_gap_kernel(const double* __restrict__ partial, int64_t batch, int64_t tiles, T* __restrict__ gap) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= batch) return;
  double largest = 0;
  for (int64_t t = 0; t < tiles; ++t) largest = NanMaxOp{}(largest, partial[k * tiles + t]);
  gap[k] = T(largest);
}

template <class T>
void launch_column_gap(const Tensor& q, const Tensor& gap) {
  const int64_t batch = q.size(0), n = q.size(1), tiles = (n + kTile - 1) / kTile;
  KILN_CHECK(batch <= int64_t(INT32_MAX) && tiles <= 65535, "column_norm_gap: ", batch, " matrices of ", n,
             " columns, more than a grid holds");
  const Tensor partial = empty({batch, tiles}, {.dtype = DType::f64, .device = q.device()});
  double* pp = static_cast<double*>(partial.raw_data());
  column_gap_tile_kernel<T><<<dim3(unsigned(batch), unsigned(tiles)), kTile * kRowLanes, 0, current_stream()>>>(
      static_cast<const T*>(q.raw_data()), n, tiles, pp);
  KILN_LAUNCH_CHECK("column_gap_tile_kernel", "column_norm_gap");
  const int threads = 128;
  column_gap_kernel<T><<<unsigned((batch + threads - 1) / threads), threads, 0, current_stream()>>>(
      pp, batch, tiles, static_cast<T*>(gap.raw_data()));
  KILN_LAUNCH_CHECK("column_gap_kernel", "column_norm_gap");
}

}  // namespace

void kernels::column_norm_gap(const Tensor& q, const Tensor& gap) {
  NvtxRange range("column_norm_gap");
  check_column_norm_gap(q, gap);
  if (q.size(0) == 0) return;
  DeviceGuard guard(q.device().index);
  if (q.size(1) == 0) {  // no columns: no gap
    Tensor g = gap;
    g.zero_();
    return;
  }
  if (q.dtype() == DType::f64) launch_column_gap<double>(q, gap);
  else launch_column_gap<float>(q, gap);
}

}  // namespace kiln::cuda
