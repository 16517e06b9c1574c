// K-FAC (optim/kfac.h): on one sample, where the Kronecker factorisation of the Fisher is exact, the
// preconditioned gradient equals the damped natural gradient (F + λI)⁻¹∇ computed with the dense Fisher;
// a convolution's factors are its unfolded patches' and output gradients' as defined, and its gradient is
// (A ⊗ G + λI)⁻¹∇; the running averages and update intervals; KL clipping; a GradScaler step with inf
// updates no factor; unknown layers are listed; the state round-trips; bad options are errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/core/linalg.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/conv2d.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/layer_norm.h>
#include <kiln/nn/linear.h>
#include <kiln/optim/kfac.h>
#include <kiln/optim/sgd.h>

#include "../core/core_test_util.h"

namespace kiln::optim {
namespace {

namespace F = nn::functional;
const TensorOptions kF64{.dtype = DType::f64};

double max_abs(const Tensor& t) { return amax(abs(t)).item<double>(); }

// Kronecker product of two matrices
Tensor kron(const Tensor& a, const Tensor& b) {
  const int64_t m = a.size(0), n = a.size(1), p = b.size(0), q = b.size(1);
  return mul(a.reshape({m, 1, n, 1}), b.reshape({1, p, 1, q})).reshape({m * p, n * q});
}
// (M + λI)⁻¹ x for symmetric PSD M, by its eigendecomposition
Tensor damped_solve(const Tensor& m, const Tensor& x, double lambda) {
  const auto [w, v] = linalg::eigh(m);
  return matmul(v, div(matmul(v.transpose(0, 1), x), add(w, lambda).unsqueeze(1)));
}

struct Net : nn::Module {
  nn::Linear fc{3, 2, {.dtype = DType::f64}};
  Net() { register_module("fc", fc); }
  Tensor forward(const Tensor& x) override { return fc(x); }
};

// One sample: F = vec(∇ℓ) vec(∇ℓ)ᵀ = (ã ãᵀ) ⊗ (g gᵀ) exactly, so K-FAC's eigen-damped inverse is the
// damped natural gradient. ∇ = [∇W | ∇b] with vec stacking its columns (the Kronecker order A ⊗ G).
TEST(KFAC, OnOneSampleItIsTheDampedNaturalGradient) {
  manual_seed(81);
  Net net;
  SGD sgd(net.parameters(), {.lr = 0.1});
  KFAC kfac(net, {.damping = 0.05, .factor_decay = 0.0, .inv_update_steps = 1, .kl_clip = 0.0});
  EXPECT_EQ(kfac.layers(), std::vector<std::string>{"fc"});
  const Tensor x = randn({1, 3}, kF64), y = randn({1, 2}, kF64);
  sgd.zero_grad();
  F::mse_loss(net(x), y).backward();
  const Tensor grad = cat({net.fc.weight.grad(), net.fc.bias.grad().reshape({2, 1})}, 1).clone();  // (2, 4)
  kfac.step(sgd);
  const Tensor natural = cat({net.fc.weight.grad(), net.fc.bias.grad().reshape({2, 1})}, 1);
  // the dense Fisher of this sample: per-sample gradient g ãᵀ with g = n · ∂loss/∂out (n = 1)
  const Tensor a = cat({x, ones({1, 1}, kF64)}, 1).reshape({4, 1});
  const Tensor g = mul(sub(net(x), y), 2.0 / 2.0).detach().reshape({2, 1});  // mse over 2 outputs: 2(o−y)/2
  const Tensor fisher = kron(matmul(a, a.transpose(0, 1)), matmul(g, g.transpose(0, 1)));  // (A ⊗ G), 8 x 8
  const Tensor vec = grad.transpose(0, 1).reshape({8, 1});  // columns stacked
  const Tensor expected = damped_solve(fisher, vec, 0.05).reshape({4, 2}).transpose(0, 1);
  EXPECT_LT(max_abs(sub(natural, expected)), 1e-10);
  EXPECT_LT(max_abs(sub(kfac.factor_a("fc"), matmul(a, a.transpose(0, 1)))), 1e-14);
}

struct ConvNet : nn::Module {
  nn::Conv2d conv{2, 3, {3, 2}, {.stride = {2, 1}, .padding = 1, .dtype = DType::f64}};
  nn::LayerNorm norm{3, {.dtype = DType::f64}};
  ConvNet() {
    register_module("conv", conv);
    register_module("norm", norm);
  }
  Tensor forward(const Tensor& x) override { return norm(conv(x).permute({0, 2, 3, 1})); }
};

TEST(KFAC, ConvolutionFactorsAndPreconditionedGradient) {
  manual_seed(82);
  ConvNet net;
  SGD sgd(net.parameters(), {.lr = 0.1});
  KFAC kfac(net, {.damping = 1e-2, .inv_update_steps = 1, .kl_clip = 0.0});
  EXPECT_EQ(kfac.layers(), std::vector<std::string>{"conv"});
  EXPECT_EQ(kfac.skipped(), std::vector<std::string>{"norm"});
  const int64_t n = 4;
  const Tensor x = randn({n, 2, 6, 5}, kF64), target = randn({n, 3, 3, 6}, kF64).permute({0, 2, 3, 1});
  // the output gradient, captured by a tensor hook on the convolution's output
  Tensor out = net.conv(x);
  Tensor grad_out;
  out.register_hook([&](const Tensor& g) {
    grad_out = g.detach().clone();
    return Tensor();
  });
  sgd.zero_grad();
  F::mse_loss(net.norm(out.permute({0, 2, 3, 1})), target).backward();
  // the same backward through the module, for the hooks
  sgd.zero_grad();
  F::mse_loss(net(x), target).backward();
  const Tensor grad = cat({net.conv.weight.grad().reshape({3, -1}), net.conv.bias.grad().reshape({3, 1})}, 1).clone();
  kfac.step(sgd);
  const Tensor cols = F::unfold(x, {3, 2}, {.stride = {2, 1}, .padding = {1, 1}});  // (n, 12, L)
  const int64_t L = cols.size(2);
  Tensor rows = cols.transpose(1, 2).reshape({n * L, 12});
  rows = cat({rows, ones({n * L, 1}, kF64)}, 1);
  const Tensor A = div(matmul(rows.transpose(0, 1), rows), double(n * L));
  const Tensor g_rows = grad_out.flatten(2).transpose(1, 2).reshape({n * L, 3});
  const Tensor G = mul(matmul(g_rows.transpose(0, 1), g_rows), double(n));
  EXPECT_LT(max_abs(sub(kfac.factor_a("conv"), A)), 1e-12);
  EXPECT_LT(max_abs(sub(kfac.factor_g("conv"), G)) / max_abs(G), 1e-12);
  const Tensor natural = cat({net.conv.weight.grad().reshape({3, -1}), net.conv.bias.grad().reshape({3, 1})}, 1);
  const Tensor expected =
      damped_solve(kron(A, G), grad.transpose(0, 1).reshape({-1, 1}), 1e-2).reshape({13, 3}).transpose(0, 1);
  EXPECT_LT(max_abs(sub(natural, expected)) / max_abs(expected), 1e-10);
}

TEST(KFAC, RunningAveragesAndIntervals) {
  manual_seed(83);
  Net net;
  SGD sgd(net.parameters(), {.lr = 0.5});
  KFAC kfac(net, {.damping = 1e-3, .factor_decay = 0.9, .factor_update_steps = 2, .inv_update_steps = 4});
  std::vector<Tensor> a_batches;
  for (int step = 1; step <= 3; ++step) {
    const Tensor x = randn({5, 3}, kF64), y = randn({5, 2}, kF64);
    sgd.zero_grad();
    F::mse_loss(net(x), y).backward();
    kfac.step(sgd);
    const Tensor rows = cat({x, ones({5, 1}, kF64)}, 1);
    if (step % 2 == 1) a_batches.push_back(div(matmul(rows.transpose(0, 1), rows), 5.0));  // steps 1 and 3
  }
  // the first update takes the batch's factor; the second (step 3) averages with α = 0.9
  const Tensor expected_a = add(mul(a_batches[0], 0.9), mul(a_batches[1], 0.1));
  EXPECT_LT(max_abs(sub(kfac.factor_a("fc"), expected_a)), 1e-14);
  EXPECT_EQ(kfac.steps(), 3);
}

// ν = min(1, sqrt(kl_clip / |lr² Σ ∇̃ ⊙ ∇|)) scales every preconditioned gradient alike.
TEST(KFAC, KlClippingScalesTheNaturalGradient) {
  manual_seed(84);
  Net a_net, b_net;
  b_net.load_state_dict(a_net.state_dict());
  const double lr = 0.5, kl_clip = 1e-6;
  SGD a_sgd(a_net.parameters(), {.lr = lr}), b_sgd(b_net.parameters(), {.lr = lr});
  KFAC unclipped(a_net, {.kl_clip = 0.0}), clipped(b_net, {.kl_clip = kl_clip});
  const Tensor x = randn({5, 3}, kF64), y = randn({5, 2}, kF64);
  F::mse_loss(a_net(x), y).backward();
  F::mse_loss(b_net(x), y).backward();
  const Tensor grad = cat({a_net.fc.weight.grad(), a_net.fc.bias.grad().reshape({2, 1})}, 1).clone();
  unclipped.step(a_sgd);
  clipped.step(b_sgd);
  const Tensor u = cat({a_net.fc.weight.grad(), a_net.fc.bias.grad().reshape({2, 1})}, 1);
  const Tensor c = cat({b_net.fc.weight.grad(), b_net.fc.bias.grad().reshape({2, 1})}, 1);
  const double nu = std::min(1.0, std::sqrt(kl_clip / std::fabs(lr * lr * sum(mul(u, grad)).item<double>())));
  EXPECT_LT(nu, 1.0);
  EXPECT_LT(max_abs(sub(c, mul(u, nu))), 1e-14 * max_abs(u));
}

TEST(KFAC, AGradScalerStepWithInfUpdatesNoFactor) {
  manual_seed(87);
  Net net;
  SGD sgd(net.parameters(), {.lr = 0.1});
  GradScaler scaler({.init_scale = 1024.0});
  KFAC kfac(net, {.inv_update_steps = 1});
  auto train = [&](bool poison) {
    const Tensor x = randn({4, 3}, kF64), y = randn({4, 2}, kF64);
    sgd.zero_grad();
    scaler.scale(F::mse_loss(net(x), y)).backward();
    if (poison) net.fc.bias.grad().fill_(INFINITY);
    scaler.unscale_(sgd);
    kfac.step(sgd, &scaler);
    scaler.step(sgd);
    scaler.update();
    return x;
  };
  const Tensor x = train(false);
  const Tensor rows = cat({x, ones({4, 1}, kF64)}, 1);
  EXPECT_LT(max_abs(sub(kfac.factor_a("fc"), div(matmul(rows.transpose(0, 1), rows), 4.0))), 1e-14);
  // G from the unscaled output gradients: scaling the loss by 1024 leaves it unchanged
  const Tensor a_before = kfac.factor_a("fc").clone(), g_before = kfac.factor_g("fc").clone();
  train(true);
  EXPECT_EQ(kfac.factor_a("fc").to_vector<double>(), a_before.to_vector<double>());
  EXPECT_EQ(kfac.factor_g("fc").to_vector<double>(), g_before.to_vector<double>());
  EXPECT_TRUE(all_true(isfinite(kfac.factor_g("fc"))));
}

TEST(KFAC, GradientOfTheUnscaledLossGivesTheSameG) {
  manual_seed(85);
  Net a_net, b_net;
  b_net.load_state_dict(a_net.state_dict());
  SGD a_sgd(a_net.parameters(), {.lr = 0.1}), b_sgd(b_net.parameters(), {.lr = 0.1});
  KFAC a(a_net, {.kl_clip = 0.0}), b(b_net, {.kl_clip = 0.0});
  GradScaler scaler({.init_scale = 256.0});
  const Tensor x = randn({4, 3}, kF64), y = randn({4, 2}, kF64);
  F::mse_loss(a_net(x), y).backward();
  a.step(a_sgd);
  scaler.scale(F::mse_loss(b_net(x), y)).backward();
  scaler.unscale_(b_sgd);
  b.step(b_sgd, &scaler);
  EXPECT_LT(max_abs(sub(a.factor_g("fc"), b.factor_g("fc"))) / max_abs(a.factor_g("fc")), 1e-14);
}

TEST(KFAC, StateRoundTripsAndBadOptionsAreErrors) {
  manual_seed(86);
  Net net;
  SGD sgd(net.parameters(), {.lr = 0.1});
  KFAC kfac(net);
  F::mse_loss(net(randn({4, 3}, kF64)), randn({4, 2}, kF64)).backward();
  kfac.step(sgd);
  const State s = kfac.save_state();
  KFAC other(net);
  EXPECT_TRUE(other.check_state(s).empty());
  other.apply_state(s);
  EXPECT_EQ(other.steps(), 1);
  EXPECT_EQ(other.factor_g("fc").to_vector<double>(), kfac.factor_g("fc").to_vector<double>());
  State bad = s;
  bad["layers/fc/A"] = zeros({3, 3}, kF64);
  EXPECT_FALSE(other.check_state(bad).empty());
  EXPECT_KILN_ERROR(KFAC(net, {.damping = 0.0}), "KFAC", "damping");
  EXPECT_KILN_ERROR(KFAC(net, {.factor_decay = 1.0}), "KFAC", "factor_decay");
  EXPECT_KILN_ERROR(kfac.factor_a("nope"), "KFAC", "nope");
}

}  // namespace
}  // namespace kiln::optim
