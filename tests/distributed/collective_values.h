#pragma once
// The values the collective tests of both backends exchange, and the checks they share: element i of rank
// r is value(r, i), small integers exact in every dtype, so every expected result is exact.
#include <gtest/gtest.h>

#include <vector>

#include <kiln/core/ops.h>
#include <kiln/distributed/process_group.h>

namespace kiln::testing {

inline double collective_value(int r, int64_t i) { return double((i * 3 + r * 5) % 17) - 8.0; }

inline Tensor collective_values(int r, int64_t n, DType t, Device device, int64_t offset = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = collective_value(r, offset + i);
  return cast(from_vector(v, {n}), t).to(device);
}

// reduce_scatter (sum) in place: the output is this rank's slice of the input.
inline void expect_reduce_scatter_in_place(distributed::ProcessGroup& pg, int64_t len, DType t) {
  const int n = pg.size();
  Tensor in = collective_values(pg.rank(), n * len, t, pg.device());
  pg.reduce_scatter(in.narrow(0, pg.rank() * len, len), in, distributed::ReduceOp::sum);
  const std::vector<double> got = cast(in.narrow(0, pg.rank() * len, len).cpu(), DType::f64).to_vector<double>();
  for (int64_t i = 0; i < len; ++i) {
    double sum = 0;
    for (int r = 0; r < n; ++r) sum += collective_value(r, pg.rank() * len + i);
    ASSERT_EQ(got[size_t(i)], sum) << dtype_name(t) << " element " << i;
  }
}

}  // namespace kiln::testing
