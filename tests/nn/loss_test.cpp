// CrossEntropyLoss and MSELoss against hand computations.
#include <gtest/gtest.h>

#include <cmath>

#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/loss.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::error_message;
using testing::values;

TEST(CrossEntropyLoss, MeanNegativeLogSoftmaxOfTheTarget) {
  Tensor logits = tensor({1, 2, 3, 0.5, -1, 2}, {2, 3}, {.dtype = DType::f64});
  Tensor target = from_vector<int64_t>({2, 0}, {2});
  auto l = values(logits);
  auto nll = [&](int row, int cls) {
    double z = 0;
    for (int c = 0; c < 3; ++c) z += std::exp(l[size_t(row * 3 + c)]);
    return std::log(z) - l[size_t(row * 3 + cls)];
  };
  CrossEntropyLoss criterion;
  EXPECT_NEAR(criterion(logits, target).item<double>(), (nll(0, 2) + nll(1, 0)) / 2, 1e-10);
  CrossEntropyLoss summed({.reduction = Reduction::sum});
  EXPECT_NEAR(summed(logits, target).item<double>(), nll(0, 2) + nll(1, 0), 1e-10);
  CrossEntropyLoss ignoring({.ignore_index = 0});
  EXPECT_NEAR(ignoring(logits, target).item<double>(), nll(0, 2), 1e-10);  // the mean skips ignored rows
}

TEST(CrossEntropyLoss, GradientIsSoftmaxMinusOneHotOverN) {
  Tensor logits = tensor({0, 0, 0, 1}, {2, 2}, {.dtype = DType::f64});
  logits.requires_grad_(true);
  CrossEntropyLoss()(logits, from_vector<int64_t>({1, 1}, {2})).backward();
  const double p = std::exp(1.0) / (1.0 + std::exp(1.0));  // softmax of row 1 at class 1
  testing::expect_close(values(logits.grad()), {0.25, -0.25, (1 - p) / 2, (p - 1) / 2}, 1e-10);
}

TEST(CrossEntropyLoss, BadTargetsNameTheLoss) {
  CrossEntropyLoss criterion;
  std::string msg = error_message([&] { criterion(zeros({4, 10}), zeros({4})); });
  EXPECT_NE(msg.find("CrossEntropyLoss"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[4]"), std::string::npos) << msg;
  msg = error_message([&] { criterion(zeros({4, 10}), from_vector<int64_t>({1, 2, 3}, {3})); });
  EXPECT_NE(msg.find("i64[3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[4, 10]"), std::string::npos) << msg;
}

// linear_cross_entropy equals cross_entropy(linear(x, w)) in value and gradients, also when the loss is
// scaled downstream (the upstream gradient multiplies the gradient computed ahead in the forward pass),
// with ignored targets, a 3-D x, label smoothing and the sum reduction.
TEST(LinearCrossEntropy, EqualsTheComposition) {
  manual_seed(3);
  using Options = functional::CrossEntropyOptions;
  for (const Options& opt : {Options{}, Options{.ignore_index = 4, .label_smoothing = 0.1},
                             Options{.reduction = Reduction::sum}}) {
    Tensor x = randn({2, 3, 4}, {.dtype = DType::f64}), w = randn({6, 4}, {.dtype = DType::f64});
    Tensor target = from_vector<int64_t>({1, 4, 5, 0, 4, 2}, {2, 3});
    auto grads = [&](bool fused) {
      Tensor xl = x.detach().requires_grad_(), wl = w.detach().requires_grad_();
      Tensor loss = fused ? functional::linear_cross_entropy(xl, wl, target, opt)
                          : functional::cross_entropy(functional::linear(xl, wl).reshape({6, 6}), target.reshape({6}), opt);
      mul(loss, 2.5).backward();
      return std::make_tuple(loss.item<double>(), values(xl.grad()), values(wl.grad()));
    };
    auto [lf, gxf, gwf] = grads(true);
    auto [lc, gxc, gwc] = grads(false);
    EXPECT_NEAR(lf, lc, 1e-12);
    testing::expect_close(gxf, gxc, 1e-12, "dx");
    testing::expect_close(gwf, gwc, 1e-12, "dw");
  }
  // f16 with a loss scaler's upstream gradient (65536 is not an f16 value): finite, as the composition.
  {
    Tensor x = cast(randn({6, 4}), DType::f16), w = cast(randn({5, 4}), DType::f16);
    Tensor target = from_vector<int64_t>({1, 4, 3, 0, 2, 2}, {6});
    auto grads = [&](bool fused) {
      Tensor xl = x.detach().requires_grad_(), wl = w.detach().requires_grad_();
      Tensor loss = fused ? functional::linear_cross_entropy(xl, wl, target)
                          : functional::cross_entropy(functional::linear(xl, wl), target);
      mul(loss, 65536.0).backward();
      return std::make_pair(values(xl.grad()), values(wl.grad()));
    };
    auto [gxf, gwf] = grads(true);
    auto [gxc, gwc] = grads(false);
    for (double v : gxf) EXPECT_TRUE(std::isfinite(v));
    testing::expect_close(gxf, gxc, 2e-2 * 65536 / 6, "f16 dx, scaled");
    testing::expect_close(gwf, gwc, 2e-2 * 65536 / 6, "f16 dw, scaled");
  }
  // Bad targets are reported as by cross_entropy.
  EXPECT_NE(error_message([] {
              functional::linear_cross_entropy(randn({2, 4}).requires_grad_(), randn({3, 4}),
                                               from_vector<int64_t>({0, 7}, {2}));
            }).find("linear_cross_entropy"),
            std::string::npos);
}

// f16 over a language model's vocabulary: with 1024 rows and 50304 classes each probability is ~2e-5 and
// the mean's share of it ~2e-8, below f16's smallest subnormal. The classes no row targets get their whole
// gradient from those probabilities (dw's row c = Σ_n p_nc x_n); they must match the f64 result on the same
// (f16-rounded) inputs, as dx must, under loss.backward() and under a loss scaler's 65536.
TEST(LinearCrossEntropy, F16KeepsTheSoftmaxSideOfTheGradientOverALargeVocabulary) {
  manual_seed(4);
  const int64_t N = 1024, C = 50304, K = 32;
  const Tensor x = cast(randn({N, K}), DType::f16), w = cast(mul(randn({C, K}), 0.05), DType::f16);
  const Tensor target = randint(0, 16, {N}, {.dtype = DType::i64});  // classes 16.. are nobody's target
  for (double scale : {1.0, 65536.0}) {
    SCOPED_TRACE("loss scale " + std::to_string(scale));
    auto grads = [&](DType dt) {
      Tensor xl = cast(x, dt).detach().requires_grad_(), wl = cast(w, dt).detach().requires_grad_();
      Tensor loss = functional::linear_cross_entropy(xl, wl, target);
      if (scale == 1.0) loss.backward();
      else mul(loss, scale).backward();
      return std::make_pair(cast(xl.grad(), DType::f64), cast(wl.grad(), DType::f64));
    };
    const auto [dx16, dw16] = grads(DType::f16);
    const auto [dx64, dw64] = grads(DType::f64);
    auto rel = [](const Tensor& a, const Tensor& b) {
      return std::sqrt(sum(square(sub(a, b))).item<double>() / sum(square(b)).item<double>());
    };
    EXPECT_LT(rel(dx16, dx64), 1e-2);
    EXPECT_LT(rel(dw16.narrow(0, 0, 16), dw64.narrow(0, 0, 16)), 1e-2) << "the targets' rows";
    // (each row a sum of 1024 terms of either sign, each with f16's 5e-4: ~1.4e-2 of the sum; rounding the
    // mean's share of each probability to f16 left 58% of it)
    EXPECT_LT(rel(dw16.narrow(0, 16, C - 16), dw64.narrow(0, 16, C - 16)), 4e-2) << "the other rows";
  }
  // every row ignored: exact zeros (no row weight to undo), as under bf16
  Tensor xl = x.narrow(0, 0, 8).detach().requires_grad_(), wl = w.detach().requires_grad_();
  functional::linear_cross_entropy(xl, wl, full({8}, -100.0, {.dtype = DType::i64})).backward();
  EXPECT_EQ(sum(abs(cast(xl.grad(), DType::f32))).item<double>(), 0.0);
  EXPECT_EQ(sum(abs(cast(wl.grad(), DType::f32))).item<double>(), 0.0);
}

// loss.backward() with no gradient skips the upstream scaling (its seed is exactly 1): the gradients equal
// those of backward(ones) bit for bit, also for a head tied to the embedding whose rows then add into the
// head's gradient in place, and a retained graph's second pass adds the same gradients again (nothing the
// node keeps was written into by the first).
TEST(LinearCrossEntropy, ImplicitSeedGivesTheScaledGradientsExactly) {
  manual_seed(5);
  Tensor w = randn({7, 4}, {.dtype = DType::f64});
  Tensor idx = from_vector<int64_t>({1, 6, 3, 3, 0}, {5}), target = from_vector<int64_t>({2, 6, 0, 1, 1}, {5});
  auto run = [&](int how) {  // 0: backward(), 1: backward(ones), 2: backward() twice on a retained graph
    Tensor wl = w.detach().requires_grad_();
    Tensor h = functional::embedding(idx, wl);  // tied: the head's weight is the table
    Tensor loss = functional::linear_cross_entropy(mul(h, 0.5), wl, target);
    if (how == 1) loss.backward(ones({}, {.dtype = DType::f64}));
    else loss.backward(Tensor(), how == 2);
    if (how == 2) loss.backward();
    return values(wl.grad());
  };
  const std::vector<double> implicit = run(0), explicit_ones = run(1), twice = run(2);
  EXPECT_EQ(implicit, explicit_ones);
  ASSERT_EQ(twice.size(), implicit.size());
  // (to rounding: the first pass adds a repeated row's two gradients into the head's one by one, the
  // retained second sums them first)
  for (size_t i = 0; i < implicit.size(); ++i) EXPECT_NEAR(twice[i], 2 * implicit[i], 1e-14) << i;
}

TEST(MSELoss, MeanAndSumOfSquaredErrors) {
  Tensor a = tensor({1, 2, 3, 4}, {2, 2}), b = tensor({0, 2, 5, 1}, {2, 2});
  EXPECT_NEAR(MSELoss()(a, b).item<double>(), (1 + 0 + 4 + 9) / 4.0, 1e-6);
  EXPECT_NEAR(MSELoss({.reduction = Reduction::sum})(a, b).item<double>(), 14.0, 1e-6);
  EXPECT_EQ(values(MSELoss({.reduction = Reduction::none})(a, b)), (std::vector<double>{1, 0, 4, 9}));
  std::string msg = error_message([&] { MSELoss()(a, zeros({4})); });
  EXPECT_NE(msg.find("MSELoss"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[2, 2]"), std::string::npos) << msg;
}

}  // namespace
}  // namespace kiln::nn
