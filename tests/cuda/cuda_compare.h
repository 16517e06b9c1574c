#pragma once
// CPU-vs-CUDA comparison helpers for the kernel tests: random inputs made on the CPU (never zeros), and
// element-wise closeness with dtype-fitting tolerances.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/core/tensor.h>

namespace kiln::testing {

inline Device gpu() { return Device::cuda(0); }

// Relative tolerance of one dtype: about two units in the last place for f16/bf16 (both sides round
// once to the dtype from slightly different f32/f64 values).
inline double rtol_of(DType t) {
  switch (t) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-5;
    case DType::f16: return 2e-3;
    case DType::bf16: return 1.6e-2;
    default: return 0.0;
  }
}

// randn(shape) * scale on the CPU, cast to dtype.
inline Tensor rand_cpu(const Shape& shape, DType t, double scale = 1.0) {
  return cast(mul(randn(shape, {.dtype = DType::f64}), scale), t);
}

// |gpu - ref| <= rtol * (|ref| + floor_scale * max|ref|) element-wise; NaN must match NaN.
// Integers and bool must match exactly.
inline void expect_close(const Tensor& ref, const Tensor& got, const std::string& what, double rtol = -1,
                         double floor_scale = 0.1) {
  ASSERT_EQ(ref.sizes(), got.sizes()) << what;
  ASSERT_EQ(ref.dtype(), got.dtype()) << what;
  std::vector<double> r = ref.to_vector<double>(), g = got.cpu().to_vector<double>();
  if (rtol < 0) rtol = rtol_of(ref.dtype());
  double maxabs = 0;
  for (double v : r)
    if (std::isfinite(v)) maxabs = std::max(maxabs, std::abs(v));
  int64_t bad = 0, first = -1;
  double worst = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    bool ok;
    if (std::isnan(r[i]) || std::isnan(g[i])) ok = std::isnan(r[i]) && std::isnan(g[i]);
    else if (std::isinf(r[i]) || std::isinf(g[i])) ok = r[i] == g[i];
    else {
      double err = std::abs(g[i] - r[i]);
      ok = err <= rtol * (std::abs(r[i]) + floor_scale * maxabs);
      worst = std::max(worst, err / (std::abs(r[i]) + floor_scale * maxabs + 1e-300));
    }
    if (!ok && bad++ == 0) first = int64_t(i);
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << r.size() << " elements differ; first at " << first << " (ref "
                    << (first >= 0 ? r[size_t(first)] : 0.0) << ", cuda " << (first >= 0 ? g[size_t(first)] : 0.0)
                    << "), worst scaled error " << worst << " vs rtol " << rtol;
}

inline std::string name(DType t) { return dtype_name(t); }

}  // namespace kiln::testing
