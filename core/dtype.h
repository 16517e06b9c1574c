#pragma once
// Runtime element types. Reductions and matmuls accumulate in at least f32 whatever the storage type.
#include <cstddef>
#include <cstdint>
#include <string>

#include <kiln/core/float8.h>
#include <kiln/core/half.h>

namespace kiln {

// f8e4m3 and f8e5m2 (core/float8.h) are storage formats: they cast to and from the others (saturating), copy,
// print and go into checkpoints; arithmetic happens after a cast to f32/bf16 (promote_types refuses them).
enum class DType : uint8_t { f32, f64, f16, bf16, i32, i64, boolean, f8e4m3, f8e5m2 };

size_t element_size(DType t);
const char* dtype_name(DType t);     // "f32", "f64", ...
DType dtype_from_name(const std::string& name);  // inverse of dtype_name; throws on unknown names
inline bool is_fp8(DType t) { return t == DType::f8e4m3 || t == DType::f8e5m2; }
inline bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16 || is_fp8(t);
}
inline bool is_integral(DType t) { return !is_floating(t); }
// The dtype of statistics saved for inputs of dtype t (layer norm's mean and rstd, cross-entropy's lse,
// attention's lse): f64 for f64, f32 otherwise.
inline DType stat_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }
// Result dtype of a binary op between tensors of these dtypes (float beats int; wider beats narrower;
// f16 with bf16 gives f32). An FP8 dtype with any other is an error (cast first), as in PyTorch.
DType promote_types(DType a, DType b);
// The largest value of floating dtype t strictly below b: where a uniform draw in [a, b) goes when
// rounding it into t would give b (every device uses it, so their draws stay identical).
double largest_below(DType t, double b);

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<Half> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::boolean; };
template <> struct dtype_of<Float8E4M3> { static constexpr DType value = DType::f8e4m3; };
template <> struct dtype_of<Float8E5M2> { static constexpr DType value = DType::f8e5m2; };

}  // namespace kiln

// Runs the body with `scalar_t` bound to the C++ type of a runtime dtype.
#define KILN_DTYPE_CASE(DT, T, ...) \
  case ::kiln::DType::DT: {         \
    using scalar_t = T;             \
    __VA_ARGS__;                    \
    break;                          \
  }
#define KILN_DISPATCH_ALL(dtype, opname, ...)                                   \
  switch (dtype) {                                                              \
    KILN_DTYPE_CASE(f32, float, __VA_ARGS__)                                    \
    KILN_DTYPE_CASE(f64, double, __VA_ARGS__)                                   \
    KILN_DTYPE_CASE(f16, ::kiln::Half, __VA_ARGS__)                             \
    KILN_DTYPE_CASE(bf16, ::kiln::BFloat16, __VA_ARGS__)                        \
    KILN_DTYPE_CASE(i32, int32_t, __VA_ARGS__)                                  \
    KILN_DTYPE_CASE(i64, int64_t, __VA_ARGS__)                                  \
    KILN_DTYPE_CASE(boolean, bool, __VA_ARGS__)                                 \
    default: KILN_FAIL(opname, ": unsupported dtype");                          \
  }
#define KILN_DISPATCH_FLOATING(dtype, opname, ...)                              \
  switch (dtype) {                                                              \
    KILN_DTYPE_CASE(f32, float, __VA_ARGS__)                                    \
    KILN_DTYPE_CASE(f64, double, __VA_ARGS__)                                   \
    KILN_DTYPE_CASE(f16, ::kiln::Half, __VA_ARGS__)                             \
    KILN_DTYPE_CASE(bf16, ::kiln::BFloat16, __VA_ARGS__)                        \
    default: KILN_FAIL(opname, ": expected a floating-point dtype, got ", ::kiln::dtype_name(dtype)); \
  }
