// Matrix functions (core/linalg.h) on the CPU: the eigendecomposition reconstructs its input with
// orthonormal vectors and ascending values, batched = one by one; inverse roots satisfy Xᵖ·(A + ε·I) = I on
// random SPD matrices of sizes 1..1024, match a root built from known eigenvalues on ill-conditioned
// (condition 1e8) matrices, handle singular and indefinite ones by the ε rule, and the Newton iteration
// agrees with the eigen method (falling back to it, or failing, when it does not converge); the warm-started
// eigen method reuses an exact or nearby basis (its root within ρ²/4, ρ the coupling) and refreshes a zero, a
// far or a degenerate one, and ρ follows the root's error on an ill-conditioned matrix; bad input is an error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/half.h>
#include <kiln/core/kernels/linalg.h>
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

// A 48 x 48 matrix of eigenvalues 1 .. 1e-8 (condition 1e8), its eigenvectors q and its inverse 4th root.
struct IllConditioned {
  Tensor a, q, root;
};
IllConditioned ill_conditioned(Generator& gen) {
  const int64_t n = 48;
  std::vector<double> values(n), roots(n);
  for (int64_t i = 0; i < n; ++i) {
    values[size_t(i)] = std::pow(10.0, -8.0 * double(i) / double(n - 1));
    roots[size_t(i)] = std::pow(values[size_t(i)], -0.25);
  }
  IllConditioned m;
  m.a = with_eigenvalues(values, gen, &m.q);
  m.root = matmul(mul(m.q, from_vector(roots, {1, n})), m.q.transpose(0, 1));
  return m;
}

TEST(LinalgInverseRoot, IllConditionedMatricesMatchTheRootOfTheirKnownEigenvalues) {
  Generator gen(4);
  const auto [a, q, expected] = ill_conditioned(gen);
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

// A batch where the iteration brings some matrices within the tolerance and not others: those others (and
// only those) are redone by the eigen method, together; every root matches the eigen method's.
TEST(LinalgInverseRoot, NewtonFallsBackOnlyForTheMatricesThatDidNotConverge) {
  Generator gen(8);
  const Tensor well = spd({3, 12, 12}, gen);
  // eigenvalues from 1 down to 1e-14: the smallest grows ~2.4x an iteration, far from converged after 20
  std::vector<double> spread(12);
  for (int64_t i = 0; i < 12; ++i) spread[size_t(i)] = std::pow(10.0, -double(i) * 14.0 / 11.0);
  const Tensor ill = with_eigenvalues(spread, gen), ill2 = with_eigenvalues(spread, gen);
  const Tensor a = stack({well.select(0, 0), ill, well.select(0, 1), ill2, well.select(0, 2)});
  const auto r = linalg::inverse_root_ex(a, 4, {.method = RootMethod::newton, .max_iterations = 20});
  EXPECT_EQ(r.fallbacks, 2);
  const std::vector<double> residual = r.residual.contiguous().to_vector<double>();
  const Tensor eigen = linalg::inverse_root(a, 4);
  for (int64_t i : {0, 2, 4}) {  // the iteration's own roots (near the eigen method's, not its bits)
    EXPECT_LE(residual[size_t(i)], 1e-10) << i;
    const double off = max_abs(sub(r.root.select(0, i), eigen.select(0, i)));
    EXPECT_LT(off / max_abs(eigen.select(0, i)), 1e-9) << i;
    EXPECT_GT(off, 0.0) << i;
  }
  for (int64_t i : {1, 3}) {  // the eigen method's
    EXPECT_GT(residual[size_t(i)], 1e-3) << i;
    EXPECT_LT(max_abs(sub(r.root.select(0, i), eigen.select(0, i))) / max_abs(eigen.select(0, i)), 1e-12) << i;
  }
}

// The relative Frobenius distance of x from y.
double relative(const Tensor& x, const Tensor& y) {
  return std::sqrt(sum(square(sub(x, y))).item<double>() / sum(square(y)).item<double>());
}

TEST(LinalgInverseRootWarm, AZeroBasisIsEigendecomposedAndAnExactOneReused) {
  Generator gen(8);
  const Tensor a = spd({3, 24, 24}, gen);
  const Tensor eigen = linalg::inverse_root(a, 4, {.epsilon = 1e-12});
  Tensor basis = zeros({3, 24, 24}, {.dtype = DType::f64});
  const auto cold = linalg::inverse_root_warm(a, 4, basis, {.epsilon = 1e-12});
  EXPECT_EQ(cold.refreshed, 3);
  EXPECT_EQ(cold.coupling.contiguous().to_vector<double>(), (std::vector<double>{1.0, 1.0, 1.0}));  // the trace gap
  EXPECT_LT(max_abs(sub(cold.root, eigen)), 1e-12);
  // the basis now holds eigenvectors: orthonormal columns with a·q = q·diag(qᵀ·a·q)
  const Tensor id = linalg::eye(24, {.dtype = DType::f64});
  EXPECT_LT(max_abs(sub(matmul(basis.transpose(-2, -1), basis), id)), 1e-12);
  const Tensor aq = matmul(a, basis);
  EXPECT_LT(max_abs(sub(aq, mul(basis, sum(mul(basis, aq), {-2}, /*keepdim=*/true)))), 1e-12);
  // again with that basis: reused (nothing eigendecomposed), ρ at rounding level, the same root
  const Tensor kept = basis.clone();
  const auto warm = linalg::inverse_root_warm(a, 4, basis, {.epsilon = 1e-12});
  EXPECT_EQ(warm.refreshed, 0);
  for (double d : warm.coupling.contiguous().to_vector<double>()) EXPECT_LT(d, 1e-7);
  EXPECT_LT(max_abs(sub(warm.root, eigen)), 1e-12);
  EXPECT_EQ(max_abs(sub(basis, kept)), 0.0);
}

// A basis is kept only with columns of unit norm: a basis of zeros is refreshed for an indefinite matrix
// too (its trace negative), and so is an eigenbasis with one column zeroed (the smallest eigenvalue's,
// which a trace would weigh by 1e-8 of the largest).
TEST(LinalgInverseRootWarm, OnlyABasisOfUnitColumnsIsKept) {
  Generator gen(12);
  const Tensor indefinite = with_eigenvalues({-3.0, -1.0, 0.5, 2.0}, gen);
  const auto r = linalg::inverse_root_warm(indefinite, 2, zeros({4, 4}, {.dtype = DType::f64}), {.warm_tolerance = 10});
  EXPECT_EQ(r.refreshed, 1);
  EXPECT_EQ(r.coupling.item<double>(), 1.0);
  EXPECT_LT(max_abs(sub(r.root, linalg::inverse_root(indefinite, 2))), 1e-12);
  const auto [a, q, expected] = ill_conditioned(gen);
  Tensor missing = q.contiguous().clone();
  missing.narrow(1, a.size(0) - 1, 1).zero_();  // the last column: the 1e-8 eigenvalue's
  const auto m = linalg::inverse_root_warm(a, 4, missing, {.epsilon = 0.0, .warm_tolerance = 10});
  EXPECT_EQ(m.refreshed, 1);
  EXPECT_LT(max_abs(sub(m.root, expected)) / max_abs(expected), 1e-6);
}

TEST(LinalgInverseRootWarm, ANearbyMatrixKeepsItsBasisAndAFarOneIsRefreshed) {
  Generator gen(9);
  const int64_t n = 32;
  const Tensor a = spd({2, n, n}, gen);
  Tensor basis = zeros({2, n, n}, {.dtype = DType::f64});
  linalg::inverse_root_warm(a, 4, basis);
  // matrix 0 moves as a β2 = 0.999 average does in 10 steps (1% new statistics); matrix 1 is replaced
  const Tensor g = f64({n, n}, gen);
  const Tensor fresh = div(matmul(g, g.transpose(0, 1)), double(n));
  const Tensor moved = stack({add(mul(a.select(0, 0), 0.99), mul(fresh, 0.01)), add(fresh, mul(linalg::eye(n, {.dtype = DType::f64}), 0.1))});
  const Tensor before = basis.clone();
  const auto r = linalg::inverse_root_warm(moved, 4, basis, {.warm_tolerance = 0.1});
  const std::vector<double> rho = r.coupling.contiguous().to_vector<double>();
  EXPECT_GT(rho[0], 1e-3);  // the old basis is not exact for the moved matrix ...
  EXPECT_LE(rho[0], 0.1);   // ... but within the tolerance
  EXPECT_GT(rho[1], 0.1);
  EXPECT_EQ(r.refreshed, 1);
  const Tensor exact = linalg::inverse_root(moved, 4);
  // the kept matrix: its basis untouched, its root (corrected to first order) within ρ²/4 of the exact one
  EXPECT_EQ(max_abs(sub(basis.select(0, 0), before.select(0, 0))), 0.0);
  const double error = relative(r.root.select(0, 0), exact.select(0, 0));
  EXPECT_LT(error, rho[0] * rho[0] / 4) << "ρ " << rho[0];
  EXPECT_GT(error, 0.0);
  // the refreshed one: exact, with its new eigenvectors in the basis
  EXPECT_LT(max_abs(sub(r.root.select(0, 1), exact.select(0, 1))), 1e-12);
  const Tensor q1 = basis.select(0, 1), aq1 = matmul(moved.select(0, 1), q1);
  EXPECT_LT(max_abs(sub(aq1, mul(q1, sum(mul(q1, aq1), {-2}, /*keepdim=*/true)))), 1e-12);
  // a basis of zeros is refreshed at any tolerance
  EXPECT_EQ(linalg::inverse_root_warm(moved, 4, zeros({2, n, n}, {.dtype = DType::f64}), {.warm_tolerance = 2.0}).refreshed, 2);
  // a tolerance at rounding level refreshes every basis but an exact one (matrix 1's now)
  EXPECT_EQ(linalg::inverse_root_warm(moved, 4, basis.clone(), {.warm_tolerance = 1e-12}).refreshed, 1);
}

// The two halves (start_warm_roots, finish_warm_roots) for two batches of different sizes, both started
// before either's figures are read, give what inverse_root_warm gives each: the same roots, couplings,
// refreshes and bases; the started root of a kept matrix is already its final root. Figures of the wrong
// count are an error.
TEST(LinalgInverseRootWarm, StartedBatchesFinishedAfterOneReadGiveTheWholeCall) {
  Generator gen(12);
  const Tensor a = spd({2, 16, 16}, gen), c = spd({3, 8, 8}, gen);
  Tensor basis_a = zeros({2, 16, 16}, {.dtype = DType::f64}), basis_c = zeros({3, 8, 8}, {.dtype = DType::f64});
  linalg::inverse_root_warm(a, 4, basis_a);
  linalg::inverse_root_warm(c, 2, basis_c);
  // a moved a little (both kept), c's matrix 1 replaced (refreshed)
  const Tensor moved_a = add(a, mul(spd({2, 16, 16}, gen), 0.003));
  Tensor moved_c = c.clone();
  moved_c.select(0, 1).copy_(spd({8, 8}, gen));
  Tensor whole_a = basis_a.clone(), whole_c = basis_c.clone();
  const auto want_a = linalg::inverse_root_warm(moved_a, 4, whole_a, {.warm_tolerance = 0.1});
  const auto want_c = linalg::inverse_root_warm(moved_c, 2, whole_c, {.warm_tolerance = 0.1});
  ASSERT_EQ(want_a.refreshed, 0);
  ASSERT_EQ(want_c.refreshed, 1);
  const auto started_a = linalg::start_warm_roots(moved_a, 4, basis_a, {.warm_tolerance = 0.1});
  const auto started_c = linalg::start_warm_roots(moved_c, 2, basis_c, {.warm_tolerance = 0.1});
  const Tensor kept_root = started_a.root.clone();
  EXPECT_EQ(started_a.figures.sizes(), Shape({3, 2}));
  const std::vector<double> read = cat({started_a.figures.reshape({-1}), started_c.figures.reshape({-1})}, 0).to_vector<double>();
  const auto got_a = linalg::finish_warm_roots(started_a, std::vector<double>(read.begin(), read.begin() + 6));
  const auto got_c = linalg::finish_warm_roots(started_c, std::vector<double>(read.begin() + 6, read.end()));
  EXPECT_EQ(got_a.refreshed, 0);
  EXPECT_EQ(got_c.refreshed, 1);
  EXPECT_EQ(max_abs(sub(got_a.root, want_a.root)), 0.0);
  EXPECT_EQ(max_abs(sub(got_c.root, want_c.root)), 0.0);
  EXPECT_EQ(max_abs(sub(got_a.root, kept_root)), 0.0);
  EXPECT_EQ(max_abs(sub(got_a.coupling, want_a.coupling)), 0.0);
  EXPECT_EQ(max_abs(sub(got_c.coupling, want_c.coupling)), 0.0);
  EXPECT_EQ(max_abs(sub(basis_a, whole_a)), 0.0);
  EXPECT_EQ(max_abs(sub(basis_c, whole_c)), 0.0);
  EXPECT_KILN_ERROR(linalg::finish_warm_roots(started_a, {1.0, 2.0}), "linalg::inverse_root_warm", "3 x 2", "2 values");
}

TEST(LinalgInverseRootWarm, AnExactBasisOfAnIllConditionedMatrixGivesItsRoot) {
  Generator gen(10);
  const auto [a, q, expected] = ill_conditioned(gen);
  // f32: from an exact basis the Rayleigh quotients in f32 products find the small eigenvalues as well as
  // f32's eigensolver does
  const Tensor basis = cast(q.contiguous(), DType::f32);
  const auto r = linalg::inverse_root_warm(cast(a, DType::f32), 4, basis, {.epsilon = 0.0});
  EXPECT_EQ(r.refreshed, 0);
  const double eigen_error =
      max_abs(sub(cast(linalg::inverse_root(cast(a, DType::f32), 4, {.epsilon = 0.0}), DType::f64), expected));
  EXPECT_LT(max_abs(sub(cast(r.root, DType::f64), expected)), 2 * eigen_error) << eigen_error / max_abs(expected);
  const auto r64 = linalg::inverse_root_warm(a, 4, q.contiguous(), {.epsilon = 0.0});
  EXPECT_LT(max_abs(sub(r64.root, expected)) / max_abs(expected), 1e-6);
}

// The coupling ρ follows the root's error where the relative off-diagonal mass δ = ‖B − diag(λ)‖_F / ‖A‖_F
// (the earlier test) does not: an ill-conditioned matrix (condition 1e8) moved by 1e-5 of its norm keeps a
// tiny δ while its small eigenvalues' directions, where the root is largest, have turned.
TEST(LinalgInverseRootWarm, TheCouplingFollowsTheRootErrorOfAnIllConditionedMatrix) {
  Generator gen(11);
  const auto [a, q, expected] = ill_conditioned(gen);
  const int64_t n = a.size(0);
  const Tensor g = f64({n, n}, gen);
  const Tensor push = div(matmul(g, g.transpose(0, 1)), double(n));
  const Tensor moved = add(a, mul(push, 1e-5 * std::sqrt(sum(square(a)).item<double>() / sum(square(push)).item<double>())));
  const Tensor exact = linalg::inverse_root(moved, 4, {.epsilon = 0.0});
  const Tensor kept_basis = q.contiguous();
  const auto kept = linalg::inverse_root_warm(moved, 4, kept_basis.clone(), {.epsilon = 0.0, .warm_tolerance = 1e9});
  ASSERT_EQ(kept.refreshed, 0);
  const double rho = kept.coupling.item<double>();
  const double error = relative(kept.root, exact);
  const double delta = std::sqrt(std::max(0.0, 1.0 - sum(square(sum(mul(kept_basis, matmul(moved, kept_basis)), {0}))).item<double>() /
                                                     sum(square(moved)).item<double>()));
  std::printf("condition 1e8, moved by 1e-5: root error %.2e, ρ %.2e, δ %.2e\n", error, rho, delta);
  EXPECT_GT(error, 1e-2) << "the kept basis' root is far off";
  EXPECT_LT(delta, 1e-4) << "δ does not see it";
  EXPECT_GT(rho, error) << "ρ does";
  EXPECT_LT(rho, 50 * error);
  // at the default tolerance that basis is refreshed, and the root is the eigen method's
  Tensor basis = kept_basis.clone();
  const auto refreshed = linalg::inverse_root_warm(moved, 4, basis, {.epsilon = 0.0});
  EXPECT_EQ(refreshed.refreshed, 1);
  EXPECT_LT(relative(refreshed.root, exact), 1e-10);
  // and a fresh f32 eigenbasis of it passes the test it would be held to next time (the n·u·λ_max floor)
  Tensor basis32 = zeros({n, n});
  const Tensor moved32 = cast(moved, DType::f32);
  linalg::inverse_root_warm(moved32, 4, basis32, {.epsilon = 0.0});
  const auto again = linalg::inverse_root_warm(moved32, 4, basis32, {.epsilon = 0.0});
  EXPECT_EQ(again.refreshed, 0) << "ρ " << again.coupling.item<double>();
}

// kernels::kept_basis_expansion against its formula composed from general ops in f64 (the composition
// inverse_root_warm used before the kernel): entry by entry, relative, with quotients spread over 1e-6..1,
// pairs that agree to 1e-3 and to 3e-2, in f64 and f32 (the CPU computes in f64 either way), B not symmetric
// (each pair read in the row of its larger φ) and given as coupled·scales (powers of two); p = 4 and 3 (the
// closed form, no threshold) and 2.5 (the difference, f'(mean) within the threshold); mismatched operands are
// an error naming them.
TEST(LinalgInverseRootWarm, TheKeptBasisExpansionIsItsFormula) {
  Generator gen(17);
  const int64_t batch = 2, n = 9;
  const Tensor b = f64({batch, n, n}, gen);
  const Tensor scales = from_vector(std::vector<double>{0x1p-10, 0x1p7}, {batch});
  const Tensor coupled = div(b, scales.view({batch, 1, 1}));
  Tensor phi = exp(mul(rand({batch, n}, {.dtype = DType::f64}, &gen), -13.8));
  phi.narrow(1, 1, 1).copy_(mul(phi.narrow(1, 0, 1), 1.001));
  phi.narrow(1, 3, 1).copy_(mul(phi.narrow(1, 2, 1), 1.03));
  const Tensor lifted = add(phi, 1e-7);
  const Tensor pi = phi.unsqueeze(-1), pj = phi.unsqueeze(-2);
  const Tensor picked = where(gt(pi, pj), b, b.transpose(-2, -1));
  const Tensor gap = sub(pi, pj), mean = mul(add(pi, pj), 0.5);
  const Tensor near = le(abs(gap), mul(mean, 1e-5));
  const Tensor identity = linalg::eye(n, {.dtype = DType::f64});
  const Tensor off = rsub(identity, 1.0);
  const Tensor want_coupling = sum(mul(div(square(picked), mul(pi, pj)), off), {-1});
  for (double p : {4.0, 3.0, 2.5}) {
    // the formula: diag f(lifted); off it F_ij·B_ij; coupling_i = Σ_{j≠i} B_ij²/(φ_i·φ_j), with B_ij the
    // pair's entry in the row of the larger φ (no two are equal here)
    const Tensor f = pow(phi, -1.0 / p);
    const Tensor divided = where(near, mul(pow(mean, -1.0 / p - 1.0), -1.0 / p),
                                 div(sub(f.unsqueeze(-1), f.unsqueeze(-2)), gap));
    const Tensor want_middle =
        add(mul(mul(divided, picked), off), mul(identity, pow(lifted, -1.0 / p).unsqueeze(-1)));
    for (DType t : {DType::f64, DType::f32}) {
      const Tensor bt = cast(coupled, t), phit = cast(phi, t);
      const Tensor middle = empty({batch, n, n}, {.dtype = t}), coupling = empty({batch, n}, {.dtype = t});
      kernels::kept_basis_expansion(bt, cast(scales, t), phit, pow(phit, -1.0 / p), pow(cast(lifted, t), -1.0 / p),
                                    p, middle, coupling);
      // f64: the reference's own difference loses ~u·p/δ (4e-13 at δ = 1e-3). f32: the inputs' rounding
      // (u = 2⁻²⁴), amplified in F's difference to ~2u·p/δ where φ_i and φ_j are δ apart (p = 2.5: up to
      // ~5e-5 for δ near the 1e-2 threshold; the closed form's inputs f(φ) are off by a few u)
      const double tol = t == DType::f64 ? 1e-12 : 1e-4;
      EXPECT_LT(max_abs(div(sub(cast(middle, DType::f64), want_middle), want_middle)), tol)
          << dtype_name(t) << " p " << p;
      EXPECT_LT(max_abs(div(sub(cast(coupling, DType::f64), want_coupling), want_coupling)), tol)
          << dtype_name(t) << " p " << p;
    }
  }
  const double p = 4;
  const Tensor f = pow(phi, -1.0 / p);
  const Tensor m = empty({batch, n, n}, {.dtype = DType::f64}), c = empty({batch, n}, {.dtype = DType::f64});
  EXPECT_KILN_ERROR(
      kernels::kept_basis_expansion(b, Tensor(), phi, f, f, p, m, empty({batch, n + 1}, {.dtype = DType::f64})),
      "kept_basis_expansion", "coupling f64[2, 10]");
  EXPECT_KILN_ERROR(kernels::kept_basis_expansion(cast(b, DType::f32), Tensor(), phi, f, f, p, m, c),
                    "kept_basis_expansion", "B f32[2, 9, 9]", "floored f64[2, 9]");
  EXPECT_KILN_ERROR(kernels::kept_basis_expansion(b.transpose(-2, -1), Tensor(), phi, f, f, p, m, c),
                    "kept_basis_expansion");
  EXPECT_KILN_ERROR(kernels::kept_basis_expansion(b, ones({batch + 1}, {.dtype = DType::f64}), phi, f, f, p, m, c),
                    "kept_basis_expansion", "scales f64[3]");
}

// kernels::kept_basis_expansion reads each off-diagonal pair (i, j), (j, i) from one entry: row r, column c, r the
// index of the larger φ (equal φ: the larger index). B here is symmetric where read and NaN where not (the
// entries a one-pass TF32 product gets wrong), φ with ties: the result is bit for bit the symmetric B's.
TEST(LinalgInverseRootWarm, TheKeptBasisExpansionReadsEachPairInTheRowOfItsLargerQuotient) {
  Generator gen(18);
  const int64_t batch = 2, n = 11;
  const double p = 4;
  const Tensor s = f64({batch, n, n}, gen);
  const Tensor symmetric = add(s, s.transpose(-2, -1)).contiguous();
  Tensor phi = exp(mul(rand({batch, n}, {.dtype = DType::f64}, &gen), -9.0));
  phi.narrow(1, 4, 1).copy_(phi.narrow(1, 2, 1));  // ties
  phi.narrow(1, 7, 1).copy_(phi.narrow(1, 2, 1));
  phi.narrow(1, 9, 1).copy_(phi.narrow(1, 1, 1));
  const std::vector<double> phis = phi.to_vector<double>();
  std::vector<double> read = symmetric.to_vector<double>();
  for (int64_t k = 0; k < batch; ++k)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const double pi = phis[size_t(k * n + i)], pj = phis[size_t(k * n + j)];
        const bool row_of_pair = pi > pj || (pi == pj && i > j);
        if (i != j && !row_of_pair) read[size_t((k * n + i) * n + j)] = NAN;
      }
  const Tensor half = from_vector(read, {batch, n, n});
  for (DType t : {DType::f64, DType::f32}) {
    const Tensor phit = cast(phi, t), f = pow(phit, -1.0 / p), d = pow(add(phit, 1e-7), -1.0 / p);
    Tensor middle[2], coupling[2];
    int which = 0;
    for (const Tensor& b : {cast(symmetric, t), cast(half, t)}) {
      middle[which] = empty({batch, n, n}, {.dtype = t});
      coupling[which] = empty({batch, n}, {.dtype = t});
      kernels::kept_basis_expansion(b, Tensor(), phit, f, d, p, middle[which], coupling[which]);
      ++which;
    }
    EXPECT_TRUE(all_true(eq(middle[1], middle[0]))) << dtype_name(t);  // NaN would be unequal
    EXPECT_TRUE(all_true(eq(coupling[1], coupling[0]))) << dtype_name(t);
  }
}

// column_norm_gap: max_j |‖q_j‖² − 1| per basis: ~0 for an orthonormal one, the one stretched column's gap, 1
// for zeros, NaN where q has one; f32 and f64; bad shapes are errors.
TEST(LinalgColumnNormGap, IsTheLargestColumnNormOffOne) {
  Generator gen(21);
  for (DType t : {DType::f64, DType::f32}) {
    const int64_t n = 9;
    const Tensor g = randn({n, n}, {.dtype = DType::f64}, &gen);
    const Tensor orthonormal = linalg::eigh(add(g, g.transpose(0, 1))).eigenvectors;
    Tensor q = stack({orthonormal, orthonormal, zeros({n, n}, {.dtype = DType::f64}), orthonormal});
    q.select(0, 1).narrow(1, 4, 1).mul_(1.1);  // column 4: norm² 1.21
    q.select(0, 3).select(0, 2).select(0, 7).fill_(NAN);
    q = cast(q, t);
    const Tensor gap = empty({4}, {.dtype = t});
    kernels::column_norm_gap(q, gap);
    const std::vector<double> got = cast(gap, DType::f64).to_vector<double>();
    EXPECT_LT(got[0], t == DType::f64 ? 1e-14 : 1e-6) << dtype_name(t);
    EXPECT_NEAR(got[1], 0.21, t == DType::f64 ? 1e-14 : 1e-6) << dtype_name(t);
    EXPECT_EQ(got[2], 1.0) << dtype_name(t);
    EXPECT_TRUE(std::isnan(got[3])) << dtype_name(t);
  }
  EXPECT_THROW(kernels::column_norm_gap(zeros({2, 3, 4}), empty({2})), Error);
  EXPECT_THROW(kernels::column_norm_gap(zeros({2, 3, 3}), empty({2}, {.dtype = DType::f64})), Error);
}

// split_f16: each matrix scaled by a power of two that puts its bound in [2^13, 2^14) (1 for a bound of 0 or
// NaN); hi the nearest f16 of x·s and lo the nearest f16 of the exact remainder, so hi + lo is x·s to 2^-22 of
// it (2^-25 absolute among f16's subnormals); hi written again where asked; non-finite or overflowing x·s in
// hi with lo 0. Outputs are views into concatenated operands (row strides of 3c, and planes of a stack).
TEST(LinalgSplitF16, HiAndLoCarryTheScaledValueTo22Bits) {
  Generator gen(19);
  const int64_t batch = 5, r = 6, c = 8;
  Tensor x = cast(mul(randn({batch, r, c}, {.dtype = DType::f64}, &gen),
                      exp(mul(randn({batch, r, c}, {.dtype = DType::f64}, &gen), 4.0))),
                  DType::f32);
  x.select(0, 1).mul_(1e-20);                  // tiny entries: a large scale
  x.select(0, 2).mul_(1e-3);                   // bound 0: scale 1
  x.select(0, 4).narrow(0, 0, 1).narrow(1, 0, 3).copy_(from_vector(std::vector<float>{INFINITY, -INFINITY, NAN},
                                                                   {1, 3}));
  const std::vector<float> amaxes = amax(abs(x), {1, 2}).to_vector<float>();
  // matrix 3's bound an eighth of its largest entry: entries past 4x the bound overflow f16
  const std::vector<float> bound_values{amaxes[0], amaxes[1], 0.0f, amaxes[3] / 8, NAN};
  const Tensor bounds = from_vector(bound_values, {batch}), scales = empty({batch});
  const Tensor rows = empty({batch, r, 3 * c}, {.dtype = DType::f16}), planes = empty({3, batch, r, c}, {.dtype = DType::f16});
  const Tensor hi = rows.narrow(2, c, c), lo = planes.select(0, 1), again = rows.narrow(2, 2 * c, c);
  kernels::split_f16(x, bounds, scales, hi, lo, again);
  const std::vector<float> s = scales.to_vector<float>(), xs = x.to_vector<float>();
  auto bits = [](const Tensor& t, int64_t b, int64_t i, int64_t j) {  // element (b, i, j) of a strided f16 view
    return static_cast<const uint16_t*>(t.raw_data())[b * t.stride(0) + i * t.stride(1) + j * t.stride(2)];
  };
  for (int64_t b = 0; b < batch; ++b) {
    const float scale = s[size_t(b)];
    int e = 0;
    EXPECT_EQ(std::frexp(scale, &e), 0.5f) << "scale " << scale << " is not a power of two";
    if (b == 2 || b == 4) {
      EXPECT_EQ(scale, 1.0f) << b;
    } else {
      EXPECT_GE(double(bound_values[size_t(b)]) * scale, 0x1p13) << b;
      EXPECT_LT(double(bound_values[size_t(b)]) * scale, 0x1p14) << b;
    }
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) {
        const double v = double(xs[size_t((b * r + i) * c + j)]) * double(scale);
        const uint16_t h = bits(hi, b, i, j), l = bits(lo, b, i, j);
        EXPECT_EQ(bits(again, b, i, j), h) << "hi_again";
        EXPECT_EQ(h, Half::from_float(float(v))) << "hi of " << v << " is not its nearest f16";
        if (!std::isfinite(v) || std::abs(v) >= 65520.0) {  // f16 rounds 65520 and above to inf
          EXPECT_EQ(l, 0) << v;
          EXPECT_EQ(h & 0x7c00, 0x7c00) << v;
          continue;
        }
        const double carried = double(Half::to_float(h)) + double(Half::to_float(l));
        EXPECT_LE(std::abs(carried - v), std::max(0x1p-22 * std::abs(v), 0x1p-25)) << v;
        EXPECT_EQ(l, Half::from_float(float(v - double(Half::to_float(h))))) << v;
      }
  }
  EXPECT_THROW(kernels::split_f16(x, bounds, scales, hi, lo, rows.narrow(2, 0, c - 1)), Error);
  const Tensor columns = empty({batch, c, r}, {.dtype = DType::f16}).transpose(1, 2);  // x's shape, stride 6 along c
  EXPECT_THROW(kernels::split_f16(x, bounds, scales, columns, lo, Tensor()), Error);
  EXPECT_THROW(kernels::split_f16(x, bounds.narrow(0, 0, 4), scales, hi, lo, Tensor()), Error);
}

// Under autocast the roots are still computed in the matrices' dtype (autocast would put the products in bf16).
TEST(LinalgInverseRootWarm, AutocastDoesNotLowerTheRootsProducts) {
  Generator gen(18);
  const int64_t n = 12;
  const Tensor a = cast(spd({2, n, n}, gen), DType::f32);
  Tensor basis = zeros({2, n, n}), basis_autocast = zeros({2, n, n});
  const auto plain = linalg::inverse_root_warm(a, 4, basis);
  const auto again = linalg::inverse_root_warm(add(a, mul(linalg::eye(n, {}), 1e-3)), 4, basis);
  linalg::InverseRoot newton_plain = linalg::inverse_root_ex(a, 4, {.method = RootMethod::newton});
  amp::Autocast autocast(Device::cpu(), DType::bf16);
  const auto plain_ac = linalg::inverse_root_warm(a, 4, basis_autocast);
  const auto again_ac = linalg::inverse_root_warm(add(a, mul(linalg::eye(n, {}), 1e-3)), 4, basis_autocast);
  const linalg::InverseRoot newton_ac = linalg::inverse_root_ex(a, 4, {.method = RootMethod::newton});
  EXPECT_EQ(again.refreshed, 0);
  EXPECT_EQ(again_ac.refreshed, 0);
  EXPECT_EQ(again_ac.root.dtype(), DType::f32);
  EXPECT_EQ(max_abs(sub(again_ac.root, again.root)), 0.0);
  EXPECT_EQ(max_abs(sub(plain_ac.root, plain.root)), 0.0);
  EXPECT_EQ(max_abs(sub(newton_ac.root, newton_plain.root)), 0.0);
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
  EXPECT_KILN_ERROR(linalg::inverse_root(a, 2, {.method = RootMethod::warm_eigen}), "linalg::inverse_root",
                    "warm_eigen", "inverse_root_warm");
  EXPECT_KILN_ERROR(linalg::inverse_root_warm(a, 2, zeros({2, 2}, {.dtype = DType::f64})),
                    "linalg::inverse_root_warm", "basis", "[3, 3]", "[2, 2]");
  EXPECT_KILN_ERROR(linalg::inverse_root_warm(a, 2, zeros({3, 3})), "linalg::inverse_root_warm", "basis", "f32");
  EXPECT_KILN_ERROR(linalg::inverse_root_warm(a, 2, zeros({3, 3}, {.dtype = DType::f64}), {.warm_tolerance = -1}),
                    "linalg::inverse_root_warm", "warm_tolerance");
  // non-finite input, found through ρ (no pass of its own): with a basis of zeros and with the exact one a
  // finite matrix keeps; the basis is left as it was
  for (DType t : {DType::f64, DType::f32})
    for (double bad : {double(NAN), double(INFINITY), -double(INFINITY)}) {
      const Tensor good = cast(mul(linalg::eye(3, {.dtype = DType::f64}), 2.0), t);
      Tensor basis = zeros({2, 3, 3}, {.dtype = t});
      const Tensor pair = stack({good, good});
      linalg::inverse_root_warm(pair, 2, basis);  // the exact basis, kept below for the finite matrix
      EXPECT_EQ(linalg::inverse_root_warm(pair, 2, basis).refreshed, 0);
      Tensor poisoned = pair.clone();
      poisoned.select(0, 1).select(0, 2).select(0, 1).fill_(bad);
      const Tensor before = basis.clone();
      EXPECT_KILN_ERROR(linalg::inverse_root_warm(poisoned, 2, basis, {.tf32 = true}), "linalg::inverse_root_warm",
                        "non-finite");
      EXPECT_EQ(max_abs(sub(basis, before)), 0.0);
      EXPECT_KILN_ERROR(linalg::inverse_root_warm(poisoned, 2, zeros({2, 3, 3}, {.dtype = t})),
                        "linalg::inverse_root_warm", "non-finite");
    }
  // 1 x 1: no off-diagonal entry carries it into ρ; the quotients' own sum does
  for (double bad : {double(NAN), double(INFINITY)}) {
    Tensor basis = zeros({1, 1, 1}, {.dtype = DType::f64});
    linalg::inverse_root_warm(full({1, 1, 1}, 2.0, {.dtype = DType::f64}), 2, basis);  // basis [1]
    EXPECT_KILN_ERROR(linalg::inverse_root_warm(full({1, 1, 1}, bad, {.dtype = DType::f64}), 2, basis),
                      "linalg::inverse_root_warm", "non-finite");
  }
}

}  // namespace
}  // namespace kiln
