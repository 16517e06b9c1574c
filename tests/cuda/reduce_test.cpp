// CUDA row reductions (sum, amax, amin, argmax) against the CPU reference, every dtype.
#include <cmath>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "cuda_compare.h"
#include "cuda_test_util.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

Tensor input_of(DType t, const Shape& shape) {
  if (t == DType::boolean) return gt(randn(shape), full({}, 0.3));
  if (t == DType::i32 || t == DType::i64) return cast(mul(randn(shape, {.dtype = DType::f64}), 3.0), t);  // many ties
  return rand_cpu(shape, t);
}

// Sums are checked against rtol * |ref| plus the f32 accumulation error bound over Σ|x|.
void expect_sum_close(const Tensor& x, const std::vector<int64_t>& dims, const std::string& what) {
  Tensor ref = sum(x, dims), got = sum(x.to(gpu()), dims);
  ASSERT_EQ(ref.dtype(), got.dtype()) << what;
  if (!is_floating(x.dtype())) {
    EXPECT_EQ(ref.to_vector<int64_t>(), got.cpu().to_vector<int64_t>()) << what;
    return;
  }
  std::vector<double> r = ref.to_vector<double>(), g = got.cpu().to_vector<double>();
  std::vector<double> a = sum(abs(cast(x, DType::f64)), dims).to_vector<double>();
  double acc_eps = x.dtype() == DType::f64 ? 1e-14 : 1e-6;
  for (size_t i = 0; i < r.size(); ++i)
    ASSERT_LE(std::abs(g[i] - r[i]), rtol_of(x.dtype()) * std::abs(r[i]) + acc_eps * a[i] + 1e-30)
        << what << " row " << i << ": ref " << r[i] << " cuda " << g[i];
}

const DType kAll[] = {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::boolean};

}  // namespace

TEST(CudaReduce, AllOpsAllDtypesManyShortRows) {
  KILN_REQUIRE_GPU();
  manual_seed(1);
  for (DType t : kAll)
    for (Shape shape : std::vector<Shape>{{37, 19}, {129, 1}, {7, 1000}, {513, 333}}) {
      Tensor x = input_of(t, shape);
      std::string what = name(t) + " " + shape_str(shape);
      Tensor xd = x.to(gpu());
      expect_sum_close(x, {1}, "sum " + what);
      expect_close(amax(x, {1}), amax(xd, {1}), "amax " + what, 0.0);
      expect_close(amin(x, {1}), amin(xd, {1}), "amin " + what, 0.0);
      EXPECT_EQ(argmax(x, 1).to_vector<int64_t>(), argmax(xd, 1).cpu().to_vector<int64_t>()) << "argmax " << what;
    }
}

TEST(CudaReduce, LongRowsUseTwoPassesAndAreDeterministic) {
  KILN_REQUIRE_GPU();
  manual_seed(2);
  for (DType t : kAll)
    for (Shape shape : std::vector<Shape>{{3, 400001}, {1, 1 << 21}, {40, 70000}}) {
      Tensor x = input_of(t, shape);
      std::string what = name(t) + " " + shape_str(shape);
      Tensor xd = x.to(gpu());
      expect_sum_close(x, {1}, "sum " + what);
      expect_close(amax(x, {1}), amax(xd, {1}), "amax " + what, 0.0);
      expect_close(amin(x, {1}), amin(xd, {1}), "amin " + what, 0.0);
      EXPECT_EQ(argmax(x, 1).to_vector<int64_t>(), argmax(xd, 1).cpu().to_vector<int64_t>()) << "argmax " << what;
      if (is_floating(t)) {
        // no float atomics: the same input gives the same bits every run
        EXPECT_EQ(sum(xd, {1}).cpu().to_vector<double>(), sum(xd, {1}).cpu().to_vector<double>()) << what;
      }
    }
}

// all_true on the GPU (the booleans' minimum read in place) as on the CPU: each dtype, a zero or a NaN at the
// last place of a long tensor (the two-pass reduction), a strided view.
TEST(CudaReduce, AllTrueMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  for (DType t : kAll) {
    Tensor x = ones({5 << 20}, {.dtype = t});
    EXPECT_TRUE(all_true(x.to(gpu()))) << name(t);
    x.narrow(0, (5 << 20) - 1, 1).fill_(0.0);
    EXPECT_FALSE(all_true(x.to(gpu()))) << name(t);
    EXPECT_TRUE(all_true(x.narrow(0, 0, (5 << 20) - 1).to(gpu()))) << name(t);
  }
  Tensor f = ones({1000, 3}).to(gpu());
  f.select(0, 999).select(0, 1).fill_(NAN);
  EXPECT_TRUE(all_true(f));
  EXPECT_FALSE(all_true(isfinite(f)));
  EXPECT_TRUE(all_true(isfinite(f.narrow(1, 0, 1))));  // a strided column without it
  EXPECT_TRUE(all_true(zeros({0}).to(gpu())));
}

TEST(CudaReduce, WholeTensorAndNonContiguousDims) {
  KILN_REQUIRE_GPU();
  manual_seed(3);
  for (DType t : {DType::f32, DType::bf16, DType::i64}) {
    Tensor x = input_of(t, {6, 1500, 130});  // > 1M elements
    Tensor xd = x.to(gpu());
    expect_sum_close(x, {}, "sum all " + name(t));
    expect_sum_close(x, {0, 2}, "sum dims 0,2 " + name(t));     // permuted to rows by the entry point
    expect_sum_close(x.transpose(0, 2), {1}, "sum of a transposed view " + name(t));
    expect_close(amax(x, {0}), amax(xd, {0}), "amax dim 0 " + name(t), 0.0);
    EXPECT_EQ(argmax(x, 0).to_vector<int64_t>(), argmax(xd, 0).cpu().to_vector<int64_t>()) << name(t);
    EXPECT_EQ(argmax(x.reshape({-1}), 0).to_vector<int64_t>(), argmax(xd.reshape({-1}), 0).cpu().to_vector<int64_t>());
  }
}

TEST(CudaReduce, NaNWinsMaxMinArgmaxAsOnTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(4);
  for (int64_t R : {17, 5000, 300000}) {
    Tensor x = randn({4, R});
    float* p = x.data_ptr<float>();
    p[1 * R + R / 3] = NAN;  // row 1: one NaN
    p[2 * R + 2] = NAN;      // row 2: two NaNs, the first one wins argmax
    p[2 * R + R - 1] = NAN;
    p[3 * R + R / 2] = INFINITY;
    Tensor xd = x.to(gpu());
    std::string what = "R=" + std::to_string(R);
    expect_close(amax(x, {1}), amax(xd, {1}), "amax " + what, 0.0);
    expect_close(amin(x, {1}), amin(xd, {1}), "amin " + what, 0.0);
    EXPECT_EQ(argmax(x, 1).to_vector<int64_t>(), argmax(xd, 1).cpu().to_vector<int64_t>()) << what;
    std::vector<double> s = sum(xd, {1}).cpu().to_vector<double>();
    EXPECT_TRUE(std::isnan(s[1]) && std::isnan(s[2]) && std::isinf(s[3])) << what;
  }
}

TEST(CudaReduce, MeanAndSumBackward) {
  KILN_REQUIRE_GPU();
  manual_seed(5);
  Tensor x = randn({33, 77});
  Tensor xd = x.to(gpu());
  expect_sum_close(x, {0}, "sum dim 0");
  // sum's backward only expands the gradient: check it flows to a CUDA leaf
  Tensor leaf = xd.detach();
  leaf.requires_grad_(true);
  Tensor s = sum(leaf, {1});
  Tensor g = randn({33});
  s.backward(g.to(gpu()));
  expect_close(g.reshape({33, 1}).expand({33, 77}).contiguous(), leaf.grad().contiguous(), "sum backward");
}

// Sums over leading dims of a contiguous f32/f64 tensor (a broadcast's gradient, e.g. a position
// embedding's over the batch) take the column kernel; the results match the CPU, with and without keepdim.
TEST(CudaReduce, SumOverLeadingDimsReadsColumnsInPlace) {
  KILN_REQUIRE_GPU();
  manual_seed(61);
  for (DType t : {DType::f32, DType::f64}) {
    Tensor x = rand_cpu({16, 33, 70}, t);
    Tensor xg = x.to(gpu());
    expect_close(sum(x, {0}), sum(xg, {0}), "sum over dim 0 " + name(t));
    expect_close(sum(x, {0, 1}), sum(xg, {0, 1}), "sum over dims 0, 1 " + name(t));
    expect_close(sum(x, {0}, true), sum(xg, {0}, true), "sum over dim 0 keepdim " + name(t));
    Tensor wide = rand_cpu({8, 512, 384}, t);  // few rows of many columns (f32: 4 columns a thread)
    expect_close(sum(wide, {0}), sum(wide.to(gpu()), {0}), "sum of 8 wide rows " + name(t));
    Tensor tall = rand_cpu({3000, 5}, t);  // many rows per column
    expect_close(sum(tall, {0}), sum(tall.to(gpu()), {0}), "sum of 3000 rows " + name(t));
  }
}

TEST(CudaReduce, CumsumMatchesTheCpuForIntegersAndLongScans) {
  KILN_REQUIRE_GPU();
  // i64 (exact), and an f32 scan along a long middle dim with many columns (the coalesced layout).
  Tensor ints = cast(mul(randn({3, 1000, 5}, {.dtype = DType::f64}), 1000.0), DType::i64);
  for (int64_t dim : {0, 1, 2})
    for (const bool exclusive : {false, true})
      for (const bool reverse : {false, true})
        EXPECT_EQ(cumsum(ints.to(gpu()), dim, exclusive, reverse).cpu().to_vector<int64_t>(),
                  cumsum(ints, dim, exclusive, reverse).to_vector<int64_t>())
            << dim << (exclusive ? " exclusive" : "") << (reverse ? " reverse" : "");
  Tensor flags = gt(randn({4, 300}), full({}, 0.0));
  EXPECT_EQ(cumsum(flags.to(gpu()), 1).cpu().to_vector<int64_t>(), cumsum(flags, 1).to_vector<int64_t>());
  Tensor x = randn({2, 4096, 96});
  const std::vector<double> want = cumsum(cast(x, DType::f64), 1).to_vector<double>();
  const std::vector<double> got = cast(cumsum(x.to(gpu()), 1).cpu(), DType::f64).to_vector<double>();
  // The bound of a running f32 sum: after i + 1 terms the error is at most (i + 1) u Σ_{j<=i} |x_j|,
  // u = 2^-24 (the CPU sums in double, which is exact here to that order).
  const std::vector<double> mass = cumsum(abs(cast(x, DType::f64)), 1).to_vector<double>();
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;  // error over the bound
  for (size_t e = 0; e < got.size(); ++e) {
    const double terms = double((e / 96) % 4096 + 1);
    worst = std::max(worst, std::abs(got[e] - want[e]) / (terms * std::ldexp(1.0, -24) * mass[e] + 1e-12));
  }
  EXPECT_LE(worst, 1.0) << "f32 running sums over up to 4096 terms exceed the rounding bound";
}
