// Shampoo (optim/shampoo.h) against a direct reference written here (dense eigendecompositions, one block at a
// time, loops over the blocks by hand): a matrix without grafting, a blocked matrix with Adam grafting,
// filtering, decay and momentum, an order-3 tensor, and 1-D parameters (which take Adam's direction); the
// blocking plan; bit-exact resume from a state_dict; warm-started roots from each factor's stored basis; bf16
// parameters with f32 statistics; bad options and non-finite factors as errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/kernels/reduce.h>
#include <kiln/core/linalg.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/shampoo.h>
#include <kiln/optim/shampoo_blocks.h>

#include "../core/core_test_util.h"

namespace kiln::optim {
namespace {

const TensorOptions kF64{.dtype = DType::f64};

double max_abs(const Tensor& t) { return amax(abs(cast(t, DType::f64))).item<double>(); }

// (a + ε·I)^(−1/p) written directly: eigh, the floor rule, V diag(λ^(−1/p)) Vᵀ
Tensor reference_root(const Tensor& a, double p, double eps) {
  const int64_t n = a.size(0);
  const auto [w, v] = linalg::eigh(add(a, mul(linalg::eye(n, kF64), eps)));
  std::vector<double> values = w.to_vector<double>();
  const double lowest = values[0];
  for (double& x : values) x = std::pow(lowest < eps ? x + eps - lowest : x, -1.0 / p);
  return matmul(mul(v, from_vector(values, {1, n})), v.transpose(0, 1));
}

Tensor unfold(const Tensor& g, int64_t i) {
  std::vector<int64_t> perm{i};
  for (int64_t d = 0; d < g.dim(); ++d)
    if (d != i) perm.push_back(d);
  return g.permute(perm).contiguous().reshape({g.size(i), -1});
}

TEST(ShampooBlocks, SqueezesMergesAndSplits) {
  auto p = ShampooBlocks::plan({768, 3072}, 1024);
  EXPECT_EQ(p.merged, (Shape{768, 3072}));
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p.shapes[2], (Shape{768, 1024}));
  EXPECT_EQ(p.starts[2], (std::vector<int64_t>{0, 2048}));
  p = ShampooBlocks::plan({64, 3, 3, 3}, 1024);
  EXPECT_EQ(p.merged, (Shape{576, 3}));
  EXPECT_EQ(p.size(), 1u);
  p = ShampooBlocks::plan({50304, 768}, 1024);
  ASSERT_EQ(p.size(), 50u);
  EXPECT_EQ(p.shapes.back(), (Shape{128, 768}));
  p = ShampooBlocks::plan({1, 5, 1}, 1024);
  EXPECT_EQ(p.merged, (Shape{5}));
  p = ShampooBlocks::plan({}, 1024);
  EXPECT_EQ(p.merged, (Shape{1}));
  p = ShampooBlocks::plan({5, 3}, 1024);  // a small matrix: one dim, one factor of 15
  EXPECT_EQ(p.merged, (Shape{15}));
  p = ShampooBlocks::plan({256, 256, 3, 3}, 1024);
  EXPECT_EQ(p.merged, (Shape{256, 768, 3}));
  // a block is a view of the parameter's elements
  const Tensor t = arange(0.0, 24.0, 1.0, kF64).reshape({6, 4});
  p = ShampooBlocks::plan({6, 4}, 3);
  ASSERT_EQ(p.size(), 4u);
  EXPECT_EQ(p.block(t, 3).contiguous().to_vector<double>(), (std::vector<double>{15, 19, 23}));
}

// Plain Shampoo on one matrix: β1 = 0, sums of GGᵀ and GᵀG, roots every step, no grafting. Five steps of
// `opt` (made by the caller for the (5, 3) parameter w) against the direct reference: the largest difference.
double plain_shampoo_against_the_reference(Shampoo& opt, Tensor& w, Generator& gen) {
  Tensor ref = w.detach().clone();
  Tensor L = zeros({5, 5}, kF64), R = zeros({3, 3}, kF64);
  for (int step = 0; step < 5; ++step) {
    const Tensor g = randn({5, 3}, kF64, &gen);
    w.set_grad(g.clone());
    opt.step();
    L = add(L, matmul(g, g.transpose(0, 1)));
    R = add(R, matmul(g.transpose(0, 1), g));
    ref = sub(ref, mul(matmul(matmul(reference_root(L, 4, 1e-6), g), reference_root(R, 4, 1e-6)), 0.1));
  }
  return max_abs(sub(w.detach(), ref));
}
// max dim 5 keeps the dims apart (5 · 3 > 5): one block, two factors
const ShampooOptions kPlain{.lr = 0.1, .betas = {0.0, 1.0}, .epsilon = 1e-6, .max_preconditioner_dim = 5,
                            .precondition_frequency = 1, .grafting = Grafting::none};

TEST(Shampoo, MatrixWithoutGraftingMatchesTheDirectReference) {
  Generator gen(1);
  Tensor w = randn({5, 3}, kF64, &gen).requires_grad_();
  Shampoo opt({w}, kPlain);
  EXPECT_LT(plain_shampoo_against_the_reference(opt, w, gen), 1e-10);
  EXPECT_EQ(opt.root_updates(), 10);
}

// root_method newton: the same steps as the direct reference (to the iteration's tolerance), the iterations
// counted; with an iteration limit too low to converge, every factor is computed by the eigen method (the
// reference's roots exactly) and counted as a fallback.
TEST(Shampoo, NewtonRootsMatchTheReferenceAndCountTheirFallbacks) {
  for (int limit : {100, 1}) {
    Generator gen(1);
    Tensor w = randn({5, 3}, kF64, &gen).requires_grad_();
    Shampoo opt({w}, kPlain);
    opt.root_method = linalg::RootMethod::newton;
    opt.newton_max_iterations = limit;
    EXPECT_LT(plain_shampoo_against_the_reference(opt, w, gen), limit == 1 ? 1e-10 : 1e-6) << limit;
    EXPECT_EQ(opt.root_updates(), 10);
    // two root jobs a step (sizes 5 and 3), each iterating until its matrix converged or the limit
    EXPECT_GE(opt.newton_iterations(), limit == 1 ? 10 : 20) << limit;
    EXPECT_EQ(opt.newton_fallbacks(), limit == 1 ? 10 : 0) << limit;
  }
}

// Blocks of a (6, 4) matrix at max dim 3 (2 x 2 blocks of 3 x 3 and 3 x 1), β1 and β2 averages with bias
// correction, Adam grafting per block, roots every 2 steps from step 2, decoupled decay and momentum.
// (6, 4) in blocks of rows and columns; (3, 6) in two equal column blocks, which the update reads in place from
// the product's rows as one column-blocked direction, each block with its own grafting scale
TEST(Shampoo, BlockedAdamGraftedMatchesTheDirectReference) {
  for (const Shape& shape : {Shape{6, 4}, Shape{3, 6}}) {
  SCOPED_TRACE(shape_str(shape));
  Generator gen(2);
  const double lr = 0.05, b1 = 0.9, b2 = 0.95, eps = 1e-8, bg = 0.99, geps = 1e-8, wd = 0.1, mu = 0.5;
  Tensor w = randn(shape, kF64, &gen).requires_grad_();
  Tensor ref = w.detach().clone();
  Shampoo opt({w}, {.lr = lr, .betas = {b1, b2}, .epsilon = eps, .weight_decay = wd, .momentum = mu,
                    .max_preconditioner_dim = 3, .precondition_frequency = 2, .grafting = Grafting::adam,
                    .grafting_beta2 = bg, .grafting_epsilon = geps});
  const ShampooBlocks blocks = ShampooBlocks::plan(shape, 3);
  const size_t count = blocks.size();
  EXPECT_EQ(count, shape[0] == 6 ? 4u : 2u);
  std::vector<Tensor> L(count), R(count), rootL(count), rootR(count);
  for (size_t b = 0; b < count; ++b) {
    const int64_t m = blocks.shapes[size_t(b)][0], n = blocks.shapes[size_t(b)][1];
    L[b] = zeros({m, m}, kF64), R[b] = zeros({n, n}, kF64);
    rootL[b] = linalg::eye(m, kF64), rootR[b] = linalg::eye(n, kF64);
  }
  Tensor m1 = zeros(shape, kF64), v = zeros(shape, kF64), buf = zeros(shape, kF64);
  for (int t = 1; t <= 6; ++t) {
    const Tensor g = randn(shape, kF64, &gen);
    w.set_grad(g.clone());
    opt.step();
    m1 = add(mul(m1, b1), mul(g, 1 - b1));
    const Tensor gbar = div(m1, 1 - std::pow(b1, t));
    v = add(mul(v, bg), mul(mul(g, g), 1 - bg));
    const Tensor adam = div(gbar, add(sqrt(div(v, 1 - std::pow(bg, t))), geps));
    Tensor dir = adam.clone();
    for (size_t b = 0; b < count; ++b) {
      const Tensor gb = blocks.block(g, b).contiguous();
      L[b] = add(mul(L[b], b2), mul(matmul(gb, gb.transpose(0, 1)), 1 - b2));
      R[b] = add(mul(R[b], b2), mul(matmul(gb.transpose(0, 1), gb), 1 - b2));
      if (t % 2 == 0) {
        const double bc = 1 / (1 - std::pow(b2, t));
        rootL[b] = reference_root(mul(L[b], bc), 4, eps);
        rootR[b] = reference_root(mul(R[b], bc), 4, eps);
      }
      if (t >= 2) {
        const Tensor pb = matmul(matmul(rootL[b], blocks.block(gbar, b).contiguous()), rootR[b]);
        const Tensor ab = blocks.block(adam, b).contiguous();
        const double scale = std::sqrt(sum(mul(ab, ab)).item<double>()) / (std::sqrt(sum(mul(pb, pb)).item<double>()) + 1e-16);
        blocks.block(dir, b).copy_(mul(pb, scale));
      }
    }
    buf = add(mul(buf, mu), dir);
    ref = sub(mul(ref, 1 - lr * wd), mul(buf, lr));
  }
  EXPECT_LT(max_abs(sub(w.detach(), ref)), 1e-10);
  }
}

// An order-3 tensor (no dims merge at max dim 6): three factors, roots −1/6, applied along each dim.
TEST(Shampoo, OrderThreeTensorMatchesTheDirectReference) {
  Generator gen(3);
  Tensor w = randn({4, 5, 6}, kF64, &gen).requires_grad_();
  Tensor ref = w.detach().clone();
  Shampoo opt({w}, {.lr = 0.1, .betas = {0.0, 1.0}, .epsilon = 1e-6, .max_preconditioner_dim = 6,
                    .precondition_frequency = 1, .grafting = Grafting::none});
  std::vector<Tensor> F{zeros({4, 4}, kF64), zeros({5, 5}, kF64), zeros({6, 6}, kF64)};
  for (int step = 0; step < 3; ++step) {
    const Tensor g = randn({4, 5, 6}, kF64, &gen);
    w.set_grad(g.clone());
    opt.step();
    for (int64_t i = 0; i < 3; ++i) {
      const Tensor gi = unfold(g, i);
      F[size_t(i)] = add(F[size_t(i)], matmul(gi, gi.transpose(0, 1)));
    }
    // P[a,b,c] = Σ R0[a,a'] R1[b,b'] R2[c,c'] G[a',b',c'], written as three contractions
    const Tensor r0 = reference_root(F[0], 6, 1e-6), r1 = reference_root(F[1], 6, 1e-6), r2 = reference_root(F[2], 6, 1e-6);
    Tensor p = matmul(r0, g.reshape({4, 30})).reshape({4, 5, 6});                         // along dim 0
    p = matmul(r1, p.permute({1, 0, 2}).contiguous().reshape({5, 24})).reshape({5, 4, 6}).permute({1, 0, 2});
    p = matmul(p.contiguous().reshape({20, 6}), r2.transpose(0, 1)).reshape({4, 5, 6});  // along dim 2
    ref = sub(ref, mul(p, 0.1));
  }
  EXPECT_LT(max_abs(sub(w.detach(), ref)), 1e-10);
}

// AdaGrad grafting with a first moment, Nesterov momentum and decoupled decay on a 1-D parameter (which takes
// the grafted direction), against the formulas step by step in double.
TEST(Shampoo, AdaGradGraftingWithNesterovMomentumMatchesTheFormulas) {
  Generator gen(5);
  const int64_t n = 9;
  Tensor p = randn({n}, kF64, &gen).requires_grad_();
  const double lr = 0.03, b1 = 0.8, eps = 1e-6, wd = 0.05, mu = 0.7;
  Shampoo opt({p}, {.lr = lr, .betas = {b1, 0.99}, .weight_decay = wd, .momentum = mu, .nesterov = true,
                    .grafting = Grafting::adagrad, .grafting_epsilon = eps});
  std::vector<double> w = p.detach().to_vector<double>(), m(n, 0.0), v(n, 0.0), buf(n, 0.0);
  for (int t = 1; t <= 4; ++t) {
    const Tensor g = randn({n}, kF64, &gen);
    p.set_grad(g.clone());
    opt.step();
    const std::vector<double> gv = g.to_vector<double>();
    for (int64_t i = 0; i < n; ++i) {
      m[i] = b1 * m[i] + (1 - b1) * gv[i];
      v[i] += gv[i] * gv[i];
      const double d = m[i] / (1 - std::pow(b1, t)) / (std::sqrt(v[i]) + eps);
      buf[i] = mu * buf[i] + d;
      w[i] = w[i] * (1 - lr * wd) - lr * (d + mu * buf[i]);
    }
  }
  EXPECT_TRUE(kiln::test::AllClose(p.detach().to_vector<double>(), w, 1e-13));
}

// A 1-D parameter with Adam grafting and no momentum or decay steps exactly as Adam does.
TEST(Shampoo, OneDimensionalParametersTakeTheGraftedDirection) {
  Generator gen(4);
  Tensor a = randn({7}, kF64, &gen).requires_grad_();
  Tensor b = a.detach().clone().requires_grad_();
  Shampoo shampoo({a}, {.lr = 0.01, .betas = {0.9, 0.999}, .grafting_beta2 = 0.999, .grafting_epsilon = 1e-8});
  AdamW adam({b}, {.lr = 0.01, .betas = {0.9, 0.999}, .eps = 1e-8, .weight_decay = 0.0});
  for (int step = 0; step < 4; ++step) {
    const Tensor g = randn({7}, kF64, &gen);
    a.set_grad(g.clone());
    b.set_grad(g.clone());
    shampoo.step();
    adam.step();
  }
  EXPECT_LT(max_abs(sub(a.detach(), b.detach())), 1e-12);
  EXPECT_EQ(shampoo.state(0).tensors.count("factor.0.0"), 0u);
}

TEST(Shampoo, ResumesBitForBitFromItsStateDict) {
  Generator gen(5);
  const ShampooOptions o{.lr = 0.02, .momentum = 0.9, .max_preconditioner_dim = 4, .precondition_frequency = 2};
  Tensor w1 = randn({6, 5}, {}, &gen).requires_grad_(), b1 = randn({5}, {}, &gen).requires_grad_();
  Shampoo a({w1, b1}, o);
  std::vector<Tensor> grads;
  for (int i = 0; i < 8; ++i) grads.push_back(randn({6, 5}, {}, &gen)), grads.push_back(randn({5}, {}, &gen));
  auto step = [&](Shampoo& opt, Tensor& w, Tensor& b, int i) {
    w.set_grad(grads[size_t(2 * i)].clone());
    b.set_grad(grads[size_t(2 * i + 1)].clone());
    opt.step();
  };
  for (int i = 0; i < 3; ++i) step(a, w1, b1, i);
  Tensor w2 = w1.detach().clone().requires_grad_(), b2 = b1.detach().clone().requires_grad_();
  Shampoo b({w2, b2}, o);
  b.load_state_dict(a.state_dict());
  EXPECT_TRUE(b.state(0).tensors.count("factor.1.0"));
  for (int i = 3; i < 8; ++i) step(a, w1, b1, i), step(b, w2, b2, i);
  EXPECT_EQ(w1.detach().to_vector<float>(), w2.detach().to_vector<float>());
  EXPECT_EQ(b1.detach().to_vector<float>(), b2.detach().to_vector<float>());
  // a state whose factor has the wrong size is refused, naming it
  OptimizerStateDict bad = a.state_dict();
  bad.state[0].tensors["factor.0.0"] = zeros({3, 3});
  Shampoo c({w2, b2}, o);
  EXPECT_KILN_ERROR(c.load_state_dict(bad), "factor.0.0", "[3, 3]", "[4, 4]");
}

// The batched path (order-2 blocks of one shape from several parameters stacked into one group) gives what
// one optimizer per parameter gives (every group of one member), in f64: matrices of shared and odd block
// shapes, an order-3 tensor and a 1-D parameter beside them, a parameter without a gradient on one step (the
// group's members change, its factors are stacked again), parameter groups with another start step and
// without grafting, and a state_dict round trip in the middle (loaded tensors, stacked again).
TEST(Shampoo, BatchedBlocksMatchOneOptimizerPerParameter) {
  Generator gen(9);
  const std::vector<Shape> shapes = {{8, 6}, {8, 6}, {6, 8}, {5, 4}, {2, 3, 4}, {7}};
  std::vector<Tensor> all, one;
  for (const Shape& s : shapes) {
    all.push_back(randn(s, kF64, &gen).requires_grad_());
    one.push_back(all.back().detach().clone().requires_grad_());
  }
  const ShampooOptions base{.lr = 0.05, .betas = {0.9, 0.99}, .epsilon = 1e-6, .momentum = 0.5,
                            .max_preconditioner_dim = 4, .precondition_frequency = 2};
  ShampooOptions late = base;  // a second parameter group: preconditions from step 4, no grafting
  late.start_preconditioning_step = 4;
  late.grafting = Grafting::none;
  Shampoo together({all[0], all[2], all[4], all[5]}, base);
  together.add_param_group({all[1], all[3]}, late);
  std::vector<std::unique_ptr<Shampoo>> alone;
  for (size_t i = 0; i < all.size(); ++i)
    alone.push_back(std::make_unique<Shampoo>(std::vector<Tensor>{one[i]}, i == 1 || i == 3 ? late : base));
  for (int step = 0; step < 7; ++step) {
    for (size_t i = 0; i < all.size(); ++i) {
      const bool skipped = step == 3 && i == 2;  // no gradient this step
      const Tensor g = randn(shapes[i], kF64, &gen);
      all[i].set_grad(skipped ? Tensor() : g.clone());
      one[i].set_grad(skipped ? Tensor() : g.clone());
    }
    together.step();
    for (auto& opt : alone) opt->step();
    if (step == 4) {  // the groups' stacked factors are rebuilt from loaded tensors
      Shampoo reloaded({all[0], all[2], all[4], all[5]}, base);
      reloaded.add_param_group({all[1], all[3]}, late);
      reloaded.load_state_dict(together.state_dict());
      together.load_state_dict(reloaded.state_dict());
    }
    for (size_t i = 0; i < all.size(); ++i)
      EXPECT_LT(max_abs(sub(all[i], one[i])), 1e-12 * (1 + max_abs(one[i]))) << "parameter " << i << " step " << step;
  }
  EXPECT_GT(together.root_updates(), 0);
}

// root_method warm_eigen: every root is Q·M·Qᵀ with Q the factor's stored eigenbasis, M the first-order
// expansion of B^(−1/4) about B's diagonal, B = QᵀAQ of the bias-corrected, ridged factor A (diagonal where
// Q was refreshed: then M = diag(λ^(−1/4)) with λ the eigenvalues); the
// basis is refreshed while the factors move fast and reused once they settle; the parameters stay near the
// eigen method's run.
TEST(Shampoo, WarmStartedRootsComeFromTheStoredBasis) {
  Generator gen(12);
  const double b2 = 0.999, eps = 1e-6;
  const ShampooOptions o{.lr = 0.01, .betas = {0.0, b2}, .epsilon = eps, .max_preconditioner_dim = 8,
                         .precondition_frequency = 1};
  Tensor w = randn({8, 6}, kF64, &gen).requires_grad_(), v = w.detach().clone().requires_grad_();
  const Tensor start = w.detach().clone();
  Shampoo warm({w}, o), eigen({v}, o);
  warm.root_method = linalg::RootMethod::warm_eigen;
  warm.warm_tolerance = 0.1;
  const Tensor mean = randn({8, 6}, kF64, &gen);  // gradients around a mean: the factors settle
  for (int step = 1; step <= 30; ++step) {
    const Tensor g = add(mean, mul(randn({8, 6}, kF64, &gen), 0.3));
    w.set_grad(g.clone());
    v.set_grad(g.clone());
    warm.step();
    eigen.step();
    const double scale = 1.0 / (1.0 - std::pow(b2, double(step)));
    for (int i = 0; i < 2; ++i) {
      const auto& st = warm.state(0).tensors;
      const Tensor q = st.at("eigenbasis.0." + std::to_string(i));
      const int64_t n = q.size(0);
      const Tensor a = add(mul(st.at("factor.0." + std::to_string(i)), scale), mul(linalg::eye(n, kF64), eps));
      // B = qᵀ·a·q; λ its diagonal (lifted); the root q·M·qᵀ with M_ii = λ_i^(−1/4) and, off the diagonal,
      // M_ij = B_ij·(λ_i^(−1/4) − λ_j^(−1/4))/(λ_i − λ_j) (the derivative where they agree)
      const Tensor b = matmul(matmul(q.transpose(0, 1), a), q);
      const std::vector<double> bv = b.contiguous().to_vector<double>();
      std::vector<double> lambda(size_t(n), 0.0);
      for (int64_t k = 0; k < n; ++k) lambda[size_t(k)] = bv[size_t(k * n + k)];
      const double lowest = *std::min_element(lambda.begin(), lambda.end());
      if (lowest < eps)
        for (double& x : lambda) x += eps - lowest;
      std::vector<double> m(size_t(n * n));
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < n; ++c) {
          const double li = lambda[size_t(r)], lj = lambda[size_t(c)];
          const double slope = std::fabs(li - lj) <= 1e-6 * (li + lj) / 2
                                   ? -0.25 * std::pow((li + lj) / 2, -1.25)
                                   : (std::pow(li, -0.25) - std::pow(lj, -0.25)) / (li - lj);
          m[size_t(r * n + c)] = r == c ? std::pow(li, -0.25) : bv[size_t(r * n + c)] * slope;
        }
      const Tensor expected = matmul(matmul(q, from_vector(m, {n, n})), q.transpose(0, 1));
      EXPECT_LT(max_abs(sub(st.at("root.0." + std::to_string(i)), expected)), 1e-7 * max_abs(expected))
          << "step " << step << " factor " << i;
    }
  }
  EXPECT_EQ(warm.root_updates(), 60);
  EXPECT_GT(warm.eigen_refreshes(), 2);   // the first steps move the factors far
  EXPECT_LT(warm.eigen_refreshes(), 40);  // later ones reuse the basis
  // the two runs part by a small fraction of how far they moved
  EXPECT_LT(max_abs(sub(w, v)), 0.05 * max_abs(sub(v, start)));
}

TEST(Shampoo, Bf16ParametersKeepF32Statistics) {
  Generator gen(6);
  Tensor w = cast(randn({4, 3}, {}, &gen), DType::bf16).requires_grad_();
  Shampoo opt({w}, {.lr = 0.01, .max_preconditioner_dim = 4, .precondition_frequency = 1});
  for (int i = 0; i < 2; ++i) {
    w.set_grad(cast(randn({4, 3}, {}, &gen), DType::bf16));
    opt.step();
  }
  EXPECT_EQ(w.dtype(), DType::bf16);
  EXPECT_EQ(opt.state(0).tensors.at("factor.0.0").dtype(), DType::f32);
  EXPECT_EQ(opt.state(0).tensors.at("root.0.1").dtype(), DType::f32);
  EXPECT_TRUE(all_true(isfinite(w)));
}

// Shampoo::bf16: the statistics are the f32 sums of the bf16-rounded gradients' products (exactly, where f32
// gradients would be ~4e-3 off), and each step is the direct reference's with its operands rounded to bf16
// where the products take them (the roots cast to bf16 again after every root update: roots every step
// here). The reference stays nearer the bf16 run than the f32 run does (which shows the rounding ran).
TEST(Shampoo, Bf16ProductsRoundTheirOperandsOnce) {
  auto bf16_round = [](const Tensor& t) { return cast(cast(cast(t, DType::f32), DType::bf16), DType::f64); };
  Generator gen(12);
  const Tensor w0 = randn({5, 3}, {}, &gen);
  Tensor w = w0.clone().requires_grad_(), w_f32 = w0.clone().requires_grad_();
  ShampooOptions o = kPlain;
  o.epsilon = 0.1;  // the roots well-conditioned: f32's and f64's factors give the same bf16 roots
  Shampoo opt({w}, o), f32_opt({w_f32}, o);
  opt.bf16 = true;
  Tensor ref = cast(w0, DType::f64), L = zeros({5, 5}, kF64), R = zeros({3, 3}, kF64);
  for (int step = 0; step < 5; ++step) {
    const Tensor g = randn({5, 3}, {}, &gen);
    w.set_grad(g.clone());
    w_f32.set_grad(g.clone());
    opt.step();
    f32_opt.step();
    const Tensor gb = bf16_round(g);
    L = add(L, matmul(gb, gb.transpose(0, 1)));
    R = add(R, matmul(gb.transpose(0, 1), gb));
    EXPECT_LT(max_abs(sub(cast(opt.state(0).tensors.at("factor.0.0"), DType::f64), L)), 1e-6 * max_abs(L)) << step;
    const Tensor left = bf16_round(matmul(bf16_round(reference_root(L, 4, 0.1)), gb));
    ref = sub(ref, mul(matmul(left, bf16_round(reference_root(R, 4, 0.1))), 0.1));
  }
  const double to_reference = max_abs(sub(cast(w, DType::f64), ref)),
               to_f32 = max_abs(sub(cast(w, DType::f64), cast(w_f32, DType::f64)));
  std::printf("bf16 products: %.2e from their reference, %.2e from the f32 run\n", to_reference, to_f32);
  EXPECT_LT(to_reference, 0.01 * to_f32);
  EXPECT_GT(to_f32, 1e-4);
  f32_opt.tf32 = f32_opt.bf16 = true;
  EXPECT_KILN_ERROR(f32_opt.step(), "Shampoo", "tf32", "bf16");
}

// bf16 products over several parameters and blocks: the groups whose blocks are whole rows of their
// parameters ((3, 3): two blocks of a (7, 3) and a (3, 3); (1, 3): the (7, 3)'s last) take G and Ḡ in bf16
// from the moments kernel, written into their stacks; the others ((2, 3), (2, 2): a (2, 5)'s column blocks)
// gather them. Every block follows its own f64 reference with the same roundings as the one-block test.
TEST(Shampoo, Bf16OperandsWrittenByTheMomentsOrGatheredFollowTheReference) {
  auto bf16_round = [](const Tensor& t) { return cast(cast(cast(t, DType::f32), DType::bf16), DType::f64); };
  Generator gen(13);
  // (3, 6): two equal column blocks, in the (3, 3) group with the (7, 3)'s and the (3, 3), whose operands the
  // moments write (the (2, 5)'s unequal column blocks send its (2, 3) block's group to the gathers)
  const std::vector<Shape> shapes{{7, 3}, {3, 3}, {2, 5}, {3, 6}};
  std::vector<Tensor> ws, ws_f32, refs;
  for (const Shape& shape : shapes) {
    const Tensor w0 = randn(shape, {}, &gen);
    ws.push_back(w0.clone().requires_grad_());
    ws_f32.push_back(w0.clone().requires_grad_());
    refs.push_back(cast(w0, DType::f64));
  }
  ShampooOptions o = kPlain;
  o.epsilon = 0.1;
  o.max_preconditioner_dim = 3;
  Shampoo opt(ws, o), f32_opt(ws_f32, o);
  opt.bf16 = true;
  std::vector<ShampooBlocks> plans;
  std::vector<std::vector<std::pair<Tensor, Tensor>>> factors;  // per parameter, per block: (L, R) in f64
  for (const Shape& shape : shapes) {
    plans.push_back(ShampooBlocks::plan(shape, 3));
    factors.emplace_back();
    for (const Shape& b : plans.back().shapes) factors.back().push_back({zeros({b[0], b[0]}, kF64), zeros({b[1], b[1]}, kF64)});
  }
  EXPECT_EQ(plans[0].size(), 3u);
  EXPECT_EQ(plans[2].size(), 2u);
  EXPECT_EQ(plans[3].shapes, (std::vector<Shape>{{3, 3}, {3, 3}}));
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const Tensor g = randn(shapes[i], {}, &gen);
      ws[i].set_grad(g.clone());
      ws_f32[i].set_grad(g.clone());
      Tensor direction = zeros(shapes[i], kF64);
      for (size_t b = 0; b < plans[i].size(); ++b) {
        const Tensor gb = bf16_round(plans[i].block(g, b));
        auto& [L, R] = factors[i][b];
        L = add(L, matmul(gb, gb.transpose(0, 1)));
        R = add(R, matmul(gb.transpose(0, 1), gb));
        const Tensor left = bf16_round(matmul(bf16_round(reference_root(L, 4, 0.1)), gb));
        plans[i].block(direction, b).copy_(matmul(left, bf16_round(reference_root(R, 4, 0.1))));
      }
      refs[i] = sub(refs[i], mul(direction, 0.1));
    }
    opt.step();
    f32_opt.step();
  }
  for (size_t i = 0; i < ws.size(); ++i) {
    const double to_reference = max_abs(sub(cast(ws[i], DType::f64), refs[i])),
                 to_f32 = max_abs(sub(cast(ws[i], DType::f64), cast(ws_f32[i], DType::f64)));
    std::printf("parameter %s: %.2e from the reference, %.2e from the f32 run\n", shape_str(shapes[i]).c_str(),
                to_reference, to_f32);
    EXPECT_LT(to_reference, 0.01 * to_f32) << i;
    EXPECT_GT(to_f32, 1e-4) << i;
  }
  // With Adam's grafting, a first moment and momentum (the kernel then keeps a written block's Ḡ in bf16
  // only): the (7, 3) and the (3, 6) alone, their (3, 3) blocks written by the moments (the (3, 6)'s two column
  // blocks as one column-blocked companion, its update reading its direction so), step to the same bits as
  // beside a (3, 5), whose unequal column blocks send the (3, 3) group to the gathers
  const ShampooOptions adam{.lr = 0.05, .betas = {0.9, 0.99}, .epsilon = 0.1, .weight_decay = 0.01, .momentum = 0.5,
                            .max_preconditioner_dim = 3, .precondition_frequency = 2, .start_preconditioning_step = 2};
  const Tensor p0 = randn({7, 3}, {}, &gen), q0 = randn({3, 6}, {}, &gen);
  Tensor alone = p0.clone().requires_grad_(), beside = p0.clone().requires_grad_();
  Tensor columns = q0.clone().requires_grad_(), columns_beside = q0.clone().requires_grad_();
  Tensor other = randn({3, 5}, {}, &gen).requires_grad_();
  Shampoo written({alone, columns}, adam), gathered({beside, columns_beside, other}, adam);
  written.bf16 = gathered.bf16 = true;
  for (int step = 0; step < 5; ++step) {
    const Tensor g = randn({7, 3}, {}, &gen), h = randn({3, 6}, {}, &gen);
    alone.set_grad(g.clone());
    beside.set_grad(g.clone());
    columns.set_grad(h.clone());
    columns_beside.set_grad(h.clone());
    other.set_grad(randn({3, 5}, {}, &gen));
    written.step();
    gathered.step();
    EXPECT_TRUE(all_true(eq(alone, beside))) << "step " << step;
    EXPECT_TRUE(all_true(eq(columns, columns_beside))) << "step " << step;
  }
  EXPECT_GT(max_abs(sub(cast(alone, DType::f64), cast(p0, DType::f64))), 0.01);
  EXPECT_GT(max_abs(sub(cast(columns, DType::f64), cast(q0, DType::f64))), 0.01);
}

// x's k column blocks of width c stacked: the (k, R, c) column-blocked companion of x (kernels' ColumnBlocks)
static Tensor column_companion(const Tensor& x, int64_t c) {
  std::vector<Tensor> blocks;
  for (int64_t b = 0; b < x.size(1) / c; ++b) blocks.push_back(x.narrow(1, b * c, c));
  return stack(blocks);
}

// The kernels with column-blocked companions (Shampoo's stacks of a matrix cut into equal column blocks): the
// moments' copies are the flat copies' column blocks, and the update reading a direction so, block b scaled by
// scale[b], gives the bits of the direction scaled block by block into a flat tensor, then the update. Other
// shapes of companion read element for element; a scale of the wrong length is an error.
TEST(Shampoo, KernelsWithColumnBlockedCompanionsGiveTheBitsOfTheFlatOnes) {
  Generator gen(15);
  for (const DType dt : {DType::f32, DType::f64}) {
    const TensorOptions o{.dtype = dt};
    const Tensor p0 = randn({5, 12}, o, &gen), d = randn({5, 12}, o, &gen), b0 = randn({5, 12}, o, &gen);
    const Tensor scales = tensor(std::vector<double>{0.37, 1.9, 0.0}, {3}, o);
    Tensor flat = empty_like(d);
    std::vector<Tensor> from, to;
    const Tensor companion = column_companion(d, 4);
    for (int64_t b = 0; b < 3; ++b) from.push_back(companion.select(0, b)), to.push_back(flat.narrow(1, 4 * b, 4));
    kernels::scale_matrices(from, to, scales);
    const ShampooApplyHyper h{0.03, 0.1, 0.9, true};
    Tensor p_flat = p0.clone(), b_flat = b0.clone(), p_read = p0.clone(), b_read = b0.clone();
    kernels::shampoo_apply({p_flat}, {flat}, {b_flat}, {}, {}, h);
    kernels::shampoo_apply({p_read}, {companion}, {b_read}, {}, {scales}, h);
    EXPECT_TRUE(all_true(eq(p_read, p_flat))) << dtype_name(dt);
    EXPECT_TRUE(all_true(eq(b_read, b_flat))) << dtype_name(dt);
    EXPECT_FALSE(all_true(eq(p_read.narrow(1, 0, 4), p0.narrow(1, 0, 4))));
    EXPECT_KILN_ERROR(kernels::shampoo_apply({p_read}, {companion}, {b_read}, {}, {scales.narrow(0, 0, 1)}, h),
                      "shampoo_apply", "scale", "[1]", "[3, 5, 4]");
    // a (3, 4, 5) direction is no companion of a (5, 12) parameter: read element for element
    Tensor p_any = p0.clone(), b_any = b0.clone(), p_flat2 = p0.clone(), b_flat2 = b0.clone();
    kernels::shampoo_apply({p_any}, {d.reshape({3, 4, 5})}, {b_any}, {}, {}, h);
    kernels::shampoo_apply({p_flat2}, {d}, {b_flat2}, {}, {}, h);
    EXPECT_TRUE(all_true(eq(p_any, p_flat2))) << dtype_name(dt);
  }
  const Tensor g = randn({5, 12}, {}, &gen), m0 = randn({5, 12}, {}, &gen), v0 = abs(randn({5, 12}, {}, &gen));
  const ShampooMomentsHyper h{0.9, 1.0 - std::pow(0.9, 2.0), 3, 0.99, 1.0 - std::pow(0.99, 2.0), 1e-8};
  Tensor m1 = m0.clone(), v1 = v0.clone(), f1 = empty({5, 12}), r1 = empty({5, 12});
  Tensor gc1 = empty({5, 12}, {.dtype = DType::bf16}), fc1 = empty_like(gc1);
  Tensor m2 = m0.clone(), v2 = v0.clone(), r2 = empty({5, 12});
  Tensor gc2 = empty({3, 5, 4}, {.dtype = DType::bf16}), fc2 = empty_like(gc2);
  kernels::shampoo_moments({g}, {m1}, {v1}, {f1}, {r1}, {gc1}, {fc1}, {}, h);
  kernels::shampoo_moments({g}, {m2}, {v2}, {Tensor()}, {r2}, {gc2}, {fc2}, {}, h);
  EXPECT_TRUE(all_true(eq(gc2, column_companion(gc1, 4))));
  EXPECT_TRUE(all_true(eq(fc2, column_companion(fc1, 4))));
  EXPECT_TRUE(all_true(eq(r2, r1)));
  EXPECT_TRUE(all_true(eq(m2, m1)));
  // column-blocked copies come alike and without a grafted sum
  EXPECT_KILN_ERROR(kernels::shampoo_moments({g}, {m2}, {v2}, {Tensor()}, {r2}, {gc2}, {empty({60}, {.dtype = DType::bf16})},
                                             {}, h),
                    "shampoo_moments", "column-blocked alike");
  EXPECT_KILN_ERROR(kernels::shampoo_moments({g}, {m2}, {v2}, {f1}, {r2}, {gc2}, {fc2}, {empty({1})}, h),
                    "shampoo_moments", "without a grafted sum");
}

// The update's direction scale (kernels::shampoo_apply reading a block's direction where its product left it)
// gives the bits the scaled copy of the direction (kernels::scale_matrices) followed by the update gave: f32
// and f64 state, Nesterov momentum and decay. And the moments kernel with its f32 filtered gradient left out
// (kept only as its bf16 copy) writes the same grafted direction and copies as with it.
TEST(Shampoo, KernelsReadingBlocksInPlaceGiveTheBitsOfTheCopies) {
  Generator gen(14);
  for (const DType dt : {DType::f32, DType::f64}) {
    const TensorOptions o{.dtype = dt};
    const Tensor p0 = randn({6, 5}, o, &gen), d = randn({6, 5}, o, &gen), b0 = randn({6, 5}, o, &gen);
    const Tensor scale = tensor(std::vector<double>{0.37}, {1}, o);
    Tensor p_copy = p0.clone(), b_copy = b0.clone(), scaled = empty_like(d);
    kernels::scale_matrices({d}, {scaled}, scale);
    const ShampooApplyHyper h{0.03, 0.1, 0.9, true};
    kernels::shampoo_apply({p_copy}, {scaled}, {b_copy}, {}, {}, h);
    Tensor p_read = p0.clone(), b_read = b0.clone();
    kernels::shampoo_apply({p_read}, {d.reshape({30})}, {b_read}, {}, {scale}, h);  // a direction of any shape
    EXPECT_TRUE(all_true(eq(p_read, p_copy))) << dtype_name(dt);
    EXPECT_TRUE(all_true(eq(b_read, b_copy))) << dtype_name(dt);
    EXPECT_FALSE(all_true(eq(p_read, p0)));
    EXPECT_KILN_ERROR(kernels::shampoo_apply({p_read}, {d}, {b_read}, {}, {tensor(std::vector<double>{1, 2}, {2}, o)}, h),
                      "shampoo_apply", "scale", "[2]");
  }
  const Tensor g = randn({40}, {}, &gen), m0 = randn({40}, {}, &gen), v0 = abs(randn({40}, {}, &gen));
  const ShampooMomentsHyper h{0.9, 1.0 - std::pow(0.9, 2.0), 3, 0.99, 1.0 - std::pow(0.99, 2.0), 1e-8};
  Tensor m1 = m0.clone(), v1 = v0.clone(), f1 = empty({40}), r1 = empty({40}), fc1 = empty({40}, {.dtype = DType::bf16});
  Tensor m2 = m0.clone(), v2 = v0.clone(), r2 = empty({40}), fc2 = empty({40}, {.dtype = DType::bf16});
  kernels::shampoo_moments({g}, {m1}, {v1}, {f1}, {r1}, {}, {fc1}, {}, h);
  kernels::shampoo_moments({g}, {m2}, {v2}, {Tensor()}, {r2}, {}, {fc2}, {}, h);
  EXPECT_TRUE(all_true(eq(r2, r1)));
  EXPECT_TRUE(all_true(eq(fc2, fc1)));
  EXPECT_TRUE(all_true(eq(fc1, cast(f1, DType::bf16))));
  EXPECT_TRUE(all_true(eq(m2, m1)));
  // without a copy, or without grafting, the filtered gradient must be there
  EXPECT_KILN_ERROR(kernels::shampoo_moments({g}, {m2}, {v2}, {Tensor()}, {r2}, {}, {}, {}, h), "shampoo_moments",
                    "filtered gradient", "[40]");
}

// kernels::shampoo_moments' sums of the grafted directions (Shampoo's ‖D_b‖² of a block the update reads in
// place): on the CPU the bits of kernels::matrix_sum_squares over the written direction, also where the
// direction is not written; m and v as without the sum. A direction left undefined without its sum, or sums
// without grafting, are errors.
TEST(Shampoo, MomentsSumTheGraftedDirectionsAsTheBlocksNormsDo) {
  Generator gen(15);
  for (const DType dt : {DType::f32, DType::f64})
    for (const int grafting : {3, 2}) {
      const TensorOptions o{.dtype = dt};
      const Tensor g = randn({6, 7}, o, &gen), m0 = randn({6, 7}, o, &gen), v0 = abs(randn({6, 7}, o, &gen));
      const ShampooMomentsHyper h{0.9, 1.0 - std::pow(0.9, 3.0), grafting, 0.99, 1.0 - std::pow(0.99, 3.0), 1e-8};
      Tensor m1 = m0.clone(), v1 = v0.clone(), f1 = empty({6, 7}, o), r1 = empty({6, 7}, o), s1 = empty({1}, o);
      Tensor m2 = m0.clone(), v2 = v0.clone(), f2 = empty({6, 7}, o), s2 = empty({1}, o);
      kernels::shampoo_moments({g}, {m1}, {v1}, {f1}, {r1}, {}, {}, {s1}, h);
      kernels::shampoo_moments({g}, {m2}, {v2}, {f2}, {Tensor()}, {}, {}, {s2}, h);
      const Tensor want = empty({1}, o);
      kernels::matrix_sum_squares({r1}, want);
      EXPECT_TRUE(all_true(eq(s1, want))) << dtype_name(dt) << " " << grafting;
      EXPECT_TRUE(all_true(eq(s2, want))) << dtype_name(dt) << " " << grafting;
      EXPECT_TRUE(all_true(eq(m2, m1)) && all_true(eq(v2, v1)) && all_true(eq(f2, f1)));
      EXPECT_GT(s1.item<double>(), 0.0);
      EXPECT_KILN_ERROR(kernels::shampoo_moments({g}, {m2}, {v2}, {f2}, {Tensor()}, {}, {}, {}, h), "shampoo_moments",
                        "grafted direction", "[6, 7]");
      EXPECT_KILN_ERROR(kernels::shampoo_moments({g}, {m2}, {v2}, {f2}, {r1}, {}, {}, {empty({2}, o)}, h),
                        "shampoo_moments", "grafted sum", "[2]");
    }
  const Tensor g = randn({8}, {}, &gen);
  const ShampooMomentsHyper none{0.9, 1.0 - 0.9, 0, 0.0, 1.0, 1e-8};
  EXPECT_KILN_ERROR(kernels::shampoo_moments({g}, {zeros({8})}, {}, {empty({8})}, {}, {}, {}, {empty({1})}, none),
                    "shampoo_moments", "grafting");
}

// A root that fails (ε = 0 and a factor of zeros: its eigenvalues 0, its root infinite in f32 and in the f64
// retry) keeps the previous root and counts the failure in "root_failures"; a root that succeeds sets its
// count back to 0, and a parameter whose roots succeed beside it keeps its count at 0; max_root_failures
// failures in a row are an error naming the factor and its parameter, raised once the step's other counts
// are written.
TEST(Shampoo, FailedRootsKeepThePreviousRootUntilTheLimit) {
  manual_seed(5);
  Tensor w = ones({3, 3}).requires_grad_(), v = ones({2, 2}).requires_grad_();
  Shampoo opt({w, v}, {.epsilon = 0.0, .max_preconditioner_dim = 3, .precondition_frequency = 1,
                       .start_preconditioning_step = 1});
  opt.max_root_failures = 2;
  auto step = [&](const Tensor& wg) {
    w.set_grad(wg);
    v.set_grad(randn({2, 2}));
    opt.step();
  };
  auto counts = [&](int64_t param) { return opt.state(param).tensors.at("root_failures").to_vector<double>(); };
  step(zeros({3, 3}));  // w's factors stay zero: both its roots fail
  EXPECT_EQ(opt.f64_retries(), 2);
  EXPECT_EQ(opt.kept_roots(), 2);
  EXPECT_EQ(counts(0), (std::vector<double>{1, 1}));
  EXPECT_EQ(counts(1), (std::vector<double>{0, 0}));
  EXPECT_TRUE(all_true(eq(opt.state(0).tensors.at("root.0.0"), linalg::eye(3, {}))));  // the previous root: I
  EXPECT_TRUE(all_true(isfinite(w)));
  step(randn({3, 3}));  // a gradient: w's roots succeed, its counts back to 0
  EXPECT_EQ(counts(0), (std::vector<double>{0, 0}));
  EXPECT_EQ(opt.kept_roots(), 2);
  EXPECT_FALSE(all_true(eq(opt.state(0).tensors.at("root.0.0"), linalg::eye(3, {}))));

  Tensor z = ones({3, 3}).requires_grad_();
  Shampoo limited({z, v}, {.epsilon = 0.0, .max_preconditioner_dim = 3, .precondition_frequency = 1,
                           .start_preconditioning_step = 1});
  limited.max_root_failures = 2;
  z.set_grad(zeros({3, 3}));
  v.set_grad(randn({2, 2}));
  limited.step();
  EXPECT_EQ(limited.state(0).tensors.at("root_failures").to_vector<double>(), (std::vector<double>{1, 1}));
  v.set_grad(randn({2, 2}));
  EXPECT_KILN_ERROR(limited.step(), "Shampoo", "factor [3, 3]", "parameter 0", "failed 2 times in a row",
                    "max_root_failures = 2");
  EXPECT_EQ(limited.root_updates(), 8);  // both steps' 4 roots counted
  EXPECT_EQ(limited.state(1).tensors.at("root_failures").to_vector<double>(), (std::vector<double>{0, 0}));

  // one parameter, one root failing and one not (in two jobs: 3 x 3 and 2 x 2): a gradient with a zero row
  // makes G·Gᵀ singular and Gᵀ·G not; its counts 1 and 0, then both 0 after a full gradient
  Tensor r = ones({3, 2}).requires_grad_();
  Shampoo mixed({r}, {.epsilon = 0.0, .max_preconditioner_dim = 3, .precondition_frequency = 1,
                      .start_preconditioning_step = 1});
  r.set_grad(tensor({1, 2, 0, 0, -3, 1}, {3, 2}));
  mixed.step();
  EXPECT_EQ(mixed.state(0).tensors.at("root_failures").to_vector<double>(), (std::vector<double>{1, 0}));
  EXPECT_EQ(mixed.kept_roots(), 1);
  r.set_grad(tensor({1, 2, 4, -1, -3, 1}, {3, 2}));
  mixed.step();
  EXPECT_EQ(mixed.state(0).tensors.at("root_failures").to_vector<double>(), (std::vector<double>{0, 0}));
  EXPECT_EQ(mixed.kept_roots(), 1);

  // an error in a later job (jobs run by size: the 2 x 2 factors before the 3 x 3): the roots the earlier
  // job wrote have their counts reset on the way out
  Tensor a = ones({3, 3}).requires_grad_(), c = ones({2, 2}).requires_grad_();
  Shampoo failing({a, c}, {.epsilon = 0.0, .max_preconditioner_dim = 3, .precondition_frequency = 1,
                           .start_preconditioning_step = 1});
  a.set_grad(randn({3, 3}));
  c.set_grad(zeros({2, 2}));
  failing.step();
  EXPECT_EQ(failing.state(1).tensors.at("root_failures").to_vector<double>(), (std::vector<double>{1, 1}));
  a.set_grad(full({3, 3}, NAN));
  c.set_grad(randn({2, 2}));
  EXPECT_KILN_ERROR(failing.step(), "Shampoo", "factor [3, 3]", "parameter 0", "non-finite");
  EXPECT_EQ(failing.state(1).tensors.at("root_failures").to_vector<double>(), (std::vector<double>{0, 0}));
}

TEST(Shampoo, BadOptionsAndNonFiniteFactorsAreErrors) {
  Tensor w = ones({3, 3}).requires_grad_();
  EXPECT_KILN_ERROR(Shampoo({w}, {.betas = {1.0, 0.9}}), "Shampoo", "beta1");
  EXPECT_KILN_ERROR(Shampoo({w}, {.betas = {0.9, 0.0}}), "Shampoo", "beta2");
  EXPECT_KILN_ERROR(Shampoo({w}, {.precondition_frequency = 0}), "Shampoo", "precondition_frequency");
  EXPECT_KILN_ERROR(Shampoo({w}, {.max_preconditioner_dim = 0}), "Shampoo", "max_preconditioner_dim");
  EXPECT_KILN_ERROR(Shampoo({w}, {.nesterov = true}), "Shampoo", "nesterov");
  Shampoo opt({w}, {.max_preconditioner_dim = 3, .precondition_frequency = 1});
  opt.newton_max_iterations = -1;
  w.set_grad(ones({3, 3}));
  EXPECT_KILN_ERROR(opt.step(), "Shampoo", "newton_max_iterations", "-1");
  EXPECT_EQ(opt.root_updates(), 0);  // refused before anything changed
  opt.newton_max_iterations = 100;
  w.set_grad(full({3, 3}, NAN));
  EXPECT_KILN_ERROR(opt.step(), "Shampoo", "factor", "parameter 0", "[3, 3]", "non-finite");
  // warm-started roots, whose batched job has no finiteness pass of its own: a non-finite factor fails it,
  // and is named then (after a step that made the bases: one a NaN reaches through a kept basis)
  for (double bad : {double(NAN), double(INFINITY)}) {
    Tensor v = ones({3, 3}).requires_grad_();
    Shampoo warm({v}, {.max_preconditioner_dim = 3, .precondition_frequency = 1});
    warm.root_method = linalg::RootMethod::warm_eigen;
    v.set_grad(randn({3, 3}));
    warm.step();
    Tensor g = randn({3, 3});
    g.select(0, 1).select(0, 2).fill_(bad);
    v.set_grad(g);
    EXPECT_KILN_ERROR(warm.step(), "Shampoo", "factor", "parameter 0", "[3, 3]", "non-finite");
  }
}

// Shampoo writes a parameter's kept half-precision copy (amp::cast_parameter's) along with its update, as
// AdamW does: after each step (grafted only, then preconditioned) the copy is the new weight rounded, and the
// next forward under autocast takes it as it is (no cast).
TEST(Shampoo, WritesTheKeptCopyWithTheUpdate) {
  Generator gen(12);
  Tensor w = randn({4, 6}, {}, &gen).requires_grad_(true), b = randn({4}, {}, &gen).requires_grad_(true);
  const Tensor x = randn({3, 6}, {}, &gen);
  Shampoo opt({w, b}, {.lr = 0.1, .precondition_frequency = 2});
  for (int step = 0; step < 4; ++step) {
    Tensor y;
    {
      amp::Autocast ac(Device::cpu(), DType::bf16);
      y = nn::functional::linear(x, w, b);
    }
    opt.zero_grad();
    sum(y).backward();
    const Tensor copy = amp::kept_copy(w);
    ASSERT_TRUE(copy.defined()) << "step " << step;
    opt.step();
    EXPECT_EQ(amp::kept_copy(w).to_vector<float>(), w.detach().to(DType::bf16).to_vector<float>()) << "step " << step;
    const uint64_t written = copy.version();  // marked current: cast_parameter takes it as it is, no cast into it
    EXPECT_TRUE(amp::cast_parameter(w, DType::bf16).is_same(copy)) << "step " << step;
    EXPECT_EQ(copy.version(), written) << "cast again after the step " << step;
  }
  EXPECT_GT(opt.root_updates(), 0);
}

// Shampoo computes the roots of all its blocks at once on a shared schedule and does not offer a partial
// step: step_only refuses with an error that says to call step(), and nothing changes.
TEST(Shampoo, StepOnlyIsRefused) {
  Tensor w = randn({3, 3}).requires_grad_(true);
  Shampoo opt({w}, {.lr = 0.1});
  sum(mul(w, w)).backward();
  const std::vector<float> before = w.to_vector<float>();
  try {
    opt.step_only([](const Tensor&) { return true; });
    FAIL() << "expected a kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("call step()"), std::string::npos) << e.what();
  }
  EXPECT_EQ(w.to_vector<float>(), before);
}

// What a training loop with a CUDA graph asks before each step (the graph itself: tests/cuda/graph_test.cpp):
// roots are due at steps 3, 6, 9 (every 3 from step 3), and the step can be captured once past the first
// roots, where none are due. A frozen parameter (no gradient ever) is left out of both answers.
TEST(Shampoo, SaysWhenRootsAreDueAndWhenAStepCanBeCaptured) {
  manual_seed(15);
  Tensor w = randn({4, 4}).requires_grad_(true), frozen = randn({4, 4}).requires_grad_(true);
  Shampoo opt({w, frozen}, {.lr = 0.01, .precondition_frequency = 3});
  std::vector<int> due, capturable;
  for (int t = 1; t <= 9; ++t) {  // before step t
    if (opt.roots_due_next_step()) due.push_back(t);
    if (opt.capturable_next_step()) capturable.push_back(t);
    opt.zero_grad();
    sum(mul(w, w)).backward();
    opt.step();
  }
  EXPECT_EQ(due, (std::vector<int>{3, 6, 9}));
  EXPECT_EQ(capturable, (std::vector<int>{4, 5, 7, 8}));
  EXPECT_EQ(opt.state(1).step, 0);
}

}  // namespace
}  // namespace kiln::optim
