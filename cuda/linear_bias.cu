// The bias gradient of a linear layer on the GPU (the GELU epilogue's backward fused with it): column
// sums of the output gradient, optionally through gelu_tanh', for cuda/gemm.cpp's linear_backward.
#include <algorithm>

#include <kiln/core/half.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/gelu.cuh>
#include <kiln/cuda/linear_bias.h>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

// Column sums of a linear layer's output gradient (its bias gradient), optionally through the GELU:
// with kGelu, dz = dy ⊙ gelu_tanh'(pre) is written and summed (the rounded dz, which the GEMMs read);
// without, dy itself is summed. One thread per 8-column vector of a 32-vector strip, 8 rows down a
// block (256 threads); rows stride over gridDim.y. Each thread keeps its 8 column sums; the block adds
// its 8 rows' sums in shared memory and writes one partial row; column_sum_kernel adds the partial rows
// in a fixed order (deterministic).
template <class T, bool kGelu>
__global__ void __launch_bounds__(256)
    bias_gradient_kernel(const T* dy, const T* pre, T* dz, int64_t M, int64_t N, float* part) {
  __shared__ float sums[8][32][9];  // [row][vector][column], padded
  const int64_t nvec = N / 8, v = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  // one row's vector: through the GELU (dz written, and its rounded values summed) or as it is
  auto add_row = [&](const uint4& dy_words, const uint4& pre_words, int64_t at) {
    float g[8];
    widen16<T>(dy_words, g);
    if constexpr (kGelu) {
      float z[8];
      widen16<T>(pre_words, z);
#pragma unroll
      for (int j = 0; j < 8; ++j) g[j] *= gelu_tanh_grad(z[j]);
      const uint4 out = narrow16<T>(g);
      store16(dz + at, out);
      widen16<T>(out, g);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += g[j];
  };
  if (v < nvec) {
    const int64_t step = int64_t(gridDim.y) * 8;
    int64_t r = int64_t(blockIdx.y) * 8 + threadIdx.y;
    // Four rows' loads issued before any is used (the one-row loop had one in flight a thread): GPT-2's
    // column sums 0.785 -> 0.725 ms a step on an H100; the GELU pass, already at ~88% of the copy
    // bandwidth there, unchanged (1.373 -> 1.363 ms).
    constexpr int kRows = 4;
    for (; r + (kRows - 1) * step < M; r += kRows * step) {
      uint4 g[kRows], z[kRows]{};
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        g[u] = load16(dy + (r + u * step) * N + v * 8);
        if constexpr (kGelu) z[u] = load16(pre + (r + u * step) * N + v * 8);
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) add_row(g[u], z[u], (r + u * step) * N + v * 8);
    }
    for (; r < M; r += step) {
      const int64_t at = r * N + v * 8;
      add_row(load16(dy + at), kGelu ? load16(pre + at) : uint4{}, at);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) sums[threadIdx.y][threadIdx.x][j] = acc[j];
  __syncthreads();
  if (threadIdx.y != 0 || v >= nvec) return;
  for (int y = 1; y < 8; ++y)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += sums[y][threadIdx.x][j];
#pragma unroll
  for (int j = 0; j < 8; ++j) part[int64_t(blockIdx.y) * N + v * 8 + j] = acc[j];
}

// Whether the kernel serves: contiguous, aligned bf16/f16 (M, N) with N a multiple of 8, db (N) in their
// dtype or f32.
bool bias_gradient_servable(const Tensor& dy, const Tensor& db) {
  const DType t = dy.dtype();
  return (t == DType::bf16 || t == DType::f16) && dy.dim() == 2 && dy.is_contiguous() && aligned16(dy.raw_data()) &&
         dy.size(1) % 8 == 0 && dy.numel() > 0 && db.defined() && (db.dtype() == t || db.dtype() == DType::f32) &&
         db.numel() == dy.size(1) && db.is_contiguous() && db.device() == dy.device();
}

void launch_bias_gradient(const Tensor& dy, const Tensor& pre, const Tensor& dz, const Tensor& db) {
  const int64_t M = dy.size(0), N = dy.size(1), strips = (N / 8 + 31) / 32;
  const dim3 block(32, 8), sum_block(32, 32), sum_grid(static_cast<unsigned>((N + 31) / 32), 1);
  auto launch = [&](auto tag) {  // S: the element type, bf16 or f16
    using S = decltype(tag);
    using D = device_t<S>;
    auto kernel = pre.defined() ? bias_gradient_kernel<D, true> : bias_gradient_kernel<D, false>;
    // One wave: as many row blocks as the multiprocessors hold at once beside the strips (each block
    // walks its rows to the end, so a block past the wave would run alone after it). Each partial row is
    // N floats (L2-resident).
    const int64_t resident = int64_t(blocks_per_sm(reinterpret_cast<const void*>(kernel), 256, 0)) * sm_count();
    const int64_t row_blocks = std::max<int64_t>(1, std::min<int64_t>((M + 7) / 8, resident / strips));
    Tensor part = empty({row_blocks, N}, {.dtype = DType::f32, .device = dy.device()});
    float* pp = static_cast<float*>(part.raw_data());
    const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(row_blocks));
    kernel<<<grid, block, 0, current_stream()>>>(static_cast<const D*>(dy.raw_data()),
                                                 pre.defined() ? static_cast<const D*>(pre.raw_data()) : nullptr,
                                                 dz.defined() ? static_cast<D*>(dz.raw_data()) : nullptr, M, N, pp);
    KILN_LAUNCH_CHECK("bias_gradient_kernel", "linear_backward");
    if (db.dtype() == DType::f32)
      column_sum_kernel<float><<<sum_grid, sum_block, 0, current_stream()>>>(
          pp, nullptr, row_blocks, N, static_cast<float*>(db.raw_data()), nullptr);
    else
      column_sum_kernel<S><<<sum_grid, sum_block, 0, current_stream()>>>(pp, nullptr, row_blocks, N,
                                                                         static_cast<D*>(db.raw_data()), nullptr);
    KILN_LAUNCH_CHECK("column_sum_kernel", "linear_backward");
  };
  if (dy.dtype() == DType::bf16) launch(BFloat16{});
  else launch(Half{});
}

}  // namespace

bool gelu_tanh_backward_with_bias(const Tensor& dy, const Tensor& pre, const Tensor& dz, const Tensor& db) {
  const DType t = dy.dtype();
  if (!bias_gradient_servable(dy, db) || pre.sizes() != dy.sizes() || pre.dtype() != t || !pre.is_contiguous() ||
      !aligned16(pre.raw_data()) || dz.sizes() != dy.sizes() || dz.dtype() != t || !dz.is_contiguous() ||
      !aligned16(dz.raw_data()))
    return false;
  NvtxRange range("gelu_tanh_backward_with_bias");
  launch_bias_gradient(dy, pre, dz, db);
  return true;
}

bool bias_gradient(const Tensor& dy, const Tensor& db) {
  if (!bias_gradient_servable(dy, db)) return false;
  NvtxRange range("bias_gradient");
  launch_bias_gradient(dy, Tensor(), Tensor(), db);
  return true;
}

}  // namespace kiln::cuda
