// Elementwise CUDA kernels: fill, unary, binary and where, with the semantics of the CPU reference
// (core/cpu/elementwise.cpp).
//
// Math. out[i] = op(x[i]) | op(a[i], b[i]) | cond[i] ? a[i] : b[i]. NaN propagates through maximum and
// minimum (a NaN `a` wins, else the NaN `b` does) and passes clamp unchanged; gelu is exact, x Φ(x)
// (f32: a branch-free erfc with relative error ~1e-7, see normal_cdf); comparisons and isfinite write
// bool. f32/f16/bf16 compute in f32 and f64 in f64. Integer and bool tensors compute in f64, as
// the CPU (which converts everything to double) does, so they agree bit for bit; ops with a double
// scalar (x + s, x * s, x / s, s - x, s / x, clamp) round exactly like the CPU too (see
// KILN_EW_SCALAR_CASE).
//
// Bytes moved (n = output elements): fill n·out; unary n·(in + out); binary n·(a + b + out), a broadcast
// row or scalar operand read once from cache; where n·(1 + a|b + out). Every path is coalesced.
//
// Paths, picked on the host:
//   contiguous  every operand contiguous in one float dtype, 16-byte aligned: 16-byte packs (4 f32,
//               8 f16/bf16, 2 f64) per thread and a scalar tail; the op switch runs once per pack.
//   broadcast   binary, output in the operands' dtype, one operand contiguous and the other a row (N)
//               repeated over rows, a column (M, 1) repeated over columns, or a scalar: packs for the
//               contiguous operand and the output, the broadcast one read per element (L1-resident).
//   strided     anything else: per-element offsets of any view, output dtype chosen at runtime (bool,
//               or f32 for float ops on integers).
#include <cmath>
#include <cstring>

#include <kiln/core/half.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/gelu.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>
#include <kiln/cuda/strided.cuh>

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

// ---------------------------------------------------------------- types and conversions

// The type elementwise math runs in: f32 for f32/f16/bf16; f64 for f64 and for integers and bool (the
// CPU's arithmetic, exactly).
template <class D> struct ew_acc { using type = double; };
template <> struct ew_acc<float> { using type = float; };
template <> struct ew_acc<__half> { using type = float; };
template <> struct ew_acc<__nv_bfloat16> { using type = float; };
template <class D> using acc_t = typename ew_acc<D>::type;

template <class C, class D>
__device__ __forceinline__ C to_acc(D v) {
  if constexpr (std::is_same_v<D, __half>) return C(__half2float(v));
  else if constexpr (std::is_same_v<D, __nv_bfloat16>) return C(__bfloat162float(v));
  else return C(v);
}

// Writes v into element i of a contiguous buffer of runtime dtype t, rounding as the CPU's store does.
__device__ __forceinline__ void store_dyn(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = float(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    case DType::f16: static_cast<__half*>(p)[i] = __float2half_rn(float(v)); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(float(v)); break;
    case DType::i32: static_cast<int32_t*>(p)[i] = int32_t(v); break;
    case DType::i64: static_cast<int64_t*>(p)[i] = int64_t(v); break;
    case DType::boolean: static_cast<bool*>(p)[i] = v != 0.0; break;
    case DType::f8e4m3: static_cast<uint8_t*>(p)[i] = fp8::encode<fp8::E4M3>(v); break;  // core/float8.h's,
    case DType::f8e5m2: static_cast<uint8_t*>(p)[i] = fp8::encode<fp8::E5M2>(v); break;  // as on the CPU
  }
}

// Offset of the i-th element of a view; one multiply for the common one-dim (merged) case.
__device__ __forceinline__ int64_t offset_of(const StridedArg& a, int64_t i) {
  return a.ndim == 1 ? i * a.strides[0] : element_offset(a, i);
}

// 16 bytes of D: the unit of the vectorized paths.
template <class D>
struct Pack {
  static constexpr int kWidth = 16 / sizeof(D);
  D v[kWidth];
};

template <class D>
__device__ __forceinline__ Pack<D> load_pack(const D* p, int64_t pack) {
  uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + pack);
  Pack<D> r;
  memcpy(&r, &raw, 16);
  return r;
}

template <class D>
__device__ __forceinline__ void store_pack(D* p, int64_t pack, const Pack<D>& v) {
  uint4 raw;
  memcpy(&raw, &v, 16);
  reinterpret_cast<uint4*>(p)[pack] = raw;
}

// ---------------------------------------------------------------- the ops

// Float math overloads, so one template serves f32 and f64.
__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_sin(float x) { return sinf(x); }  // full-range (not __sinf): rotary angles grow
__device__ __forceinline__ double m_sin(double x) { return sin(x); }
__device__ __forceinline__ float m_cos(float x) { return cosf(x); }
__device__ __forceinline__ double m_cos(double x) { return cos(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }

constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;  // 1/sqrt(2π)
constexpr double kLog2e = 1.4426950408889634;

// std::max / std::min exactly (they keep the first argument on ties and unordered compares).
template <class T>
__device__ __forceinline__ T std_max(T a, T b) { return a < b ? b : a; }
template <class T>
__device__ __forceinline__ T std_min(T a, T b) { return b < a ? b : a; }

// Φ(x), the standard normal CDF, without cancellation in the left tail (where (1 + erf(x/√2)) / 2
// keeps only erf's absolute accuracy: a 10% relative error at x = -5 in f32).
// f64: erfc(-x/√2) / 2. f32: Numerical Recipes' erfcc, erfc(z) = t exp(-z² - 1.26551223 + t P(t)),
// t = 1 / (1 + z/2), a Chebyshev fit with relative error < 1.2e-7 for every z >= 0, taken at z = |x|/√2:
// Φ(x) = erfc(z)/2 for x < 0 and 1 - erfc(z)/2 otherwise. One expf and one reciprocal, branch-free:
// about half the instructions of erff/erfcf (whose branches diverge on mixed-sign data), which is what
// keeps gelu at the memory-bandwidth bound in bf16; z² = x²/2 enters exactly (x² split into hi + lo).
__device__ __forceinline__ double normal_cdf(double x) { return 0.5 * erfc(-x * kInvSqrt2); }
__device__ __forceinline__ float normal_cdf(float x) {
  // beyond |x| = 20, Φ is 0 or 1 in f32; clamping keeps x² finite (NaN stays NaN)
  x = x < -20.0f ? -20.0f : (x > 20.0f ? 20.0f : x);
  const float t = __fdividef(1.0f, fmaf(fabsf(x), float(0.5 * kInvSqrt2), 1.0f));
  float p = fmaf(t, 0.17087277f, -0.82215223f);
  p = fmaf(t, p, 1.48851587f);
  p = fmaf(t, p, -1.13520398f);
  p = fmaf(t, p, 0.27886807f);
  p = fmaf(t, p, -0.18628806f);
  p = fmaf(t, p, 0.09678418f);
  p = fmaf(t, p, 0.37409196f);
  p = fmaf(t, p, 1.00002368f);
  p = fmaf(t, p, -1.26551223f);
  // exp(-x²/2 + p) as exp2 of (-x²/2 + p) log2(e): one MUFU.EX2, ~1e-6 relative at the far tail
  const float x2 = x * x, x2_lo = fmaf(x, x, -x2);
  const float l2 = fmaf(float(-0.5 * kLog2e), x2, fmaf(float(-0.5 * kLog2e), x2_lo, p * float(kLog2e)));
  const float half_erfc = 0.5f * t * exp2f(l2);
  return x < 0.0f ? half_erfc : 1.0f - half_erfc;
}

// exp(-y²/2), the unnormalized normal density.
__device__ __forceinline__ float gauss(float y) { return exp2f(float(-0.5 * kLog2e) * (y * y)); }
__device__ __forceinline__ double gauss(double y) { return exp(-0.5 * y * y); }

// Ops with double scalars (p0, p1): when the scalars are exactly representable in the compute type C,
// C arithmetic rounds exactly like the CPU's double arithmetic followed by one rounding into C (double
// has more than 2·24 + 2 bits, so +, -, ·, / of two floats rounded via double equal the float result);
// otherwise they compute in double. `exact` picks the path once per pack, outside the loop.
#define KILN_EW_CASE(OP, EXPR)                      \
  case OP:                                          \
    _Pragma("unroll") for (int k = 0; k < V; ++k) { \
      C v = x[k];                                   \
      x[k] = (EXPR);                                \
    }                                               \
    break;
#define KILN_EW_SCALAR_CASE(OP, FAST, EXACT)          \
  case OP:                                            \
    if (!kDoubleScalars || exact) {                   \
      const C s0 = C(p0), s1 = C(p1);                 \
      _Pragma("unroll") for (int k = 0; k < V; ++k) { \
        C v = x[k];                                   \
        x[k] = (FAST);                                \
      }                                               \
      (void)s1;                                       \
    } else {                                          \
      _Pragma("unroll") for (int k = 0; k < V; ++k) { \
        double v = double(x[k]);                      \
        x[k] = C(EXACT);                              \
      }                                               \
    }                                                 \
    break;

// x[k] = op(x[k]) for a pack of V values; the switch is outside the loop over the pack.
template <class C, int V, bool kDoubleScalars>
__device__ __forceinline__ void apply_unary(UnaryOp op, C (&x)[V], double p0, double p1) {
  const C one = C(1), zero = C(0);
  const bool exact = double(C(p0)) == p0 && double(C(p1)) == p1;
  switch (op) {
    KILN_EW_CASE(UnaryOp::neg, -v)
    KILN_EW_CASE(UnaryOp::exp, m_exp(v))
    KILN_EW_CASE(UnaryOp::log, m_log(v))
    KILN_EW_CASE(UnaryOp::sqrt, m_sqrt(v))
    KILN_EW_CASE(UnaryOp::rsqrt, one / m_sqrt(v))
    KILN_EW_CASE(UnaryOp::tanh, m_tanh(v))
    KILN_EW_CASE(UnaryOp::sigmoid, one / (one + m_exp(-v)))
    KILN_EW_CASE(UnaryOp::relu, v <= zero ? zero : v)  // NaN stays NaN, as in PyTorch
    KILN_EW_CASE(UnaryOp::gelu, v * normal_cdf(v))
    KILN_EW_CASE(UnaryOp::gelu_tanh, gelu_tanh(v))
    KILN_EW_CASE(UnaryOp::abs, m_abs(v))
    KILN_EW_CASE(UnaryOp::sign, C(int(v > zero) - int(v < zero)))
    KILN_EW_CASE(UnaryOp::square, v * v)
    KILN_EW_CASE(UnaryOp::isfinite, isfinite(v) ? one : zero)
    KILN_EW_CASE(UnaryOp::sin, m_sin(v))
    KILN_EW_CASE(UnaryOp::cos, m_cos(v))
    // x^p with a C exponent when p is one, the CPU's double exponent otherwise
    KILN_EW_SCALAR_CASE(UnaryOp::pow_scalar, p0 == 2.0 ? v * v : m_pow(v, s0), pow(v, p0))
    KILN_EW_SCALAR_CASE(UnaryOp::clamp, isnan(v) ? v : std_min(std_max(v, s0), s1),
                        isnan(v) ? v : std_min(std_max(v, p0), p1))
    KILN_EW_SCALAR_CASE(UnaryOp::add_scalar, v + s0, v + p0)
    KILN_EW_SCALAR_CASE(UnaryOp::mul_scalar, v * s0, v * p0)
    KILN_EW_SCALAR_CASE(UnaryOp::div_scalar, v / s0, v / p0)
    KILN_EW_SCALAR_CASE(UnaryOp::rsub_scalar, s0 - v, p0 - v)
    KILN_EW_SCALAR_CASE(UnaryOp::rdiv_scalar, s0 / v, p0 / v)
  }
}
#undef KILN_EW_CASE
#undef KILN_EW_SCALAR_CASE

// a[k] = op(a[k], b[k]).
#define KILN_EW_CASE(OP, EXPR)                      \
  case OP:                                          \
    _Pragma("unroll") for (int k = 0; k < V; ++k) { \
      C x = a[k], y = b[k];                         \
      a[k] = (EXPR);                                \
    }                                               \
    break;

template <class C, int V>
__device__ __forceinline__ void apply_binary(BinaryOp op, C (&a)[V], const C (&b)[V]) {
  const C one = C(1), half = C(0.5), zero = C(0);
  switch (op) {
    KILN_EW_CASE(BinaryOp::add, x + y)
    KILN_EW_CASE(BinaryOp::sub, x - y)
    KILN_EW_CASE(BinaryOp::mul, x * y)
    KILN_EW_CASE(BinaryOp::div, x / y)
    KILN_EW_CASE(BinaryOp::pow, m_pow(x, y))
    KILN_EW_CASE(BinaryOp::maximum, (isnan(x) || x >= y) ? x : y)
    KILN_EW_CASE(BinaryOp::minimum, (isnan(x) || x <= y) ? x : y)
    KILN_EW_CASE(BinaryOp::eq, x == y ? one : zero)
    KILN_EW_CASE(BinaryOp::ne, x != y ? one : zero)
    KILN_EW_CASE(BinaryOp::lt, x < y ? one : zero)
    KILN_EW_CASE(BinaryOp::le, x <= y ? one : zero)
    KILN_EW_CASE(BinaryOp::gt, x > y ? one : zero)
    KILN_EW_CASE(BinaryOp::ge, x >= y ? one : zero)
    KILN_EW_CASE(BinaryOp::relu_backward, y > zero ? x : zero)
    // d/dx x Φ(x) = Φ(x) + x φ(x)
    KILN_EW_CASE(BinaryOp::gelu_backward, x * (normal_cdf(y) + y * C(kInvSqrt2Pi) * gauss(y)))
    KILN_EW_CASE(BinaryOp::gelu_tanh_backward, x * gelu_tanh_grad(y))
    KILN_EW_CASE(BinaryOp::tanh_backward, x * (one - y * y))
    KILN_EW_CASE(BinaryOp::sigmoid_backward, x * (y * (one - y)))
  }
}
#undef KILN_EW_CASE

// ---------------------------------------------------------------- kernels

__device__ __forceinline__ int64_t thread_index() { return blockIdx.x * int64_t(blockDim.x) + threadIdx.x; }
__device__ __forceinline__ int64_t thread_count() { return int64_t(gridDim.x) * blockDim.x; }

// Fills nbytes from 16-byte-aligned p with a 16-byte pattern (the element's bytes repeated).
__global__ void fill_pattern_kernel(uint8_t* p, uint4 pattern, int64_t nbytes) {
  int64_t packs = nbytes / 16;
  for (int64_t i = thread_index(); i < packs; i += thread_count()) reinterpret_cast<uint4*>(p)[i] = pattern;
  int64_t t = thread_index(), tail = nbytes - packs * 16;
  if (t < tail) {
    uint8_t bytes[16];
    memcpy(bytes, &pattern, 16);
    p[packs * 16 + t] = bytes[t];
  }
}

// Fills any view with one word of the element's size.
template <class W>
__global__ void fill_words_kernel(W* p, StridedArg a, W value, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) p[offset_of(a, i)] = value;
}

// Contiguous kernels move two packs per thread and loop step (kUnroll), both loads issued before any
// math: a one-stream kernel needs that many bytes in flight per thread to saturate HBM.
constexpr int kUnroll = 2;

template <class D>
__global__ void unary_contiguous_kernel(UnaryOp op, const D* __restrict__ in, D* __restrict__ out, int64_t n, double p0,
                                        double p1) {
  using C = acc_t<D>;
  constexpr int V = Pack<D>::kWidth;
  const int64_t packs = n / V, step = thread_count();
  for (int64_t p = thread_index(); p < packs; p += kUnroll * step) {
    Pack<D> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (p + u * step < packs) v[u] = load_pack(in, p + u * step);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (p + u * step >= packs) break;
      C x[V];
#pragma unroll
      for (int k = 0; k < V; ++k) x[k] = to_acc<C>(v[u].v[k]);
      apply_unary<C, V, false>(op, x, p0, p1);
#pragma unroll
      for (int k = 0; k < V; ++k) v[u].v[k] = convert<D>(x[k]);
      store_pack(out, p + u * step, v[u]);
    }
  }
  int64_t t = packs * V + thread_index();
  if (t < n) {
    C x[1] = {to_acc<C>(in[t])};
    apply_unary<C, 1, false>(op, x, p0, p1);
    out[t] = convert<D>(x[0]);
  }
}

// Any input view; the output is contiguous, of the input's storage type (out_same) or of dtype ot.
template <class D>
__global__ void unary_strided_kernel(UnaryOp op, const D* in, StridedArg ia, void* out, DType ot, bool out_same,
                                     int64_t n, double p0, double p1) {
  using C = acc_t<D>;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    C x[1] = {to_acc<C>(in[offset_of(ia, i)])};
    apply_unary<C, 1, true>(op, x, p0, p1);
    if (out_same) static_cast<D*>(out)[i] = convert<D>(x[0]);
    else store_dyn(out, ot, i, double(x[0]));
  }
}

template <class D>
__global__ void binary_contiguous_kernel(BinaryOp op, const D* __restrict__ a, const D* __restrict__ b,
                                         D* __restrict__ out, int64_t n) {
  using C = acc_t<D>;
  constexpr int V = Pack<D>::kWidth;
  const int64_t packs = n / V;
  for (int64_t p = thread_index(); p < packs; p += thread_count()) {
    Pack<D> va = load_pack(a, p), vb = load_pack(b, p);
    C x[V], y[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      x[k] = to_acc<C>(va.v[k]);
      y[k] = to_acc<C>(vb.v[k]);
    }
    apply_binary<C, V>(op, x, y);
#pragma unroll
    for (int k = 0; k < V; ++k) va.v[k] = convert<D>(x[k]);
    store_pack(out, p, va);
  }
  int64_t t = packs * V + thread_index();
  if (t < n) {
    C x[1] = {to_acc<C>(a[t])}, y[1] = {to_acc<C>(b[t])};
    apply_binary<C, 1>(op, x, y);
    out[t] = convert<D>(x[0]);
  }
}

// How the broadcast operand is read for one pack of V output elements.
enum class BroadcastRead : int {
  pack,  // a row with N % V == 0, 16-byte aligned: r[c, c + V) is one aligned pack
  one,   // a column with N % V == 0, or a scalar: one value serves the whole pack
  each,  // otherwise: element by element (the row index wraps inside the pack)
};

// (q, c) = divmod(i, N); 32-bit division (a few instructions, not the ~70 of 64-bit) when n fits.
__device__ __forceinline__ void divmod(int64_t i, int64_t N, bool small, int64_t& q, int64_t& c) {
  if (small) {
    uint32_t qq = uint32_t(i) / uint32_t(N);
    q = qq;
    c = int64_t(uint32_t(i) - qq * uint32_t(N));
  } else {
    q = i / N;
    c = i - q * N;
  }
}

// x contiguous, r broadcast: element i of the output reads r[i mod N] (row) or r[i / N] (column);
// a scalar is a row with N = 1. r_is_a says which operand of op the broadcast one is.
template <class D>
__global__ void binary_broadcast_kernel(BinaryOp op, const D* __restrict__ x, const D* __restrict__ r, bool column,
                                        BroadcastRead mode, bool r_is_a, D* __restrict__ out, int64_t n, int64_t N) {
  using C = acc_t<D>;
  constexpr int V = Pack<D>::kWidth;
  const int64_t packs = n / V, step = thread_count();
  const bool small = n <= int64_t(UINT32_MAX);
  for (int64_t p = thread_index(); p < packs; p += kUnroll * step) {
    Pack<D> vx[kUnroll], vr[kUnroll];
    int64_t q[kUnroll], c[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t pu = p + u * step;
      if (pu >= packs) break;
      vx[u] = load_pack(x, pu);
      divmod(pu * V, N, small, q[u], c[u]);
      if (mode == BroadcastRead::pack) vr[u] = load_pack(r, c[u] / V);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t pu = p + u * step;
      if (pu >= packs) break;
      C rv[V];
      if (mode == BroadcastRead::pack) {
#pragma unroll
        for (int k = 0; k < V; ++k) rv[k] = to_acc<C>(vr[u].v[k]);
      } else if (mode == BroadcastRead::one) {
        const C v = to_acc<C>(__ldg(r + (column ? q[u] : c[u])));
#pragma unroll
        for (int k = 0; k < V; ++k) rv[k] = v;
      } else {
        int64_t qq = q[u], cc = c[u];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          rv[k] = to_acc<C>(__ldg(r + (column ? qq : cc)));
          if (++cc == N) {
            cc = 0;
            ++qq;
          }
        }
      }
      C a[V], b[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const C xv = to_acc<C>(vx[u].v[k]);
        a[k] = r_is_a ? rv[k] : xv;
        b[k] = r_is_a ? xv : rv[k];
      }
      apply_binary<C, V>(op, a, b);
#pragma unroll
      for (int k = 0; k < V; ++k) vx[u].v[k] = convert<D>(a[k]);
      store_pack(out, pu, vx[u]);
    }
  }
  int64_t t = packs * V + thread_index();
  if (t < n) {
    C xv = to_acc<C>(x[t]), rv = to_acc<C>(r[column ? t / N : t % N]);
    C a[1] = {r_is_a ? rv : xv}, b[1] = {r_is_a ? xv : rv};
    apply_binary<C, 1>(op, a, b);
    out[t] = convert<D>(a[0]);
  }
}

template <class D>
__global__ void binary_strided_kernel(BinaryOp op, const D* a, StridedArg sa, const D* b, StridedArg sb, void* out,
                                      DType ot, bool out_same, int64_t n) {
  using C = acc_t<D>;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    C x[1] = {to_acc<C>(a[offset_of(sa, i)])}, y[1] = {to_acc<C>(b[offset_of(sb, i)])};
    apply_binary<C, 1>(op, x, y);
    if (out_same) static_cast<D*>(out)[i] = convert<D>(x[0]);
    else store_dyn(out, ot, i, double(x[0]));
  }
}

// out = cond ? a : b moves words: a and b already have out's dtype, so no value is converted.
template <class W>
__global__ void where_kernel(const bool* cond, StridedArg sc, const W* a, StridedArg sa, const W* b, StridedArg sb,
                             W* __restrict__ out, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const uint8_t c = reinterpret_cast<const uint8_t*>(cond)[offset_of(sc, i)];
    out[i] = c != 0 ? a[offset_of(sa, i)] : b[offset_of(sb, i)];
  }
}

// ---------------------------------------------------------------- launchers

bool takes_scalars(UnaryOp op) {
  switch (op) {
    case UnaryOp::pow_scalar: case UnaryOp::clamp: case UnaryOp::add_scalar: case UnaryOp::mul_scalar:
    case UnaryOp::div_scalar: case UnaryOp::rsub_scalar: case UnaryOp::rdiv_scalar: return true;
    default: return false;
  }
}

bool is_float_dtype(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16; }

// The value as stored in dtype t, with the CPU's conversions (core/cpu/strided.cpp, from_double).
uint64_t value_bits(DType t, double v) {
  uint64_t bits = 0;
  switch (t) {
    case DType::f32: { float f = float(v); std::memcpy(&bits, &f, 4); break; }
    case DType::f64: std::memcpy(&bits, &v, 8); break;
    case DType::f16: bits = Half(float(v)).bits; break;
    case DType::bf16: bits = BFloat16(float(v)).bits; break;
    case DType::i32: { int32_t i = static_cast<int32_t>(v); std::memcpy(&bits, &i, 4); break; }
    case DType::i64: { int64_t i = static_cast<int64_t>(v); std::memcpy(&bits, &i, 8); break; }
    case DType::boolean: bits = v != 0.0 ? 1 : 0; break;
    case DType::f8e4m3: bits = fp8::encode<fp8::E4M3>(v); break;
    case DType::f8e5m2: bits = fp8::encode<fp8::E5M2>(v); break;
  }
  return bits;
}

template <class W>
void launch_fill_words(const Tensor& dst, uint64_t bits) {
  int64_t n = dst.numel();
  fill_words_kernel<W><<<blocks_for(n, kThreads), kThreads, 0, current_stream()>>>(
      static_cast<W*>(dst.raw_data()), strided_arg(dst), W(bits), n);
  KILN_LAUNCH_CHECK("fill_words_kernel", "fill");
}

// The broadcast shape of a binary operand that the broadcast kernel reads directly.
struct BroadcastOperand {
  bool ok = false, column = false;
  int64_t inner = 1;  // N: row length (row), or elements per column value (column)
};

BroadcastOperand classify_broadcast(const Tensor& t) {
  StridedArg s = strided_arg(t);
  BroadcastOperand r;
  if (s.ndim == 1 && s.strides[0] == 0) r.ok = true;  // scalar
  else if (s.ndim == 2 && s.strides[0] == 0 && s.strides[1] == 1) r = {true, false, s.sizes[1]};
  else if (s.ndim == 2 && s.strides[0] == 1 && s.strides[1] == 0) r = {true, true, s.sizes[1]};
  return r;
}

}  // namespace

void kernels::fill(const Tensor& dst, double value) {
  NvtxRange range("fill");
  int64_t n = dst.numel();
  if (n == 0) return;
  KILN_CHECK(dst.device().is_cuda(), "fill: expected a CUDA tensor, got ", dst.str());
  DeviceGuard guard(dst.device().index);
  const uint64_t bits = value_bits(dst.dtype(), value);
  const size_t es = dst.element_size();
  if (dst.is_contiguous()) {
    if (bits == 0 || es == 1) {
      KILN_CUDA_CHECK(cudaMemsetAsync(dst.raw_data(), int(bits & 0xff), size_t(n) * es, current_stream()));
      return;
    }
    if (aligned16(dst.raw_data())) {
      uint8_t pat[16];
      for (size_t i = 0; i < 16; ++i) pat[i] = uint8_t(bits >> (8 * (i % es)));  // little-endian element bytes
      uint4 pattern;
      std::memcpy(&pattern, pat, 16);
      int64_t nbytes = n * int64_t(es);
      fill_pattern_kernel<<<blocks_for(nbytes / 16 + 1, kThreads), kThreads, 0, current_stream()>>>(
          static_cast<uint8_t*>(dst.raw_data()), pattern, nbytes);
      KILN_LAUNCH_CHECK("fill_pattern_kernel", "fill");
      return;
    }
  }
  switch (es) {
    case 1: return launch_fill_words<uint8_t>(dst, bits);
    case 2: return launch_fill_words<uint16_t>(dst, bits);
    case 4: return launch_fill_words<uint32_t>(dst, bits);
    case 8: return launch_fill_words<uint64_t>(dst, bits);
  }
}

void kernels::unary(UnaryOp op, const Tensor& in, const Tensor& out, double p0, double p1) {
  NvtxRange range("unary");
  KILN_CHECK(in.device().is_cuda() && in.device() == out.device(), "unary: tensors on different devices: ", in.str(),
             " and ", out.str());
  KILN_CHECK(in.sizes() == out.sizes() && out.is_contiguous(), "unary: output ", out.str(),
             " must be contiguous with the input's shape ", in.str());
  int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(out.device().index);
  const bool same = in.dtype() == out.dtype();
  // The vector path applies scalars in the compute type: only where that is exact (see KILN_EW_SCALAR_CASE).
  const bool scalars_exact = in.dtype() == DType::f64 || !takes_scalars(op) ||
                             (double(float(p0)) == p0 && double(float(p1)) == p1);
  if (same && is_float_dtype(in.dtype()) && scalars_exact && in.is_contiguous() && aligned16(in.raw_data()) &&
      aligned16(out.raw_data())) {
    KILN_CUDA_DISPATCH_FLOATING(in.dtype(), "unary", {
      using D = device_t<scalar_t>;
      unary_contiguous_kernel<D><<<blocks_for(n / (kUnroll * Pack<D>::kWidth) + 1, kThreads), kThreads, 0,
                                   current_stream()>>>(
          op, static_cast<const D*>(in.raw_data()), static_cast<D*>(out.raw_data()), n, p0, p1);
      KILN_LAUNCH_CHECK("unary_contiguous_kernel", "unary");
    });
    return;
  }
  KILN_CUDA_DISPATCH_ALL(in.dtype(), "unary", {
    using D = device_t<scalar_t>;
    unary_strided_kernel<D><<<blocks_for(n, kThreads), kThreads, 0, current_stream()>>>(
        op, static_cast<const D*>(in.raw_data()), strided_arg(in), out.raw_data(), out.dtype(), same, n, p0, p1);
    KILN_LAUNCH_CHECK("unary_strided_kernel", "unary");
  });
}

void kernels::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  NvtxRange range("binary");
  KILN_CHECK(a.device().is_cuda() && a.device() == b.device() && a.device() == out.device(),
             "binary: tensors on different devices: ", a.str(), ", ", b.str(), " and ", out.str());
  KILN_CHECK(a.dtype() == b.dtype(), "binary: operands must share a dtype, got ", a.str(), " and ", b.str());
  KILN_CHECK(out.dtype() == a.dtype() || out.dtype() == DType::boolean, "binary: output ", out.str(),
             " must have the operands' dtype or bool (operands ", a.str(), ")");
  KILN_CHECK(a.sizes() == out.sizes() && b.sizes() == out.sizes() && out.is_contiguous(), "binary: operands ", a.str(),
             " and ", b.str(), " must be expanded to the contiguous output ", out.str());
  int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(out.device().index);
  const bool same = out.dtype() == a.dtype();
  if (same && is_float_dtype(a.dtype()) && aligned16(out.raw_data())) {
    const bool ac = a.is_contiguous() && aligned16(a.raw_data()), bc = b.is_contiguous() && aligned16(b.raw_data());
    if (ac && bc) {
      KILN_CUDA_DISPATCH_FLOATING(a.dtype(), "binary", {
        using D = device_t<scalar_t>;
        binary_contiguous_kernel<D><<<blocks_for(n / Pack<D>::kWidth + 1, kThreads), kThreads, 0, current_stream()>>>(
            op, static_cast<const D*>(a.raw_data()), static_cast<const D*>(b.raw_data()), static_cast<D*>(out.raw_data()),
            n);
        KILN_LAUNCH_CHECK("binary_contiguous_kernel", "binary");
      });
      return;
    }
    BroadcastOperand bo;
    if (ac || bc) bo = classify_broadcast(ac ? b : a);
    if (bo.ok) {
      const Tensor& x = ac ? a : b;
      const Tensor& r = ac ? b : a;
      KILN_CUDA_DISPATCH_FLOATING(a.dtype(), "binary", {
        using D = device_t<scalar_t>;
        const int64_t V = Pack<D>::kWidth;
        BroadcastRead mode = BroadcastRead::each;
        if (!bo.column && bo.inner % V == 0 && aligned16(r.raw_data())) mode = BroadcastRead::pack;
        else if ((bo.column && bo.inner % V == 0) || (!bo.column && bo.inner == 1)) mode = BroadcastRead::one;
        binary_broadcast_kernel<D><<<blocks_for(n / (kUnroll * V) + 1, kThreads), kThreads, 0, current_stream()>>>(
            op, static_cast<const D*>(x.raw_data()), static_cast<const D*>(r.raw_data()), bo.column, mode, !ac,
            static_cast<D*>(out.raw_data()), n, bo.inner);
        KILN_LAUNCH_CHECK("binary_broadcast_kernel", "binary");
      });
      return;
    }
  }
  KILN_CUDA_DISPATCH_ALL(a.dtype(), "binary", {
    using D = device_t<scalar_t>;
    binary_strided_kernel<D><<<blocks_for(n, kThreads), kThreads, 0, current_stream()>>>(
        op, static_cast<const D*>(a.raw_data()), strided_arg(a), static_cast<const D*>(b.raw_data()), strided_arg(b),
        out.raw_data(), out.dtype(), same, n);
    KILN_LAUNCH_CHECK("binary_strided_kernel", "binary");
  });
}

void kernels::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  NvtxRange range("where");
  KILN_CHECK(cond.device().is_cuda() && cond.device() == out.device() && a.device() == out.device() &&
                 b.device() == out.device(),
             "where: tensors on different devices: ", cond.str(), ", ", a.str(), ", ", b.str(), " and ", out.str());
  KILN_CHECK(cond.dtype() == DType::boolean, "where: condition must be bool, got ", cond.str());
  KILN_CHECK(a.dtype() == out.dtype() && b.dtype() == out.dtype(), "where: operands ", a.str(), " and ", b.str(),
             " must have the output's dtype ", out.str());
  KILN_CHECK(cond.sizes() == out.sizes() && a.sizes() == out.sizes() && b.sizes() == out.sizes() && out.is_contiguous(),
             "where: operands must be expanded to the contiguous output ", out.str());
  int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(out.device().index);
  auto launch = [&](auto word) {
    using W = decltype(word);
    where_kernel<W><<<blocks_for(n, kThreads), kThreads, 0, current_stream()>>>(
        static_cast<const bool*>(cond.raw_data()), strided_arg(cond), static_cast<const W*>(a.raw_data()),
        strided_arg(a), static_cast<const W*>(b.raw_data()), strided_arg(b), static_cast<W*>(out.raw_data()), n);
    KILN_LAUNCH_CHECK("where_kernel", "where");
  };
  switch (out.element_size()) {
    case 1: return launch(uint8_t{});
    case 2: return launch(uint16_t{});
    case 4: return launch(uint32_t{});
    case 8: return launch(uint64_t{});
  }
}

}  // namespace kiln::cuda
