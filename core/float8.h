#pragma once
// 8-bit floating-point storage types of the OCP FP8 specification (OFP8, 2023), as Hopper's tensor cores
// and Transformer Engine use them:
//   e4m3 (E4M3, PyTorch's float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; NaN
//        is S.1111.111; largest finite 448 (S.1111.110); smallest normal 2^-6, smallest subnormal 2^-9.
//   e5m2 (E5M2): 1 sign, 5 exponent (bias 15), 2 mantissa bits, IEEE-like: infinities S.11111.00, NaNs
//        S.11111.{01,10,11}; largest finite 57344; smallest normal 2^-14, smallest subnormal 2^-16.
// Storage only, as core/half.h's types: arithmetic happens in float or double. Conversion to FP8 rounds to
// nearest, ties to even, and saturates ("satfinite", as cuda_fp8.h's __NV_SATFINITE and Transformer Engine's
// casts): a finite value beyond the largest, and an infinity, become the largest finite value of its sign;
// NaN stays NaN (e4m3 0x7F, e5m2 0x7E, with the sign kept). The same functions run on the CPU and in CUDA
// kernels, so both give identical bits.
#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define KILN_FP8_HD __host__ __device__
#else
#define KILN_FP8_HD
#endif

namespace kiln {

namespace fp8 {

// The sign bit and NaN-ness from the bits (the same on the host and in device code, where <cmath>'s std::
// functions are not all available); frexp, ldexp and nearbyint are the C library's, which CUDA provides on
// the device.
KILN_FP8_HD inline uint64_t bits_of(double v) {
  uint64_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
}
KILN_FP8_HD inline bool negative(double v) { return bits_of(v) >> 63; }
KILN_FP8_HD inline bool not_a_number(double v) {
  const uint64_t u = bits_of(v);
  return (u & 0x7FF0000000000000ull) == 0x7FF0000000000000ull && (u & 0x000FFFFFFFFFFFFFull) != 0;
}

// An FP8 format: exponent and mantissa widths, and whether the all-ones exponent holds infinities and NaNs
// (e5m2, IEEE-like) or only the one NaN per sign with the rest finite (e4m3).
template <int E, int M, bool IEEE>
struct Format {
  static constexpr int exponent_bits = E, mantissa_bits = M, bias = (1 << (E - 1)) - 1;
  static constexpr bool ieee = IEEE;
  // the largest finite magnitude's code: e4m3 S.1111.110, e5m2 S.11110.11
  static constexpr uint8_t max_code = IEEE ? uint8_t(((((1 << E) - 2) << M) | ((1 << M) - 1)))
                                           : uint8_t((((1 << E) - 1) << M) | ((1 << M) - 2));
  static constexpr uint8_t nan_code = IEEE ? uint8_t((((1 << E) - 1) << M) | (1 << (M - 1))) : uint8_t(0x7F);
};
using E4M3 = Format<4, 3, false>;
using E5M2 = Format<5, 2, true>;

template <class F>
KILN_FP8_HD inline double decode(uint8_t bits) {
  const bool negative = bits & 0x80;
  const int e = (bits >> F::mantissa_bits) & ((1 << F::exponent_bits) - 1);
  const int m = bits & ((1 << F::mantissa_bits) - 1);
  const int all_ones = (1 << F::exponent_bits) - 1;
  double v;
  if (F::ieee && e == all_ones) v = m == 0 ? HUGE_VAL : double(NAN);  // ±inf, NaN
  else if (!F::ieee && e == all_ones && m == (1 << F::mantissa_bits) - 1) v = double(NAN);
  else if (e == 0) v = ::ldexp(double(m), 1 - F::bias - F::mantissa_bits);  // subnormal
  else v = ::ldexp(double(m + (1 << F::mantissa_bits)), e - F::bias - F::mantissa_bits);
  return negative ? -v : v;
}

// Round to nearest even, saturating (see above).
template <class F>
KILN_FP8_HD inline uint8_t encode(double v) {
  const uint8_t sign = negative(v) ? 0x80 : 0x00;
  if (not_a_number(v)) return uint8_t(sign | F::nan_code);
  const double a = negative(v) ? -v : v;
  if (a >= decode<F>(F::max_code)) return uint8_t(sign | F::max_code);  // beyond the largest, or infinite
  if (a == 0) return sign;
  // the quantum of a's binade (the subnormals' below the smallest normal); a / quantum is exact, and its
  // nearest-even integer n gives the code as exponent·2^M + (n - 2^M), which carries into the exponent
  // when the rounding reaches the next binade
  int k = 0;
  (void)::frexp(a, &k);  // a = f·2^k, f in [0.5, 1)
  const int unbiased = k - 1 < 1 - F::bias ? 1 - F::bias : k - 1;
  const double quantum = ::ldexp(1.0, unbiased - F::mantissa_bits);
  const double n = ::nearbyint(a / quantum);  // ties to even (the default rounding mode)
  int code;
  if (k - 1 < 1 - F::bias) code = int(n);  // subnormal; n = 2^M is the smallest normal's code
  else code = ((unbiased + F::bias) << F::mantissa_bits) + (int(n) - (1 << F::mantissa_bits));
  if (code > F::max_code) code = F::max_code;  // rounded past the largest finite value
  return uint8_t(sign | code);
}

// The same code from an f32 value, in f32 arithmetic (what a GPU kernel quantizing floats wants: no double
// math). Every step is exact for a float input (the quantum is a power of two within float's range, a /
// quantum a scaling by it, the rounding to an integer exact), so the code is encode<F>(double(v))'s.
template <class F>
KILN_FP8_HD inline uint8_t encode_f32(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  const uint8_t sign = (u >> 31) ? 0x80 : 0x00;
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0) return uint8_t(sign | F::nan_code);
  const float a = sign ? -v : v;
  if (a >= float(decode<F>(F::max_code))) return uint8_t(sign | F::max_code);
  if (a == 0) return sign;
  int k = 0;
  (void)::frexpf(a, &k);
  const int unbiased = k - 1 < 1 - F::bias ? 1 - F::bias : k - 1;
  const float quantum = ::ldexpf(1.0f, unbiased - F::mantissa_bits);
  const float n = ::nearbyintf(a / quantum);
  int code;
  if (k - 1 < 1 - F::bias) code = int(n);
  else code = ((unbiased + F::bias) << F::mantissa_bits) + (int(n) - (1 << F::mantissa_bits));
  if (code > F::max_code) code = F::max_code;
  return uint8_t(sign | code);
}

}  // namespace fp8

// An FP8 value of format F (fp8::E4M3 or fp8::E5M2); conversions are explicit (storage, not arithmetic).
template <class F>
struct Float8 {
  uint8_t bits = 0;
  Float8() = default;
  KILN_FP8_HD explicit Float8(double v) : bits(fp8::encode<F>(v)) {}
  KILN_FP8_HD explicit operator double() const { return fp8::decode<F>(bits); }
  KILN_FP8_HD explicit operator float() const { return float(fp8::decode<F>(bits)); }
  static Float8 from_bits(uint8_t b) {
    Float8 x;
    x.bits = b;
    return x;
  }
};
using Float8E4M3 = Float8<fp8::E4M3>;
using Float8E5M2 = Float8<fp8::E5M2>;

}  // namespace kiln
