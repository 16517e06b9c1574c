#pragma once
// Device-side element types and conversions. Half and BFloat16 share their bit layout with __half and
// __nv_bfloat16, so kernels reinterpret Kiln's storage as CUDA's types and convert with the hardware's
// round-to-nearest-even instructions (the same rounding as core/half.h on the CPU).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <kiln/core/dtype.h>

namespace kiln::cuda {

// The CUDA type stored for a Kiln dtype, and the type arithmetic happens in.
template <class T> struct device_type { using type = T; };
template <> struct device_type<Half> { using type = __half; };
template <> struct device_type<BFloat16> { using type = __nv_bfloat16; };
template <class T> using device_t = typename device_type<T>::type;

template <class T> struct compute_type { using type = float; };
template <> struct compute_type<double> { using type = double; };
template <> struct compute_type<int64_t> { using type = int64_t; };
template <> struct compute_type<int32_t> { using type = int64_t; };
template <> struct compute_type<bool> { using type = int64_t; };
template <class T> using compute_t = typename compute_type<T>::type;

template <class To, class From>
__device__ __forceinline__ To convert(From v) {
  if constexpr (std::is_same_v<To, __half>) return __float2half_rn(float(v));
  else if constexpr (std::is_same_v<To, __nv_bfloat16>) return __float2bfloat16_rn(float(v));
  else if constexpr (std::is_same_v<From, __half>) return To(__half2float(v));
  else if constexpr (std::is_same_v<From, __nv_bfloat16>) return To(__bfloat162float(v));
  else if constexpr (std::is_same_v<To, bool>) return v != From(0);
  else return To(v);
}

// Reads element i of a raw buffer of runtime dtype t as double (for casts; one branch per warp).
__device__ __forceinline__ double load_as_double(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return double(static_cast<const float*>(p)[i]);
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::f16: return double(__half2float(static_cast<const __half*>(p)[i]));
    case DType::bf16: return double(__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]));
    case DType::i32: return double(static_cast<const int32_t*>(p)[i]);
    case DType::i64: return double(static_cast<const int64_t*>(p)[i]);
    case DType::boolean: return static_cast<const bool*>(p)[i] ? 1.0 : 0.0;
    case DType::f8e4m3: return fp8::decode<fp8::E4M3>(static_cast<const uint8_t*>(p)[i]);
    case DType::f8e5m2: return fp8::decode<fp8::E5M2>(static_cast<const uint8_t*>(p)[i]);
  }
  return 0.0;
}

// Whether p is 16-byte aligned (the vectorized paths move 16-byte packs).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace kiln::cuda

// Runs the body with scalar_t bound to the Kiln type of a runtime dtype (device code converts it with
// device_t<scalar_t>).
#define KILN_CUDA_DISPATCH_ALL(dtype, opname, ...) KILN_DISPATCH_ALL(dtype, opname, __VA_ARGS__)
#define KILN_CUDA_DISPATCH_FLOATING(dtype, opname, ...) KILN_DISPATCH_FLOATING(dtype, opname, __VA_ARGS__)
