// The generic attention kernels: every float dtype, head dims up to 32 · kMaxPerLane = 256, any strides
// (f32, f64, other head dims, misaligned views; the forward also for scale <= 0). One warp per query row
// (forward, dQ) and per key row (dK, dV), exact in f32/f64, with the same dropout mask as the tensor-core
// kernels. The math is stated at kernels::attention_forward (core/kernels/attention.h).
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <kiln/cuda/attention_common.cuh>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>

namespace kiln::cuda {

namespace {

using namespace flash;

template <class A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---------------------------------------------------------------------------------- any dtype, D <= 256

// D_i = Σ_d dO_id O_id, one warp per row; A = f32 (f64 for f64).
template <class S>
__global__ void attention_dsum_kernel(HeadView dout, HeadView out, compute_t<S>* dsum, int H, int Tq, int D, int64_t rows) {
  using T = device_t<S>;
  using A = compute_t<S>;
  const int lane = int(threadIdx.x) % 32;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; r < rows;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t bh = r / Tq, i = r % Tq;
    const T* dor = static_cast<const T*>(dout.ptr) + (bh / H) * dout.sb + (bh % H) * dout.sh + i * dout.st;
    const T* orow = static_cast<const T*>(out.ptr) + (bh / H) * out.sb + (bh % H) * out.sh + i * out.st;
    A acc = 0;
    for (int d = lane; d < D; d += 32) acc += convert<A>(dor[d]) * convert<A>(orow[d]);
    acc = warp_sum(acc);
    if (lane == 0) dsum[r] = acc;
  }
}

struct SimpleParams {
  HeadView q, k, v, o, dout, dq, dk, dv;
  void* lse;         // stat dtype
  const void* dsum;  // stat dtype
  int B, H, Tq, Tk, D;
  double scale;
  KeyBand band;
  BlockList blocks;
  DropoutArgs drop;
  BiasView bias;  // stat dtype
};

// The bias of score (i, j) of head bh, 0 without one.
template <class A>
__device__ __forceinline__ A score_bias(const SimpleParams& p, int64_t bh, int64_t i, int64_t j) {
  return p.bias.ptr ? bias_row<A>(p.bias, bh, i)[j * p.bias.sk] : A(0);
}

template <class T>
__device__ __forceinline__ const T* row_ptr(const HeadView& v, int64_t bh, int H, int64_t i) {
  return static_cast<const T*>(v.ptr) + (bh / H) * v.sb + (bh % H) * v.sh + i * v.st;
}

template <class T, class A>
__device__ __forceinline__ void load_row(A (&x)[kMaxPerLane], const T* r, int D, int lane) {
#pragma unroll
  for (int c = 0; c < kMaxPerLane; ++c) x[c] = c * 32 + lane < D ? convert<A>(r[c * 32 + lane]) : A(0);
}
template <class T, class A>
__device__ __forceinline__ A dot_row(const A (&x)[kMaxPerLane], const T* r, int D, int lane) {
  A acc = 0;
#pragma unroll
  for (int c = 0; c < kMaxPerLane; ++c)
    if (c * 32 + lane < D) acc += x[c] * convert<A>(r[c * 32 + lane]);
  return warp_sum(acc);
}
template <class A>
__device__ __forceinline__ A exp_a(A x) {
  if constexpr (std::is_same_v<A, double>) return exp(x);
  else return expf(x);
}

// Forward, one warp per query row: online softmax over the visible keys, one key at a time.
template <class S>
__global__ void attention_fwd_simple_kernel(SimpleParams p) {
  using T = device_t<S>;
  using A = compute_t<S>;
  const int lane = int(threadIdx.x) % 32;
  const int64_t total = int64_t(p.Tq) * p.H * p.B;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; r < total;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t bh = r / p.Tq, i = r % p.Tq;
    A q[kMaxPerLane], acc[kMaxPerLane];
    load_row(q, row_ptr<T>(p.q, bh, p.H, i), p.D, lane);
#pragma unroll
    for (int c = 0; c < kMaxPerLane; ++c) acc[c] = 0;
    A m = -INFINITY, l = 0;
    for (int64_t j = p.band.key_begin(int(i)), n = p.band.key_end(int(i), p.Tk); j < n; ++j) {
      if (!p.blocks.live(int(i), int(j))) continue;  // (warp-uniform)
      const A s = dot_row(q, row_ptr<T>(p.k, bh, p.H, j), p.D, lane) * A(p.scale) + score_bias<A>(p, bh, i, j);
      if (s == A(-INFINITY)) continue;  // a masked key adds nothing (and m may still be -inf)
      const A mn = s > m ? s : m;
      const A corr = exp_a(m - mn), e = exp_a(s - mn);
      l = l * corr + e;
      m = mn;
      const A z = p.drop.on ? A(dropout_z(p.drop, bh, p.Tq, p.Tk, i, j)) : A(1);
      const T* vr = row_ptr<T>(p.v, bh, p.H, j);
#pragma unroll
      for (int c = 0; c < kMaxPerLane; ++c)
        if (c * 32 + lane < p.D) acc[c] = acc[c] * corr + e * z * convert<A>(vr[c * 32 + lane]);
    }
    T* orow = const_cast<T*>(row_ptr<T>(p.o, bh, p.H, i));
#pragma unroll
    for (int c = 0; c < kMaxPerLane; ++c)
      if (c * 32 + lane < p.D) orow[c * 32 + lane] = convert<T>(l > A(0) ? acc[c] / l : A(0));
    // every key masked: O = 0 and lse = +inf, so that backward's P = exp(S - lse) is 0
    if (lane == 0) static_cast<A*>(p.lse)[r] = l > A(0) ? m + log(l) : A(INFINITY);
  }
}

// dQ, one warp per query row.
template <class S>
__global__ void attention_dq_simple_kernel(SimpleParams p) {
  using T = device_t<S>;
  using A = compute_t<S>;
  const int lane = int(threadIdx.x) % 32;
  const int64_t total = int64_t(p.Tq) * p.H * p.B;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; r < total;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t bh = r / p.Tq, i = r % p.Tq;
    A q[kMaxPerLane], dO[kMaxPerLane], dq[kMaxPerLane];
    load_row(q, row_ptr<T>(p.q, bh, p.H, i), p.D, lane);
    load_row(dO, row_ptr<T>(p.dout, bh, p.H, i), p.D, lane);
#pragma unroll
    for (int c = 0; c < kMaxPerLane; ++c) dq[c] = 0;
    const A lse = static_cast<const A*>(p.lse)[r], Di = static_cast<const A*>(p.dsum)[r];
    for (int64_t j = p.band.key_begin(int(i)), n = p.band.key_end(int(i), p.Tk); j < n; ++j) {
      if (!p.blocks.live(int(i), int(j))) continue;
      const T *kr = row_ptr<T>(p.k, bh, p.H, j), *vr = row_ptr<T>(p.v, bh, p.H, j);
      const A pr = exp_a(dot_row(q, kr, p.D, lane) * A(p.scale) + score_bias<A>(p, bh, i, j) - lse);
      const A z = p.drop.on ? A(dropout_z(p.drop, bh, p.Tq, p.Tk, i, j)) : A(1);
      const A ds = pr * (dot_row(dO, vr, p.D, lane) * z - Di);
#pragma unroll
      for (int c = 0; c < kMaxPerLane; ++c)
        if (c * 32 + lane < p.D) dq[c] += ds * convert<A>(kr[c * 32 + lane]);
    }
    T* out = const_cast<T*>(row_ptr<T>(p.dq, bh, p.H, i));
#pragma unroll
    for (int c = 0; c < kMaxPerLane; ++c)
      if (c * 32 + lane < p.D) out[c * 32 + lane] = convert<T>(dq[c] * A(p.scale));
  }
}

// dK and dV, one warp per key row.
template <class S>
__global__ void attention_dkv_simple_kernel(SimpleParams p) {
  using T = device_t<S>;
  using A = compute_t<S>;
  const int lane = int(threadIdx.x) % 32;
  const int64_t total = int64_t(p.Tk) * p.H * p.B;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; r < total;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t bh = r / p.Tk, j = r % p.Tk;
    A k[kMaxPerLane], v[kMaxPerLane], dk[kMaxPerLane], dv[kMaxPerLane];
    load_row(k, row_ptr<T>(p.k, bh, p.H, j), p.D, lane);
    load_row(v, row_ptr<T>(p.v, bh, p.H, j), p.D, lane);
#pragma unroll
    for (int c = 0; c < kMaxPerLane; ++c) dk[c] = dv[c] = 0;
    for (int64_t i = p.band.query_begin(int(j)), n = p.band.query_end(int(j), p.Tq); i < n; ++i) {
      if (!p.blocks.live(int(i), int(j))) continue;
      const T *qr = row_ptr<T>(p.q, bh, p.H, i), *dor = row_ptr<T>(p.dout, bh, p.H, i);
      const A lse = static_cast<const A*>(p.lse)[bh * p.Tq + i], Di = static_cast<const A*>(p.dsum)[bh * p.Tq + i];
      const A pr = exp_a(dot_row(k, qr, p.D, lane) * A(p.scale) + score_bias<A>(p, bh, i, j) - lse);
      const A z = p.drop.on ? A(dropout_z(p.drop, bh, p.Tq, p.Tk, i, j)) : A(1);
      const A ds = pr * (dot_row(v, dor, p.D, lane) * z - Di);
#pragma unroll
      for (int c = 0; c < kMaxPerLane; ++c)
        if (c * 32 + lane < p.D) {
          dk[c] += ds * convert<A>(qr[c * 32 + lane]);
          dv[c] += pr * z * convert<A>(dor[c * 32 + lane]);
        }
    }
    T* dkr = const_cast<T*>(row_ptr<T>(p.dk, bh, p.H, j));
    T* dvr = const_cast<T*>(row_ptr<T>(p.dv, bh, p.H, j));
#pragma unroll
    for (int c = 0; c < kMaxPerLane; ++c)
      if (c * 32 + lane < p.D) {
        dkr[c * 32 + lane] = convert<T>(dk[c] * A(p.scale));
        dvr[c * 32 + lane] = convert<T>(dv[c]);
      }
  }
}

// Grid for the warp-per-row kernels (grid-stride over rows).
unsigned simple_grid(int64_t rows) { return blocks_for(rows * 32, 256, 65535LL * 4); }

}  // namespace

namespace flash {

void attention_forward_generic(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias, const Tensor& out,
                               const Tensor& lse, KeyBand band, BlockList blocks, double scale,
                               const DropoutArgs& drop) {
  const int B = int(q.size(0)), H = int(q.size(1)), Tq = int(q.size(2)), Tk = int(k.size(2)), D = int(q.size(3));
  SimpleParams p{head_view(q), head_view(k), head_view(v), head_view(out), {}, {}, {}, {}, lse.raw_data(), nullptr,
                 B, H, Tq, Tk, D, scale, band, blocks, drop, bias_view(bias)};
  KILN_CUDA_DISPATCH_FLOATING(q.dtype(), "attention_forward", {
    attention_fwd_simple_kernel<scalar_t><<<simple_grid(int64_t(B) * H * Tq), 256, 0, current_stream()>>>(p);
    KILN_LAUNCH_CHECK("attention_fwd_simple_kernel", "attention_forward");
  });
}

void attention_dsum_generic(const Tensor& dout, const Tensor& out, const Tensor& dsum) {
  const int H = int(out.size(1)), Tq = int(out.size(2)), D = int(out.size(3));
  const int64_t rows = out.size(0) * out.size(1) * out.size(2);
  KILN_CUDA_DISPATCH_FLOATING(out.dtype(), "attention_backward", {
    attention_dsum_kernel<scalar_t><<<blocks_for(rows * 32, 256, 65535LL * 4), 256, 0, current_stream()>>>(
        head_view(dout), head_view(out), static_cast<compute_t<scalar_t>*>(dsum.raw_data()), H, Tq, D, rows);
    KILN_LAUNCH_CHECK("attention_dsum_kernel", "attention_backward");
  });
}

void attention_backward_generic(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& bias, const Tensor& out, const Tensor& lse, const Tensor& dsum, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv, KeyBand band, BlockList blocks, double scale,
                                const DropoutArgs& drop) {
  const int B = int(q.size(0)), H = int(q.size(1)), Tq = int(q.size(2)), Tk = int(k.size(2)), D = int(q.size(3));
  const int64_t rows = int64_t(B) * H * Tq;
  SimpleParams p{head_view(q), head_view(k), head_view(v), head_view(out), head_view(dout), head_view(dq),
                 head_view(dk), head_view(dv), lse.raw_data(), dsum.raw_data(), B, H, Tq, Tk, D, scale, band,
                 blocks, drop, bias_view(bias)};
  KILN_CUDA_DISPATCH_FLOATING(q.dtype(), "attention_backward", {
    if (rows > 0) {
      attention_dq_simple_kernel<scalar_t><<<simple_grid(rows), 256, 0, current_stream()>>>(p);
      KILN_LAUNCH_CHECK("attention_dq_simple_kernel", "attention_backward");
    }
    attention_dkv_simple_kernel<scalar_t><<<simple_grid(int64_t(B) * H * Tk), 256, 0, current_stream()>>>(p);
    KILN_LAUNCH_CHECK("attention_dkv_simple_kernel", "attention_backward");
  });
}

}  // namespace flash

}  // namespace kiln::cuda
