#include <kiln/core/dtype.h>

#include <cmath>
#include <kiln/core/error.h>

namespace kiln {

size_t element_size(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::f16: case DType::bf16: return 2;
    case DType::boolean: case DType::f8e4m3: case DType::f8e5m2: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::boolean: return "bool";
    case DType::f8e4m3: return "f8e4m3";
    case DType::f8e5m2: return "f8e5m2";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::boolean,
                  DType::f8e4m3, DType::f8e5m2})
    if (name == dtype_name(t)) return t;
  KILN_FAIL("dtype_from_name: unknown dtype '", name, "'");
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  KILN_CHECK(!is_fp8(a) && !is_fp8(b), "promote_types: ", dtype_name(a), " and ", dtype_name(b), " do not promote: "
             "FP8 tensors are storage; cast them (to f32 or bf16) before arithmetic");
  auto rank = [](DType t) {
    switch (t) {
      case DType::boolean: return 0;
      case DType::i32: return 1;
      case DType::i64: return 2;
      case DType::f16: case DType::bf16: return 3;
      case DType::f32: return 4;
      case DType::f64: return 5;
      case DType::f8e4m3: case DType::f8e5m2: return 3;  // not reached: refused above
    }
    return 0;
  };
  if ((a == DType::f16 && b == DType::bf16) || (a == DType::bf16 && b == DType::f16)) return DType::f32;
  return rank(a) >= rank(b) ? a : b;
}

namespace {
// The largest finite value of the 16-bit type H strictly below b.
template <class H>
double half_below(double b) {
  H h = H(float(b));
  if (double(float(h)) < b) return double(float(h));
  float f = float(h);
  if (f > 0) --h.bits;
  else if (f == 0) h.bits = 0x8001;  // the smallest negative subnormal
  else ++h.bits;
  return double(float(h));
}
}  // namespace

double largest_below(DType t, double b) {
  switch (t) {
    case DType::f32: {
      float f = float(b);
      return double(f) < b ? double(f) : double(std::nextafter(f, -INFINITY));
    }
    case DType::f16: return half_below<Half>(b);
    case DType::bf16: return half_below<BFloat16>(b);
    default: return std::nextafter(b, -INFINITY);
  }
}

}  // namespace kiln
