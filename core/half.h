#pragma once
// 16-bit floating-point storage types. Arithmetic happens in float: these types only convert.
// Conversions from float round to nearest, ties to even, as IEEE 754 and CUDA's __float2half_rn /
// __float2bfloat16_rn do, so CPU and GPU produce identical bits.
#include <cstdint>
#include <cstring>

namespace kiln {

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bfloat16: the top 16 bits of an IEEE float32.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  BFloat16(float f) {  // NOLINT(google-explicit-constructor): behaves like a float
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = uint16_t((u >> 16) | 0x40); return; }  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    bits = uint16_t(u >> 16);
  }
  operator float() const { return bits_float(uint32_t(bits) << 16); }  // NOLINT
};

// IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits.
struct Half {
  uint16_t bits = 0;
  Half() = default;
  Half(float f) { bits = from_float(f); }  // NOLINT
  operator float() const { return to_float(bits); }  // NOLINT

  static uint16_t from_float(float f) {
    uint32_t u = float_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
    if (a >= 0x47800000u) {  // >= 65536: overflow unless it rounds down to 65504
      // values in [65504, 65520) round to 65504; anything larger is inf
      return uint16_t(sign | (a < 0x477ff000u ? 0x7bffu : 0x7c00u));
    }
    if (a < 0x38800000u) {  // subnormal half (|f| < 2^-14): scale to units of 2^-24, round to even
      float v = bits_float(a) * 16777216.0f;  // exact: a power-of-two scale
      uint32_t r = uint32_t(v);
      float frac = v - float(r);
      if (frac > 0.5f || (frac == 0.5f && (r & 1u))) ++r;
      return uint16_t(sign | r);
    }
    // normal: rebias exponent 127 -> 15 and round the 13 dropped mantissa bits to even
    uint32_t h = a - 0x38000000u;
    h += 0x0fffu + ((h >> 13) & 1u);
    return uint16_t(sign | (h >> 13));
  }
  static float to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
      float v = float(m) * 5.9604644775390625e-8f;  // m * 2^-24
      return sign ? -v : v;
    }
    if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
    return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  }
};

}  // namespace kiln
