// The pre-LayerNorm transformer's residual step under mixed precision, as one kernel each way:
//   forward:  h = x + δ + β,  μ = Σh / C,  σ² = Σ(h - μ)² / C,  r = 1 / sqrt(σ² + eps),  y = (h - μ) r ⊙ w + b
//   backward: x̂ = (h - μ) r,  g = dy ⊙ w,  dh = g_h + r (g - mean(g) - x̂ mean(g ⊙ x̂)),  dδ = dh,
//             dw = Σ_rows dy ⊙ x̂,  db = Σ_rows dy,  dβ = Σ_rows dh
// β is the bias of the linear layer that produced δ, folded in here (optional; f32, C): the layer then
// runs without its bias, and its bias gradient comes from this backward's pass over dh instead of a
// column-sum kernel that reads dδ again (nn::GPT's out_proj and mlp.proj, docs/transformers.md).
// The residual stream x, h, its gradients g_h, dh and the parameters are f32; δ, y, dy and dδ are in the
// autocast dtype T (bf16 or f16). δ may be absent (h = x, not written) and so may g_h (zero). Math in f32.
//
// Bytes per row of C columns: forward reads x (4C) and δ (2C) and writes h (4C) and y (2C); backward reads
// dy (2C), h (4C) and g_h (4C) and writes dh (4C) and dδ (2C): 12C and 16C. Composed from the separate ops
// (add with type promotion, the f32 layer norm, the cast the next matmul makes, and backward the cast of
// dy, the f32 norm backward, the sum with g_h and the cast of dδ) the same step moves 24C and 40C.
//
// A group of G threads (one warp for C <= 1024, four for C <= 4096) owns a row, each thread up to kChunks
// chunks of 8 columns (one 16-byte vector of T, two of f32) held in registers, all loads issued before the
// first use. The backward runs on a persistent grid: each group keeps dw/db sums for its columns in
// registers over the rows it visits and writes one partial row; column_sum_kernel adds the partials in a
// fixed order (no atomics, deterministic).
#include <algorithm>

#include <kiln/core/kernels/layer_norm.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

constexpr int kChunks = 4;    // chunks of 8 columns per thread
constexpr int kBlock = 256;   // threads per block
constexpr int kMaxColumns = 128 * kChunks * 8;

__device__ __forceinline__ void load_f32x8(const float* p, float (&f)[8]) {
  const uint4 a = load16(p), b = load16(p + 4);
  f[0] = __uint_as_float(a.x), f[1] = __uint_as_float(a.y), f[2] = __uint_as_float(a.z), f[3] = __uint_as_float(a.w);
  f[4] = __uint_as_float(b.x), f[5] = __uint_as_float(b.y), f[6] = __uint_as_float(b.z), f[7] = __uint_as_float(b.w);
}

__device__ __forceinline__ void store_f32x8(float* p, const float (&f)[8]) {
  store16(p, make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3])));
  store16(p + 4, make_uint4(__float_as_uint(f[4]), __float_as_uint(f[5]), __float_as_uint(f[6]), __float_as_uint(f[7])));
}

// w (or b) for chunk c: the parameter's 8 values, or `fill` when it is absent.
__device__ __forceinline__ void param_x8(const float* p, int64_t c, float fill, float (&f)[8]) {
  if (p) {
    load_f32x8(p + c * 8, f);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = fill;
  }
}

// Sums two values over the group (G = 32 or 128); ping-pong buffers make one barrier per call enough.
template <int G>
__device__ __forceinline__ void group_sum2(float& a, float& b, float (*buf)[kBlock / 32]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  if constexpr (G > 32) {
    const int warp = int(threadIdx.x) >> 5, first = (int(threadIdx.x) / G) * (G / 32);
    if ((threadIdx.x & 31) == 0) {
      buf[0][warp] = a;
      buf[1][warp] = b;
    }
    __syncthreads();
    a = buf[0][first];
    b = buf[1][first];
#pragma unroll
    for (int w = 1; w < G / 32; ++w) {
      a += buf[0][first + w];
      b += buf[1][first + w];
    }
  }
}

template <class T, int G>
__global__ void __launch_bounds__(kBlock)
    add_layer_norm_kernel(const float* x, const T* delta, const float* beta, const float* w, const float* b, float eps,
                          float* h, T* y, float* mean, float* rstd, int64_t M, int64_t C) {
  __shared__ float red[2][2][kBlock / 32];
  const int lane = int(threadIdx.x) % G;
  const int64_t row = int64_t(blockIdx.x) * (kBlock / G) + threadIdx.x / G;
  const bool valid = row < M;
  const int64_t chunks = C / 8, base = (valid ? row : 0) * C;
  auto mine = [&](int k) { return valid && lane + k * G < chunks; };
  uint4 xr[kChunks][2], dr[kChunks];
#pragma unroll
  for (int k = 0; k < kChunks; ++k)
    if (mine(k)) {
      const int64_t at = base + (lane + k * G) * 8;
      xr[k][0] = load16(x + at);
      xr[k][1] = load16(x + at + 4);
      if (delta) dr[k] = load16(delta + at);
    }
  float v[kChunks][8];
  float s = 0, unused = 0;
#pragma unroll
  for (int k = 0; k < kChunks; ++k)
    if (mine(k)) {
      const uint32_t u[8] = {xr[k][0].x, xr[k][0].y, xr[k][0].z, xr[k][0].w,
                             xr[k][1].x, xr[k][1].y, xr[k][1].z, xr[k][1].w};
      float d[8], bt[8];
      if (delta) widen16<T>(dr[k], d);
      param_x8(beta, lane + k * G, 0.0f, bt);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v[k][j] = __uint_as_float(u[j]) + ((delta ? d[j] : 0.0f) + bt[j]);
        s += v[k][j];
      }
    }
  group_sum2<G>(s, unused, red[0]);
  const float inv_c = 1.0f / float(C), mu = s * inv_c;
  float q = 0;
#pragma unroll
  for (int k = 0; k < kChunks; ++k)
    if (mine(k))
#pragma unroll
      for (int j = 0; j < 8; ++j) q += (v[k][j] - mu) * (v[k][j] - mu);
  group_sum2<G>(q, unused, red[1]);
  const float rs = rsqrtf(q * inv_c + eps);
  if (!valid) return;
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
#pragma unroll
  for (int k = 0; k < kChunks; ++k)
    if (mine(k)) {
      const int64_t c = lane + k * G, at = base + c * 8;
      if (delta) store_f32x8(h + at, v[k]);
      float wv[8], bv[8];
      param_x8(w, c, 1.0f, wv);
      param_x8(b, c, 0.0f, bv);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[k][j] = (v[k][j] - mu) * rs * wv[j] + bv[j];
      store16(y + at, narrow16<T>(v[k]));
    }
}

template <class T, int G>
__global__ void __launch_bounds__(kBlock, 1)
    add_layer_norm_backward_kernel(const T* dy, const float* h, const float* w, const float* mean, const float* rstd,
                                   const float* gh, float* dh, T* ddelta, int64_t M, int64_t C, float* part_dw,
                                   float* part_db, float* part_dbeta) {
  constexpr int kGroups = kBlock / G;
  __shared__ float red[2][2][kBlock / 32];
  const int lane = int(threadIdx.x) % G;
  const int64_t chunks = C / 8, group = int64_t(blockIdx.x) * kGroups + threadIdx.x / G;
  auto have = [&](int k) { return lane + k * G < chunks; };
  float sum_w[kChunks][8], sum_b[kChunks][8], sum_d[kChunks][8];  // this thread's columns: Σ dy x̂, Σ dy, Σ dh
#pragma unroll
  for (int k = 0; k < kChunks; ++k)
#pragma unroll
    for (int j = 0; j < 8; ++j) sum_w[k][j] = sum_b[k][j] = sum_d[k][j] = 0.0f;
  const float inv_c = 1.0f / float(C);
  int buf = 0;
  // The loop bound is uniform over the block (the reduction of a 4-warp group has a barrier).
  for (int64_t first = int64_t(blockIdx.x) * kGroups; first < M; first += int64_t(gridDim.x) * kGroups) {
    const int64_t row = first + threadIdx.x / G;
    const bool valid = row < M;
    const int64_t base = (valid ? row : 0) * C;
    uint4 gr[kChunks];
    float hv[kChunks][8], res[kChunks][8];
    // g_h's loads go out with dy's and h's, before the row's reduction: one memory round trip a row, not two
    // (the registers allow one block of 8 warps a multiprocessor either way). The thread that loads an
    // element of g_h is the one that later stores that element of dh: the two may be one buffer.
#pragma unroll
    for (int k = 0; k < kChunks; ++k)
      if (valid && have(k)) {
        gr[k] = load16(dy + base + (lane + k * G) * 8);
        load_f32x8(h + base + (lane + k * G) * 8, hv[k]);
        if (gh) load_f32x8(gh + base + (lane + k * G) * 8, res[k]);
      }
    const float mu = valid ? mean[row] : 0.0f, rs = valid ? rstd[row] : 0.0f;
    float s_g = 0, s_gx = 0;  // Σ g, Σ g x̂
#pragma unroll
    for (int k = 0; k < kChunks; ++k)
      if (valid && have(k)) {
        float g[8], wv[8];
        widen16<T>(gr[k], g);
        param_x8(w, lane + k * G, 1.0f, wv);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float xh = (hv[k][j] - mu) * rs;
          hv[k][j] = xh;
          sum_w[k][j] += g[j] * xh;
          sum_b[k][j] += g[j];
          s_g += g[j] * wv[j];
          s_gx += g[j] * wv[j] * xh;
        }
      }
    group_sum2<G>(s_g, s_gx, red[buf]);
    buf ^= 1;
    s_g *= inv_c;
    s_gx *= inv_c;
#pragma unroll
    for (int k = 0; k < kChunks; ++k)
      if (valid && have(k)) {
        const int64_t at = base + (lane + k * G) * 8;
        float g[8], wv[8];
        widen16<T>(gr[k], g);
        param_x8(w, lane + k * G, 1.0f, wv);
#pragma unroll
        for (int j = 0; j < 8; ++j) g[j] = rs * (g[j] * wv[j] - s_g - hv[k][j] * s_gx) + (gh ? res[k][j] : 0.0f);
        if (part_dbeta)
#pragma unroll
          for (int j = 0; j < 8; ++j) sum_d[k][j] += g[j];
        store_f32x8(dh + at, g);
        if (ddelta) store16(ddelta + at, narrow16<T>(g));
      }
  }
#pragma unroll
  for (int k = 0; k < kChunks; ++k)
    if (have(k)) {
      store_f32x8(part_dw + group * C + (lane + k * G) * 8, sum_w[k]);
      store_f32x8(part_db + group * C + (lane + k * G) * 8, sum_b[k]);
      if (part_dbeta) store_f32x8(part_dbeta + group * C + (lane + k * G) * 8, sum_d[k]);
    }
}

bool aligned16(const Tensor& t) { return !t.defined() || (reinterpret_cast<uintptr_t>(t.raw_data()) & 15) == 0; }

template <class T>
const T* ptr(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw_data()) : nullptr;
}
template <class T>
T* mut(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.raw_data()) : nullptr;
}

bool low_precision(DType t) { return t == DType::bf16 || t == DType::f16; }

// Whether the kernels serve these tensors: f32 x, y in bf16/f16 with δ (if any) in y's dtype, f32
// parameters (β only with δ), contiguous 16-byte-aligned rows of C = 8k <= kMaxColumns columns, all on one
// device.
bool servable(const Tensor& x, const Tensor& delta, const Tensor& beta, const Tensor& w, const Tensor& b,
              const Tensor& y) {
  if (x.dtype() != DType::f32 || !low_precision(y.dtype()) || x.dim() < 1) return false;
  const int64_t C = x.size(-1);
  if (C == 0 || C % 8 != 0 || C > kMaxColumns || x.numel() == 0) return false;
  for (const Tensor* t : {&x, &delta, &beta, &w, &b, &y})
    if (t->defined() && (!t->is_contiguous() || !aligned16(*t) || t->device() != x.device())) return false;
  if (delta.defined() && (delta.dtype() != y.dtype() || delta.sizes() != x.sizes())) return false;
  if (beta.defined() && !delta.defined()) return false;
  for (const Tensor* p : {&beta, &w, &b})
    if (p->defined() && (p->dtype() != DType::f32 || p->numel() != C)) return false;
  return y.sizes() == x.sizes();
}

template <class T>
void launch_forward(const Tensor& x, const Tensor& delta, const Tensor& beta, const Tensor& w, const Tensor& b,
                    double eps, const Tensor& h, const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  const int64_t C = x.size(-1), M = x.numel() / C;
  const bool narrow = C <= 32 * kChunks * 8;
  const int64_t rows_per_block = kBlock / (narrow ? 32 : 128);
  const unsigned grid = unsigned((M + rows_per_block - 1) / rows_per_block);
  auto kernel = narrow ? add_layer_norm_kernel<T, 32> : add_layer_norm_kernel<T, 128>;
  kernel<<<grid, kBlock, 0, current_stream()>>>(ptr<float>(x), ptr<T>(delta), ptr<float>(beta), ptr<float>(w),
                                                ptr<float>(b), float(eps), mut<float>(h), mut<T>(y), mut<float>(mean),
                                                mut<float>(rstd), M, C);
  KILN_LAUNCH_CHECK("add_layer_norm_kernel", "add_layer_norm");
}

template <class T>
void launch_backward(const Tensor& dy, const Tensor& h, const Tensor& w, const Tensor& mean, const Tensor& rstd,
                     const Tensor& gh, const Tensor& dh, const Tensor& ddelta, const Tensor& dw, const Tensor& db,
                     const Tensor& dbeta) {
  const int64_t C = h.size(-1), M = h.numel() / C;
  const int G = C <= 32 * kChunks * 8 ? 32 : 128;
  auto kernel = G == 32 ? add_layer_norm_backward_kernel<T, 32> : add_layer_norm_backward_kernel<T, 128>;
  const int per_sm = std::max(1, blocks_per_sm(reinterpret_cast<const void*>(kernel), kBlock, 0));
  const int64_t groups_per_block = kBlock / G;
  const int64_t grid = std::min<int64_t>(int64_t(per_sm) * sm_count(), (M + groups_per_block - 1) / groups_per_block);
  const int64_t parts = grid * groups_per_block;
  TensorOptions f32{.dtype = DType::f32, .device = h.device()};
  Tensor part_dw = empty({parts, C}, f32), part_db = empty({parts, C}, f32);
  Tensor part_dbeta = dbeta.defined() ? empty({parts, C}, f32) : Tensor();
  kernel<<<unsigned(grid), kBlock, 0, current_stream()>>>(ptr<T>(dy), ptr<float>(h), ptr<float>(w), ptr<float>(mean),
                                                          ptr<float>(rstd), ptr<float>(gh), mut<float>(dh), mut<T>(ddelta),
                                                          M, C, mut<float>(part_dw), mut<float>(part_db),
                                                          mut<float>(part_dbeta));
  KILN_LAUNCH_CHECK("add_layer_norm_backward_kernel", "add_layer_norm_backward");
  const unsigned strips = unsigned((C + 31) / 32);
  const dim3 threads(32, 32);
  // dw, db and the folded bias's dβ in one launch (two before: GPT-2's column sums 227 -> 171 us a step, H200)
  if (dw.defined() || db.defined() || dbeta.defined()) {
    column_sum_kernel<float><<<dim3(strips, dbeta.defined() ? 3 : 2), threads, 0, current_stream()>>>(
        ptr<float>(part_dw), ptr<float>(part_db), parts, C, mut<float>(dw), mut<float>(db), ptr<float>(part_dbeta),
        mut<float>(dbeta));
    KILN_LAUNCH_CHECK("column_sum_kernel", "add_layer_norm_backward");
  }
}

void check_stats(const Tensor& mean, const Tensor& rstd, int64_t M, const Tensor& x, const char* op) {
  for (const Tensor* s : {&mean, &rstd})
    KILN_CHECK(s->defined() && s->dtype() == DType::f32 && s->numel() == M && s->is_contiguous() &&
                   s->device() == x.device(),
               op, ": statistics ", s->str(), " must be contiguous f32 of ", M, " rows on ", x.device().str());
}

}  // namespace

bool kernels::add_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& delta_bias, const Tensor& weight,
                                 const Tensor& bias, double eps, const Tensor& h, const Tensor& y, const Tensor& mean,
                                 const Tensor& rstd) {
  if (!servable(x, delta, delta_bias, weight, bias, y)) return false;
  NvtxRange range("add_layer_norm");
  const int64_t C = x.size(-1), M = x.numel() / C;
  KILN_CHECK(!delta.defined() || (h.defined() && h.dtype() == DType::f32 && h.sizes() == x.sizes() &&
                                  h.is_contiguous() && aligned16(h) && h.device() == x.device()),
             "add_layer_norm: h ", h.str(), " must be a contiguous f32 tensor like x ", x.str());
  check_stats(mean, rstd, M, x, "add_layer_norm");
  DeviceGuard guard(x.device().index);
  if (y.dtype() == DType::bf16)
    launch_forward<__nv_bfloat16>(x, delta, delta_bias, weight, bias, eps, h, y, mean, rstd);
  else
    launch_forward<__half>(x, delta, delta_bias, weight, bias, eps, h, y, mean, rstd);
  return true;
}

bool kernels::add_layer_norm_backward(const Tensor& dy, const Tensor& h, const Tensor& weight, const Tensor& mean,
                                          const Tensor& rstd, const Tensor& gh, const Tensor& dh, const Tensor& ddelta,
                                          const Tensor& dw, const Tensor& db, const Tensor& ddelta_bias) {
  if (!servable(h, ddelta, Tensor(), weight, Tensor(), dy) || (gh.defined() && (gh.dtype() != DType::f32 || gh.sizes() != h.sizes() ||
                                                                     !gh.is_contiguous() || !aligned16(gh))) ||
      !(dh.dtype() == DType::f32 && dh.sizes() == h.sizes() && dh.is_contiguous() && aligned16(dh)))
    return false;
  for (const Tensor* p : {&dw, &db, &ddelta_bias})
    KILN_CHECK(!p->defined() || (p->dtype() == DType::f32 && p->numel() == h.size(-1) && p->is_contiguous()),
               "add_layer_norm_backward: parameter gradient ", p->str(), " must be a contiguous f32 vector of ",
               h.size(-1));
  NvtxRange range("add_layer_norm_backward");
  const int64_t C = h.size(-1), M = h.numel() / C;
  check_stats(mean, rstd, M, h, "add_layer_norm_backward");
  DeviceGuard guard(h.device().index);
  if (dy.dtype() == DType::bf16)
    launch_backward<__nv_bfloat16>(dy, h, weight, mean, rstd, gh, dh, ddelta, dw, db, ddelta_bias);
  else
    launch_backward<__half>(dy, h, weight, mean, rstd, gh, dh, ddelta, dw, db, ddelta_bias);
  return true;
}

}  // namespace kiln::cuda
