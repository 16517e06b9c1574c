#pragma once
// Helpers shared by the nn tests.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::nn::testing {

inline std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

inline void expect_close(const std::vector<double>& actual, const std::vector<double>& expected, double tol,
                         const std::string& what = "") {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], tol) << what << " element " << i;
  }
}

inline void expect_close(const Tensor& actual, const Tensor& expected, double tol, const std::string& what = "") {
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  expect_close(values(actual), values(expected), tol, what);
}

// Runs fn, expecting a kiln::Error, and returns its message.
template <class Fn>
std::string error_message(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a kiln::Error";
  return "";
}

}  // namespace kiln::nn::testing
