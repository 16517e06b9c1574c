#pragma once
// Small helpers shared by the core, autograd and ops tests: error-message checks and approximate
// comparison of tensor values against naive references computed in double.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include <kiln/core/error.h>
#include <kiln/core/tensor.h>

namespace kiln::test {

// Runs fn and succeeds when it throws kiln::Error whose message contains every substring.
inline ::testing::AssertionResult ThrowsKilnError(const std::function<void()>& fn,
                                                  std::initializer_list<std::string> substrings = {}) {
  try {
    fn();
  } catch (const kiln::Error& e) {
    std::string msg = e.what();
    for (const auto& s : substrings)
      if (msg.find(s) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << s << "\"";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-kiln exception: " << e.what();
  } catch (...) {
    return ::testing::AssertionFailure() << "threw a non-std exception";
  }
  return ::testing::AssertionFailure() << "did not throw";
}

#define EXPECT_KILN_ERROR(stmt, ...) \
  EXPECT_TRUE(::kiln::test::ThrowsKilnError([&] { (void)(stmt); }, {__VA_ARGS__}))

// |a - e| <= atol + rtol |e| elementwise (NaN only matches NaN, inf only the same inf).
inline ::testing::AssertionResult AllClose(const std::vector<double>& actual, const std::vector<double>& expected,
                                           double atol, double rtol = 0.0) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure() << "size " << actual.size() << " vs expected " << expected.size();
  for (size_t i = 0; i < actual.size(); ++i) {
    double a = actual[i], e = expected[i];
    bool ok;
    if (std::isnan(e)) ok = std::isnan(a);
    else if (std::isinf(e)) ok = a == e;
    else ok = std::fabs(a - e) <= atol + rtol * std::fabs(e);
    if (!ok) return ::testing::AssertionFailure() << "element " << i << ": " << a << " vs expected " << e;
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult TensorClose(const Tensor& t, const Shape& shape, const std::vector<double>& expected,
                                              double atol, double rtol = 0.0) {
  if (t.sizes() != shape) return ::testing::AssertionFailure() << "shape " << shape_str(t.sizes()) << " vs " << shape_str(shape);
  return AllClose(t.to_vector<double>(), expected, atol, rtol);
}

// Absolute tolerance that fits values of magnitude ~1 computed in dtype t.
inline double tol_for(DType t) {
  switch (t) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-5;
    case DType::f16: return 4e-3;
    case DType::bf16: return 3e-2;
    default: return 0.0;
  }
}

// Row-major strides / multi-index helpers for naive references.
inline std::vector<int64_t> row_major_strides(const Shape& s) {
  std::vector<int64_t> st(s.size());
  int64_t acc = 1;
  for (int64_t d = int64_t(s.size()) - 1; d >= 0; --d) {
    st[size_t(d)] = acc;
    acc *= s[size_t(d)];
  }
  return st;
}

}  // namespace kiln::test
