// Matrix functions (core/linalg.h) on the CPU: the eigendecomposition reconstructs its input with
// orthonormal vectors and ascending values, batched = one by one; inverse roots satisfy Xᵖ·(A + ε·I) = I on
// random SPD matrices of sizes 1..1024, match a root built from known eigenvalues on ill-conditioned
// (condition 1e8) matrices, handle singular and indefinite ones by the ε rule, and the Newton iteration
// agrees with the eigen method (falling back to it, or failing, when it does not converge); bad input is
// an error.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/linalg.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "core_test_util.h"

namespace kiln {
namespace {

using linalg::InverseRootOptions;
using linalg::RootMethod;

Tensor f64(const Shape& s, Generator& gen) { return randn(s, {.dtype = DType::f64}, &gen); }
Tensor symmetric(const Tensor& g) { return mul(add(g, g.transpose(-2, -1)), 0.5); }
// A random SPD matrix (batch): G Gᵀ / n + I / 10, condition at most a few hundred
Tensor spd(const Shape& s, Generator& gen) {
  const Tensor g = f64(s, gen);
  const int64_t n = s.back();
  return add(div(matmul(g, g.transpose(-2, -1)), double(n)), mul(linalg::eye(n, {.dtype = DType::f64}), 0.1));
}
double max_abs(const Tensor& t) { return amax(abs(t)).item<double>(); }
Tensor power(const Tensor& x, int p) {
  Tensor r = x;
  for (int i = 1; i < p; ++i) r = matmul(r, x);
  return r;
}
// Q diag(values) Qᵀ with a random orthogonal Q
Tensor with_eigenvalues(const std::vector<double>& values, Generator& gen, Tensor* q_out = nullptr) {
  const int64_t n = int64_t(values.size());
  const Tensor q = linalg::eigh(symmetric(f64({n, n}, gen))).eigenvectors;
  if (q_out) *q_out = q;
  return matmul(mul(q, from_vector(values, {1, n})), q.transpose(0, 1));
}

TEST(LinalgEigh, ReconstructsWithOrthonormalVectorsAndAscendingValues) {
  Generator gen(1);
  for (int64_t n : {1, 2, 7, 64}) {
    const Tensor a = symmetric(f64({n, n}, gen));
    const auto [w, v] = linalg::eigh(a);
    ASSERT_EQ(w.sizes(), (Shape{n}));
    ASSERT_EQ(v.sizes(), (Shape{n, n}));
    EXPECT_LT(max_abs(sub(matmul(mul(v, w.unsqueeze(0)), v.transpose(0, 1)), a)), 1e-12 * n) << n;
    EXPECT_LT(max_abs(sub(matmul(v.transpose(0, 1), v), linalg::eye(n, {.dtype = DType::f64}))), 1e-13 * n) << n;
    const std::vector<double> values = w.contiguous().to_vector<double>();
    for (size_t i = 1; i < values.size(); ++i) EXPECT_LE(values[i - 1], values[i]);
  }
}

TEST(LinalgEigh, ReadsTheLowerTriangleOnly) {
  const Tensor lower = tensor({2.0, 0.0, 1.0, 3.0}, {2, 2}, {.dtype = DType::f64});  // [[2, ·], [1, 3]]
  const Tensor full_matrix = tensor({2.0, 1.0, 1.0, 3.0}, {2, 2}, {.dtype = DType::f64});
  EXPECT_EQ(linalg::eigh(lower).eigenvalues.to_vector<double>(),
            linalg::eigh(full_matrix).eigenvalues.to_vector<double>());
}

TEST(LinalgEigh, BatchedEqualsOneByOneAndF32AgreesWithF64) {
  Generator gen(2);
  const Tensor a = symmetric(f64({3, 2, 5, 5}, gen));
  const auto [w, v] = linalg::eigh(a);
  ASSERT_EQ(w.sizes(), (Shape{3, 2, 5}));
  ASSERT_EQ(v.sizes(), (Shape{3, 2, 5, 5}));
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 2; ++j) {
      const auto one = linalg::eigh(a.narrow(0, i, 1).narrow(1, j, 1).reshape({5, 5}));
      EXPECT_EQ(w.narrow(0, i, 1).narrow(1, j, 1).contiguous().to_vector<double>(),
                one.eigenvalues.contiguous().to_vector<double>());
      // eigenvectors up to sign: |vᵀ v_one| = 1 column by column
      const Tensor dots = sum(mul(v.narrow(0, i, 1).narrow(1, j, 1).reshape({5, 5}), one.eigenvectors), {0});
      EXPECT_LT(max_abs(sub(abs(dots), ones({5}, {.dtype = DType::f64}))), 1e-12);
    }
  const Tensor w32 = linalg::eigh(cast(a, DType::f32)).eigenvalues;
  EXPECT_EQ(w32.dtype(), DType::f32);
  EXPECT_LT(max_abs(sub(cast(w32, DType::f64), w)), 1e-5);
}

TEST(LinalgInverseRoot, RaisedToPTimesTheRidgedMatrixIsTheIdentity) {
  Generator gen(3);
  for (int64_t n : {1, 2, 17, 128, 1024}) {
    const Tensor a = spd({n, n}, gen);
    const Tensor id = linalg::eye(n, {.dtype = DType::f64});
    for (int p : {2, 4}) {
      if (n == 1024 && p == 2) continue;  // one root of the largest size is enough for the CPU
      const Tensor x = linalg::inverse_root(a, p, {.epsilon = 1e-12});
      EXPECT_LT(max_abs(sub(x, x.transpose(0, 1))), 1e-12) << "symmetric, n " << n;
      EXPECT_LT(max_abs(sub(matmul(power(x, p), add(a, mul(id, 1e-12))), id)), 1e-9) << "n " << n << " p " << p;
    }
  }
}

TEST(LinalgInverseRoot, IllConditionedMatricesMatchTheRootOfTheirKnownEigenvalues) {
  Generator gen(4);
  const int64_t n = 48;
  std::vector<double> values(n), roots(n);
  for (int64_t i = 0; i < n; ++i) {
    values[size_t(i)] = std::pow(10.0, -8.0 * double(i) / double(n - 1));  // 1 .. 1e-8: condition 1e8
    roots[size_t(i)] = std::pow(values[size_t(i)], -0.25);
  }
  Tensor q;
  const Tensor a = with_eigenvalues(values, gen, &q);
  const Tensor expected = matmul(mul(q, from_vector(roots, {1, n})), q.transpose(0, 1));
  const double scale = max_abs(expected);  // 1e2
  const Tensor eigen = linalg::inverse_root(a, 4, {.epsilon = 0.0});
  EXPECT_LT(max_abs(sub(eigen, expected)) / scale, 1e-6);
  const auto newton = linalg::inverse_root_ex(a, 4, {.epsilon = 0.0, .method = RootMethod::newton, .max_iterations = 300});
  EXPECT_LT(max_abs(sub(newton.root, expected)) / scale, 1e-6) << newton.iterations << " iterations, "
                                                                << newton.fallbacks << " fallbacks";
}

TEST(LinalgInverseRoot, SingularAndIndefiniteMatricesFollowTheEpsilonRule) {
  Generator gen(5);
  // singular: rank 8 of 16; with ε the ridged matrix is definite and its root exact
  const Tensor b = f64({16, 8}, gen);
  const Tensor singular = matmul(b, b.transpose(0, 1));
  const Tensor id = linalg::eye(16, {.dtype = DType::f64});
  const Tensor x = linalg::inverse_root(singular, 2, {.epsilon = 1e-4});
  EXPECT_LT(max_abs(sub(matmul(power(x, 2), add(singular, mul(id, 1e-4))), id)), 1e-8);
  // indefinite: diag(4, −0.5) with ε = 0.1 is ridged to (4.1, −0.4); λ_min < ε lifts both by 0.5 to
  // (4.6, 0.1), whose inverse square roots are the result's diagonal
  const Tensor d = tensor({4.0, 0.0, 0.0, -0.5}, {2, 2}, {.dtype = DType::f64});
  EXPECT_TRUE(test::AllClose(linalg::inverse_root(d, 2, {.epsilon = 0.1}).contiguous().to_vector<double>(),
                             {1 / std::sqrt(4.6), 0.0, 0.0, 1 / std::sqrt(0.1)}, 1e-14, 1e-14));
  // all zero: ε·I alone
  EXPECT_TRUE(test::AllClose(linalg::inverse_root(zeros({2, 2}, {.dtype = DType::f64}), 4, {.epsilon = 1e-8})
                                 .contiguous()
                                 .to_vector<double>(),
                             {100.0, 0.0, 0.0, 100.0}, 0.0, 1e-12));
}

TEST(LinalgInverseRoot, NewtonAgreesWithEigenBatchedAndInF32) {
  Generator gen(6);
  const Tensor a = spd({3, 32, 32}, gen);
  const Tensor eigen = linalg::inverse_root(a, 4);
  const auto newton = linalg::inverse_root_ex(a, 4, {.method = RootMethod::newton});
  EXPECT_GT(newton.iterations, 0);
  EXPECT_EQ(newton.fallbacks, 0);
  ASSERT_EQ(newton.residual.sizes(), (Shape{3}));
  for (double r : newton.residual.contiguous().to_vector<double>()) EXPECT_LE(r, 1e-10);
  EXPECT_LT(max_abs(sub(newton.root, eigen)), 1e-8);
  // batched = one by one, to the tolerance (the batch iterates until its slowest matrix converges)
  for (int64_t i = 0; i < 3; ++i)
    EXPECT_LT(max_abs(sub(newton.root.narrow(0, i, 1).reshape({32, 32}),
                          linalg::inverse_root(a.narrow(0, i, 1).reshape({32, 32}), 4, {.method = RootMethod::newton}))),
              1e-9);
  const Tensor a32 = cast(a, DType::f32);
  for (RootMethod m : {RootMethod::eigen, RootMethod::newton}) {
    const Tensor x = linalg::inverse_root(a32, 4, {.method = m});
    EXPECT_EQ(x.dtype(), DType::f32);
    EXPECT_LT(max_abs(sub(cast(x, DType::f64), eigen)) / max_abs(eigen), 1e-4) << int(m);
  }
}

TEST(LinalgInverseRoot, NewtonThatDoesNotConvergeFallsBackOrFails) {
  Generator gen(7);
  const Tensor a = spd({2, 12, 12}, gen);
  const auto r = linalg::inverse_root_ex(a, 4, {.method = RootMethod::newton, .max_iterations = 2});
  EXPECT_EQ(r.iterations, 2);
  EXPECT_EQ(r.fallbacks, 2);
  EXPECT_LT(max_abs(sub(r.root, linalg::inverse_root(a, 4))), 1e-12);
  EXPECT_KILN_ERROR(linalg::inverse_root(a, 4, {.method = RootMethod::newton, .max_iterations = 2, .fallback = false}),
                    "linalg::inverse_root", "newton", "2 of 2", "tolerance");
}

TEST(Linalg, BadInputIsAnError) {
  EXPECT_KILN_ERROR(linalg::eigh(zeros({2, 3}, {.dtype = DType::f64})), "linalg::eigh", "square", "[2, 3]");
  EXPECT_KILN_ERROR(linalg::eigh(zeros({3}, {.dtype = DType::f64})), "linalg::eigh", "square");
  EXPECT_KILN_ERROR(linalg::eigh(zeros({2, 2}, {.dtype = DType::i64})), "linalg::eigh", "f32 or f64", "i64");
  EXPECT_KILN_ERROR(linalg::eigh(tensor({1.0, NAN, NAN, 1.0}, {2, 2}, {.dtype = DType::f64})), "linalg::eigh",
                    "non-finite");
  Tensor leaf = ones({2, 2}, {.dtype = DType::f64, .requires_grad = true});
  EXPECT_KILN_ERROR(linalg::eigh(leaf), "linalg::eigh", "requires grad", "NoGradGuard");
  {
    NoGradGuard no_grad;
    EXPECT_NO_THROW(linalg::eigh(leaf));
  }
  const Tensor a = linalg::eye(3, {.dtype = DType::f64});
  EXPECT_KILN_ERROR(linalg::inverse_root(a, 0.0), "linalg::inverse_root", "positive");
  EXPECT_KILN_ERROR(linalg::inverse_root(a, 2.5, {.method = RootMethod::newton}), "linalg::inverse_root", "integer");
  EXPECT_KILN_ERROR(linalg::inverse_root(a, 2, {.epsilon = -1.0}), "linalg::inverse_root", "epsilon");
  EXPECT_EQ(linalg::inverse_root(zeros({0, 3, 3}, {.dtype = DType::f64}), 2).sizes(), (Shape{0, 3, 3}));
}

}  // namespace
}  // namespace kiln
