// Matrix functions on the GPU (cuSOLVER's batched eigensolver, the Newton iteration on batched GEMMs)
// against the CPU: eigenvalues equal, eigenvectors reconstruct the input and are orthonormal, inverse roots
// equal the CPU's by both methods, in f32 and f64, for sizes 1..1024 (each size its own batched call, as
// Shampoo's blocks of mixed sizes are), including ill-conditioned and singular matrices.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include <kiln/core/kernels/linalg.h>
#include <kiln/core/linalg.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "compare_util.h"
#include "cuda_test_util.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

double max_abs(const Tensor& t) { return amax(abs(cast(t, DType::f64))).cpu().item<double>(); }

Tensor spd(int64_t batch, int64_t n, DType t) {
  const Tensor g = randn({batch, n, n}, {.dtype = DType::f64});
  const Tensor a = add(div(matmul(g, g.transpose(-2, -1)), double(n)), mul(linalg::eye(n, {.dtype = DType::f64}), 0.1));
  return cast(a, t);
}

TEST(CudaLinalg, EighMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(41);
  for (DType t : {DType::f64, DType::f32})
    for (int64_t n : {1, 2, 31, 33, 256, 1024}) {
      const int64_t batch = n >= 256 ? 2 : 5;
      const Tensor g = cast(randn({batch, n, n}, {.dtype = DType::f64}), t);
      const Tensor a = mul(add(g, g.transpose(-2, -1)), 0.5);
      const auto cpu = linalg::eigh(a);
      const auto gpu_result = linalg::eigh(a.to(gpu()));
      ASSERT_TRUE(gpu_result.eigenvalues.device().is_cuda());
      const double scale = max_abs(cpu.eigenvalues), tol = t == DType::f64 ? 1e-12 : 2e-5;
      const double value_err = max_abs(sub(gpu_result.eigenvalues.cpu(), cpu.eigenvalues)) / scale;
      const Tensor v = gpu_result.eigenvectors, w = gpu_result.eigenvalues;
      const double rebuild_err =
          max_abs(sub(matmul(mul(v, w.unsqueeze(-2)), v.transpose(-2, -1)), a.to(gpu()))) / scale;
      const double ortho_err =
          max_abs(sub(matmul(v.transpose(-2, -1), v), linalg::eye(n, {.dtype = t, .device = gpu()})));
      std::printf("eigh %s n=%lld: eigenvalues %.2e, rebuilt %.2e, orthonormal %.2e\n", dtype_name(t),
                  (long long)n, value_err, rebuild_err, ortho_err);
      EXPECT_LT(value_err, tol * std::sqrt(double(n))) << dtype_name(t) << " n " << n;
      EXPECT_LT(rebuild_err, 10 * tol * std::sqrt(double(n))) << dtype_name(t) << " n " << n;
      EXPECT_LT(ortho_err, 10 * tol * std::sqrt(double(n))) << dtype_name(t) << " n " << n;
    }
}

TEST(CudaLinalg, InverseRootsMatchTheCpuByBothMethods) {
  KILN_REQUIRE_GPU();
  manual_seed(42);
  for (DType t : {DType::f64, DType::f32})
    for (int64_t n : {1, 17, 128, 768, 1024}) {
      const Tensor a = spd(n >= 768 ? 2 : 4, n, t);
      const Tensor want = linalg::inverse_root(cast(a, DType::f64), 4, {.epsilon = 1e-12});
      for (auto method : {linalg::RootMethod::eigen, linalg::RootMethod::newton}) {
        const auto r = linalg::inverse_root_ex(a.to(gpu()), 4, {.epsilon = 1e-12, .method = method});
        ASSERT_TRUE(r.root.device().is_cuda());
        const double err = max_abs(sub(cast(r.root.cpu(), DType::f64), want)) / max_abs(want);
        std::printf("inverse_root %s n=%lld %s: relative error %.2e (%lld iterations, %lld fallbacks)\n",
                    dtype_name(t), (long long)n, method == linalg::RootMethod::eigen ? "eigen" : "newton", err,
                    (long long)r.iterations, (long long)r.fallbacks);
        EXPECT_LT(err, t == DType::f64 ? 1e-9 : 1e-3) << dtype_name(t) << " n " << n;
      }
    }
}

// Warm-started roots (linalg::inverse_root_warm) on the GPU as on the CPU: from a zero basis the eigen roots
// (every matrix refreshed); after the matrices move by 1% of an unrelated matrix (coupling ρ ~0.05-0.09) the
// same matrices keep their basis, with the same ρ and roots as the CPU's from its own basis (eigenvectors
// may differ in sign between the solvers; the roots and ρ do not); one matrix replaced outright is
// refreshed on both.
TEST(CudaLinalg, WarmStartedRootsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(43);
  for (DType t : {DType::f64, DType::f32})
    for (int64_t n : {17, 256, 768}) {
      const Tensor a = spd(3, n, t);
      Tensor cpu_basis = zeros({3, n, n}, {.dtype = t}), gpu_basis = zeros({3, n, n}, {.dtype = t, .device = gpu()});
      const auto c0 = linalg::inverse_root_warm(a, 4, cpu_basis);
      const auto g0 = linalg::inverse_root_warm(a.to(gpu()), 4, gpu_basis);
      EXPECT_EQ(g0.refreshed, 3);
      const double tol = t == DType::f64 ? 1e-9 : 2e-3;
      EXPECT_LT(max_abs(sub(cast(g0.root.cpu(), DType::f64), cast(c0.root, DType::f64))) / max_abs(c0.root), tol);
      Tensor moved = add(mul(a, 0.99), mul(spd(3, n, t), 0.01));
      moved.narrow(0, 2, 1).copy_(spd(1, n, t));  // far from its basis
      const auto c1 = linalg::inverse_root_warm(moved, 4, cpu_basis, {.warm_tolerance = 0.2});
      const auto g1 = linalg::inverse_root_warm(moved.to(gpu()), 4, gpu_basis, {.warm_tolerance = 0.2});
      EXPECT_EQ(c1.refreshed, 1);
      EXPECT_EQ(g1.refreshed, 1) << dtype_name(t) << " n " << n;
      const std::vector<double> rc = c1.coupling.to_vector<double>(), rg = g1.coupling.to_vector<double>();
      for (size_t i = 0; i < 2; ++i)
        EXPECT_NEAR(rg[i], rc[i], (t == DType::f64 ? 1e-9 : 1e-2) * rc[i]) << dtype_name(t) << " n " << n;
      const double err = max_abs(sub(cast(g1.root.cpu(), DType::f64), cast(c1.root, DType::f64))) / max_abs(c1.root);
      std::printf("inverse_root_warm %s n=%lld: ρ %.2e / %.2e / %.2e, GPU vs CPU relative %.2e\n", dtype_name(t),
                  (long long)n, rg[0], rg[1], rg[2], err);
      EXPECT_LT(err, tol) << dtype_name(t) << " n " << n;
      if (t == DType::f32) {
        // the roots' products in reduced precision (options.tf32: a kept basis' on f16, a refreshed one's on
        // TF32): the same matrices kept, ρ as from the f32 products, the roots within TF32's precision; the
        // process's TF32 setting left as it was
        const bool before = cuda::allow_tf32();
        Tensor tf32_basis = gpu_basis.clone();
        tf32_basis.narrow(0, 2, 1).zero_();  // the replaced matrix refreshed again
        const auto g2 = linalg::inverse_root_warm(moved.to(gpu()), 4, tf32_basis, {.tf32 = true, .warm_tolerance = 0.2});
        EXPECT_EQ(g2.refreshed, 1) << n;
        const double tf32_err =
            max_abs(sub(cast(g2.root.cpu(), DType::f64), cast(c1.root, DType::f64))) / max_abs(c1.root);
        // and the products did run in reduced precision: the f32 roots of the same kept bases (g1) differ
        const double from_f32 = max_abs(sub(g2.root.narrow(0, 0, 2), g1.root.narrow(0, 0, 2))) / max_abs(g1.root);
        std::printf("inverse_root_warm tf32 n=%lld: GPU vs CPU relative %.2e, vs the f32 products %.2e\n",
                    (long long)n, tf32_err, from_f32);
        EXPECT_LT(tf32_err, 1e-3) << n;
        if (n >= 256) {
          EXPECT_GT(from_f32, 1e-6) << n;
        }
        EXPECT_EQ(cuda::allow_tf32(), before);
      }
    }
}

// The kept roots' f16 products (options.tf32) scale each matrix on its own: one batch whose matrices' roots lie
// 1e6 (p = 4) and 1e12 (p = 2) apart, each root as near the f32 products' as TF32's precision allows, relative
// to its own size (one scale for the batch would leave the smallest roots' W = q·M in f16's subnormals at p = 2).
TEST(CudaLinalg, KeptRootsOnF16KeepEachMatrixsOwnScale) {
  KILN_REQUIRE_GPU();
  manual_seed(49);
  const int64_t n = 256;
  const Tensor scales = from_vector(std::vector<double>{1e-12, 1.0, 1e12}, {3, 1, 1});
  for (double p : {4.0, 2.0}) {
    const Tensor a64 = mul(cast(spd(3, n, DType::f32), DType::f64), scales);
    const Tensor moved64 = add(mul(a64, 0.99), mul(mul(cast(spd(3, n, DType::f32), DType::f64), scales), 0.01));
    const Tensor a = cast(a64, DType::f32).to(gpu()), moved = cast(moved64, DType::f32).to(gpu());
    const linalg::InverseRootOptions options{.epsilon = 1e-30, .warm_tolerance = 0.2};
    Tensor basis = zeros({3, n, n}, {.device = gpu()});
    (void)linalg::inverse_root_warm(a, p, basis, options);  // the bases, eigendecomposed afresh
    Tensor basis_f16 = basis.clone();
    const auto f32 = linalg::inverse_root_warm(moved, p, basis, options);
    linalg::InverseRootOptions reduced = options;
    reduced.tf32 = true;
    const auto f16 = linalg::inverse_root_warm(moved, p, basis_f16, reduced);
    EXPECT_EQ(f32.refreshed, 0) << p;
    EXPECT_EQ(f16.refreshed, 0) << p;
    for (int64_t i = 0; i < 3; ++i) {
      const Tensor want = f32.root.select(0, i).cpu(), got = f16.root.select(0, i).cpu();
      const double err = max_abs(sub(got, want)) / max_abs(want);
      std::printf("kept roots on f16, p %g, matrix scaled %g: root max %.3e, relative to the f32 products %.2e\n", p,
                  scales.to_vector<double>()[size_t(i)], max_abs(want), err);
      EXPECT_LT(err, 1e-3) << "p " << p << ", matrix " << i;
    }
  }
}

// kernels::kept_basis_expansion on the GPU against the CPU's f64: random B given as coupled·scales (powers of
// two), quotients spread over 1e-6..1 with pairs that agree to 1e-3 and to 3e-2, rows in 16-byte units and not
// (n = 5, 1027); p = 4 (f32: the kernel specialised for it), 3 (the closed form for any integer) and 2.5 (the
// difference, f'(mean) within the threshold). B not symmetric: each pair is read where the pick says
// (core/kernels/linalg.h), here from tiles on both sides of the diagonal (n = 64, 1027), ties in φ included.
TEST(CudaLinalg, KeptBasisExpansionMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(44);
  for (double p : {4.0, 3.0, 2.5})
    for (DType t : {DType::f64, DType::f32})
      for (int64_t n : {1, 5, 64, 1027}) {
        const int64_t batch = 3;
        const Tensor coupled = cast(randn({batch, n, n}, {.dtype = DType::f64}), t);
        const Tensor scales = cast(from_vector(std::vector<double>{1.0, 0x1p-20, 0x1p20}, {batch}), t);
        Tensor floored = exp(mul(rand({batch, n}, {.dtype = DType::f64}), -13.8));  // 1e-6 .. 1
        if (n >= 5) {
          floored.narrow(1, 1, 1).copy_(mul(floored.narrow(1, 0, 1), 1.001));
          floored.narrow(1, 3, 1).copy_(mul(floored.narrow(1, 2, 1), 1.03));
          floored.narrow(1, n - 1, 1).copy_(floored.narrow(1, 2, 1));  // a tie, across tiles for n > 32
        }
        floored = cast(floored, t);
        const Tensor lifted = cast(add(floored, 1e-7), t);
        const Tensor floored_roots = pow(floored, -1.0 / p), diagonal_roots = pow(lifted, -1.0 / p);
        const Tensor middle = empty({batch, n, n}, {.dtype = t}), coupling = empty({batch, n}, {.dtype = t});
        kernels::kept_basis_expansion(coupled, scales, floored, floored_roots, diagonal_roots, p, middle, coupling);
        const Tensor gm = empty({batch, n, n}, {.dtype = t, .device = gpu()});
        const Tensor gc = empty({batch, n}, {.dtype = t, .device = gpu()});
        kernels::kept_basis_expansion(coupled.to(gpu()), scales.to(gpu()), floored.to(gpu()),
                                      floored_roots.to(gpu()), diagonal_roots.to(gpu()), p, gm, gc);
        // entry by entry, relative (the entries span many orders of magnitude); n = 1 has a zero coupling
        auto relative = [](const Tensor& got, const Tensor& want) {
          const Tensor w = cast(want, DType::f64);
          return max_abs(div(sub(cast(got.cpu(), DType::f64), w), add(abs(w), 1e-300)));
        };
        const double middle_err = relative(gm, middle);
        const double coupling_err = n == 1 ? max_abs(gc.cpu()) : relative(gc, coupling);
        std::printf("kept_basis_expansion %s p=%g n=%lld: middle %.2e, coupling %.2e\n", dtype_name(t), p,
                    (long long)n, middle_err, coupling_err);
        // f32: both start from the same f32 φ and f(φ); the GPU computes in f32 (the closed form to a few ulps;
        // for p = 2.5 the 1e-2 threshold falls differently in f32 and f64, ~1e-5, and the GPU's f32 pow)
        EXPECT_LT(middle_err, t == DType::f64 ? 1e-12 : 1e-4) << dtype_name(t) << " p " << p << " n " << n;
        EXPECT_LT(coupling_err, t == DType::f64 ? 1e-12 : 1e-5) << dtype_name(t) << " p " << p << " n " << n;
      }
}

// column_norm_gap on the GPU agrees with the CPU's (both sum in f64, in different orders): orthonormal bases
// whose columns are stretched by up to 1e-3, sizes across the 32-column tiles (1, 33, 1027), a zero basis and
// a NaN, f32 and f64.
TEST(CudaLinalg, ColumnNormGapMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(48);
  for (DType t : {DType::f64, DType::f32})
    for (int64_t n : {1, 33, 1027}) {
      const Tensor g = randn({3, n, n}, {.dtype = DType::f64});
      Tensor q = linalg::eigh(add(g, g.transpose(-2, -1))).eigenvectors;
      q = mul(q, add(mul(rand({3, 1, n}, {.dtype = DType::f64}), 1e-3), 1.0));
      if (n > 1) {
        q.select(0, 1).zero_();
        q.select(0, 2).select(0, n - 1).select(0, n / 2).fill_(NAN);
      }
      q = cast(q, t);
      const Tensor want = empty({3}, {.dtype = t}), got = empty({3}, {.dtype = t, .device = gpu()});
      kernels::column_norm_gap(q, want);
      kernels::column_norm_gap(q.to(gpu()), got);
      const std::vector<double> w = cast(want, DType::f64).to_vector<double>(),
                                g2 = cast(got.cpu(), DType::f64).to_vector<double>();
      for (size_t i = 0; i < 3; ++i) {
        if (std::isnan(w[i])) {
          EXPECT_TRUE(std::isnan(g2[i])) << dtype_name(t) << " n " << n << " matrix " << i;
          continue;
        }
        EXPECT_NEAR(g2[i], w[i], (t == DType::f64 ? 1e-12 : 1e-6) * std::max(w[i], 1e-3))
            << dtype_name(t) << " n " << n << " matrix " << i;
      }
    }
}

// split_f16 on the GPU is the CPU's bit for bit: values over ~35 binades and specials,
// matrices whose bounds give large, small, unit and overflowing scales, outputs as views into concatenated
// operands, through the 16-byte path (c = 64) and the one-at-a-time path (c = 33).
TEST(CudaLinalg, SplitF16IsTheCpusBitForBit) {
  KILN_REQUIRE_GPU();
  manual_seed(47);
  for (int64_t c : {64, 33}) {
    const int64_t batch = 4, r = 37;
    Tensor x = cast(mul(randn({batch, r, c}, {.dtype = DType::f64}), exp(mul(randn({batch, r, c}, {.dtype = DType::f64}), 3.0))),
                    DType::f32);
    x.select(0, 1).mul_(1e-25);
    x.select(0, 3).narrow(0, 0, 1).narrow(1, 0, 4).copy_(
        from_vector(std::vector<float>{INFINITY, -INFINITY, NAN, -0.0f}, {1, 4}));
    const std::vector<float> m = amax(abs(x.narrow(0, 0, 2)), {1, 2}).to_vector<float>();
    const Tensor bounds = from_vector(std::vector<float>{m[0], m[1], 0.0f, 1e-3f}, {batch});
    auto split = [&](const Device& d) {
      const Tensor scales = empty({batch}, {.device = d});
      const Tensor cat = zeros({batch, r, 3 * c}, {.dtype = DType::f16, .device = d});
      kernels::split_f16(x.to(d), bounds.to(d), scales, cat.narrow(2, c, c), cat.narrow(2, 0, c),
                         cat.narrow(2, 2 * c, c));
      return std::pair{scales.cpu(), cat.cpu()};
    };
    const auto [sc, catc] = split(Device::cpu());
    const auto [sg, catg] = split(gpu());
    auto same = [](const Tensor& a, const Tensor& b) {
      const size_t bytes = size_t(a.numel()) * a.element_size();
      return a.sizes() == b.sizes() && a.dtype() == b.dtype() && std::memcmp(a.raw_data(), b.raw_data(), bytes) == 0;
    };
    EXPECT_TRUE(same(sc, sg)) << "scales, c " << c;
    EXPECT_TRUE(same(catc, catg)) << "hi, lo, hi again, c " << c;
  }
}

// ρ of the coupling in the step that decides whether a basis is kept, where it matters: an ill-conditioned
// factor (eigenvalues 1 .. 1e-3) moved a little from its basis. With options.tf32, A·q runs as three f16
// products of split operands and qᵀ·(A·q) as one TF32 pass read in each pair's accurate entry; its ρ stays as
// near the f64 value as the f32 products' is (3x theirs, or 1e-3 of ρ), where a single TF32 pass for both
// products (computed here) is far off, and would refresh a basis that should be kept.
TEST(CudaLinalg, WarmRootsCouplingOnSplitProductsIsAsAccurateAsF32) {
  KILN_REQUIRE_GPU();
  manual_seed(46);
  const int64_t batch = 2, n = 512;
  // A = Q·diag(λ)·Qᵀ + a small symmetric move, and q = Q: the basis of the unmoved matrix
  const Tensor g = randn({batch, n, n}, {.dtype = DType::f64});
  const Tensor q64 = linalg::eigh(add(g, g.transpose(-2, -1))).eigenvectors;
  const Tensor lambda = exp(mul(arange(n, {.dtype = DType::f64}), -std::log(1e3) / double(n - 1)));
  const Tensor s = randn({batch, n, n}, {.dtype = DType::f64});
  // the scale of the matrices moves the split's f16 scale (a power of two from their diagonal), not ρ
  for (double scale : {1.0, 1e6, 1e-6}) {
    const Tensor moved = mul(add(matmul(mul(q64, lambda.unsqueeze(-2)), q64.transpose(-2, -1)),
                                 mul(add(s, s.transpose(-2, -1)), 2e-6)),  // ρ ≈ 0.02
                             scale);
    const Tensor a = cast(moved, DType::f32), q = cast(q64, DType::f32);
    // ρ_i = sqrt(Σ_{j≠i} B_ij² / (B_ii·B_jj)) of a B computed elsewhere (the quotients are far above the floor)
    auto coupling_of = [&](const Tensor& b) {
      const Tensor b64 = cast(b.cpu(), DType::f64).contiguous();
      const Tensor d = b64.view({batch, n * n}).slice(1, 0, n * n, n + 1).contiguous();
      const Tensor scaled = div(square(b64), mul(d.unsqueeze(-1), d.unsqueeze(-2)));
      return sqrt(amax(add(sum(scaled, {-1}), -1.0), {-1}));  // the diagonal's B_ii²/(B_ii·B_ii) = 1 taken off
    };
    const std::vector<double> want =
        coupling_of(matmul(cast(q, DType::f64).transpose(-2, -1), matmul(cast(a, DType::f64), cast(q, DType::f64))))
            .to_vector<double>();
    Tensor basis_f32 = q.to(gpu()), basis_split = q.to(gpu());
    const auto f32 = linalg::inverse_root_warm(a.to(gpu()), 4, basis_f32, {.warm_tolerance = 0.1});
    const auto split = linalg::inverse_root_warm(a.to(gpu()), 4, basis_split, {.tf32 = true, .warm_tolerance = 0.1});
    Tensor one_pass_b;
    {
      const cuda::AllowTf32Guard on(true, true);
      const Tensor ag = a.to(gpu()), qg = q.to(gpu());
      one_pass_b = matmul(qg.transpose(-2, -1), matmul(ag, qg));
    }
    const std::vector<double> rf = f32.coupling.to_vector<double>(), rs = split.coupling.to_vector<double>(),
                              r1 = coupling_of(one_pass_b).to_vector<double>();
    for (size_t i = 0; i < size_t(batch); ++i) {
      const double e_f32 = std::abs(rf[i] - want[i]), e_split = std::abs(rs[i] - want[i]),
                   e_one = std::abs(r1[i] - want[i]);
      std::printf("scale %g, ρ of matrix %zu: f64 %.6e; f32 products %.6e (error %.1e), split f16 %.6e (%.1e), one "
                  "TF32 pass %.6e (%.1e)\n", scale, i, want[i], rf[i], e_f32, rs[i], e_split, r1[i], e_one);
      EXPECT_LT(e_split, 3 * e_f32 + 1e-3 * want[i]) << "scale " << scale << ", matrix " << i;
      EXPECT_GT(e_one, 10 * e_split) << "scale " << scale << ", matrix " << i;
    }
    EXPECT_EQ(f32.refreshed, 0) << scale;
    EXPECT_EQ(split.refreshed, 0) << scale;  // kept as with f32 products
  }
}

// The Newton iteration on TF32 tensor cores: converged to its tolerance (2e-3, no fallback) and within the
// precision TF32 allows of the f64 roots; the process's TF32 setting is left as it was.
TEST(CudaLinalg, NewtonRootsOnTf32TensorCores) {
  KILN_REQUIRE_GPU();
  manual_seed(43);
  const bool before = cuda::allow_tf32();
  for (int64_t n : {17, 768, 1024}) {
    const Tensor a = spd(2, n, DType::f32);
    const Tensor want = linalg::inverse_root(cast(a, DType::f64), 4, {.epsilon = 1e-12});
    const auto r = linalg::inverse_root_ex(a.to(gpu()), 4, {.epsilon = 1e-12, .method = linalg::RootMethod::newton,
                                                            .fallback = false, .tf32 = true});
    const double err = max_abs(sub(cast(r.root.cpu(), DType::f64), want)) / max_abs(want);
    std::printf("inverse_root newton tf32 n=%lld: relative error %.2e (%lld iterations)\n", (long long)n, err,
                (long long)r.iterations);
    EXPECT_LT(err, 3e-2) << n;
    EXPECT_EQ(r.fallbacks, 0);
    EXPECT_EQ(cuda::allow_tf32(), before);
  }
}

TEST(CudaLinalg, IllConditionedAndSingularRootsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(43);
  const int64_t n = 64;
  std::vector<double> values(n);
  for (int64_t i = 0; i < n; ++i) values[size_t(i)] = std::pow(10.0, -8.0 * double(i) / double(n - 1));
  const Tensor g = randn({n, n}, {.dtype = DType::f64});
  const Tensor q = linalg::eigh(mul(add(g, g.transpose(0, 1)), 0.5)).eigenvectors;
  const Tensor ill = matmul(mul(q, from_vector(values, {1, n})), q.transpose(0, 1));
  const Tensor b = randn({n, n / 2}, {.dtype = DType::f64});
  const Tensor singular = matmul(b, b.transpose(0, 1));
  for (const Tensor& a : {ill, singular}) {
    // ε relative to the matrix (1e-8·max|a|): a backward-stable eigensolver's eigenvalues may each be off by
    // u·‖a‖ (u = 2^-53), which moves (λ + ε)^(-1/4) by about u·‖a‖ / (4(λ_min + ε)) relatively. With an
    // absolute ε = 1e-10 and ‖a‖ ≈ 100 (the singular one) that is 5e-5, what the H200 measured between
    // cuSOLVER and Eigen, both right; with this ε it is ~1e-9.
    const double eps = 1e-8 * max_abs(a);
    const Tensor want = linalg::inverse_root(a, 4, {.epsilon = eps});
    const Tensor got = linalg::inverse_root(a.to(gpu()), 4, {.epsilon = eps});
    EXPECT_LT(max_abs(sub(got.cpu(), want)) / max_abs(want), 1e-7);
  }
}

}  // namespace
