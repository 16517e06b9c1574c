#include <gtest/gtest.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>

using namespace kiln;

TEST(Autocast, MatmulRunsInTheAutocastDtypeAndGradientsReachF32Weights) {
  Tensor x = randn({4, 8});
  Tensor w = randn({8, 3}).requires_grad_(true);
  Tensor y;
  {
    amp::Autocast autocast(Device::cpu(), DType::bf16);
    EXPECT_TRUE(amp::is_enabled(DeviceType::cpu));
    y = matmul(x, w);
    EXPECT_EQ(y.dtype(), DType::bf16);
    // the product equals the bf16 product of the rounded operands
    Tensor ref = matmul(x.to(DType::bf16), w.detach().to(DType::bf16));
    EXPECT_EQ(y.to_vector<float>(), ref.to_vector<float>());
    // the softmax family computes in f32
    EXPECT_EQ(softmax(y, -1).dtype(), DType::f32);
    EXPECT_EQ(log_softmax(y, -1).dtype(), DType::f32);
  }
  EXPECT_FALSE(amp::is_enabled(DeviceType::cpu));
  EXPECT_EQ(matmul(x, w).dtype(), DType::f32);
  sum(cast(y, DType::f32)).backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().dtype(), DType::f32);
  // d sum(x w) / dw = xᵀ 1, up to bf16 rounding of x
  Tensor expect = sum(x.to(DType::bf16).to(DType::f32), {0}).reshape({8, 1}).expand({8, 3});
  auto g = w.grad().to_vector<float>(), e = expect.to_vector<float>();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], e[i], 0.05 * std::abs(e[i]) + 0.05);
}

TEST(Autocast, ScopesNestAndOnlyAffectTheirDeviceType) {
  {
    amp::Autocast a(Device::cpu(), DType::bf16);
    {
      amp::Autocast b(Device::cpu(), DType::f16);
      EXPECT_EQ(amp::dtype(DeviceType::cpu), DType::f16);
      EXPECT_EQ(matmul(randn({2, 2}), randn({2, 2})).dtype(), DType::f16);
      {
        amp::Autocast off(Device::cpu(), DType::bf16, false);
        EXPECT_EQ(matmul(randn({2, 2}), randn({2, 2})).dtype(), DType::f32);
      }
    }
    EXPECT_EQ(amp::dtype(DeviceType::cpu), DType::bf16);
    EXPECT_FALSE(amp::is_enabled(DeviceType::cuda));
  }
  EXPECT_THROW(amp::Autocast(Device::cpu(), DType::f32), Error);
}

TEST(Autocast, Conv2dRunsInTheAutocastDtypeAndGradientsReachF32Weights) {
  manual_seed(1);
  Tensor x = randn({2, 3, 7, 9}).requires_grad_(true);
  Tensor w = randn({4, 3, 3, 3}).requires_grad_(true);
  Tensor b = randn({4}).requires_grad_(true);
  nn::functional::Conv2dOptions opt{.padding = {1, 1}};
  Tensor y;
  {
    amp::Autocast autocast(Device::cpu(), DType::bf16);
    y = nn::functional::conv2d(x, w, b, opt);
    EXPECT_EQ(y.dtype(), DType::bf16);
    // the convolution of the operands rounded to bf16
    NoGradGuard ng;
    Tensor ref = nn::functional::conv2d(x.detach().to(DType::bf16), w.detach().to(DType::bf16),
                                        b.detach().to(DType::bf16), opt);
    EXPECT_EQ(y.to_vector<float>(), ref.to_vector<float>());
  }
  EXPECT_EQ(nn::functional::conv2d(x, w, b, opt).dtype(), DType::f32);
  sum(cast(y, DType::f32)).backward();
  for (const Tensor* p : {&x, &w, &b}) {
    ASSERT_TRUE(p->grad().defined());
    EXPECT_EQ(p->grad().dtype(), DType::f32);
  }
  // d sum(y) / db = N * OH * OW for every output channel (exact in bf16)
  for (float g : b.grad().to_vector<float>()) EXPECT_EQ(g, 2.0f * 7 * 9);
  // the weight gradient matches the f32 one up to bf16 rounding
  Tensor w32 = w.detach().clone().requires_grad_(true);
  sum(nn::functional::conv2d(x.detach(), w32, Tensor(), opt)).backward();
  auto g = w.grad().to_vector<float>(), e = w32.grad().to_vector<float>();
  ASSERT_EQ(g.size(), e.size());
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], e[i], 0.02 * std::abs(e[i]) + 0.1);
}

TEST(Autocast, LayerNormComputesInF32) {
  manual_seed(2);
  Tensor x = randn({5, 12}).to(DType::bf16).requires_grad_(true);
  Tensor w = randn({12}).requires_grad_(true);
  Tensor b = randn({12}).requires_grad_(true);
  Tensor y;
  {
    amp::Autocast autocast(Device::cpu(), DType::bf16);
    y = nn::functional::layer_norm(x, {12}, w, b);
    EXPECT_EQ(y.dtype(), DType::f32);
    // an f32 input stays f32, and a bf16 matmul output is normalized in f32
    EXPECT_EQ(nn::functional::layer_norm(randn({3, 12}), {12}).dtype(), DType::f32);
    EXPECT_EQ(nn::functional::layer_norm(matmul(randn({3, 4}), randn({4, 12})), {12}, w, b).dtype(), DType::f32);
  }
  // the same values as layer norm of the f32 input
  {
    NoGradGuard ng;
    Tensor ref = nn::functional::layer_norm(x.detach().to(DType::f32), {12}, w.detach(), b.detach());
    auto v = y.to_vector<float>(), r = ref.to_vector<float>();
    for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(v[i], r[i], 1e-5f * std::abs(r[i]) + 1e-6f);
  }
  // outside autocast a bf16 input stays bf16
  EXPECT_EQ(nn::functional::layer_norm(x.detach(), {12}).dtype(), DType::bf16);
  sum(y).backward();
  EXPECT_EQ(x.grad().dtype(), DType::bf16);
  EXPECT_EQ(w.grad().dtype(), DType::f32);
  EXPECT_EQ(b.grad().dtype(), DType::f32);
  for (float g : b.grad().to_vector<float>()) EXPECT_EQ(g, 5.0f);
}

// amp::cast_parameter keeps a parameter's cast while the parameter is unchanged, casts again in place after
// any in-place change, and casts other tensors afresh.
TEST(Autocast, CastParameterKeepsTheCastUntilTheParameterChanges) {
  Tensor p = randn({5, 3}).requires_grad_(true);
  const Tensor c1 = amp::cast_parameter(p, DType::bf16), c2 = amp::cast_parameter(p, DType::bf16);
  EXPECT_TRUE(c1.is_same(c2));
  EXPECT_EQ(c1.to_vector<float>(), p.detach().to(DType::bf16).to_vector<float>());
  {
    NoGradGuard ng;
    p.add_(full({5, 3}, 0.25));
  }
  const Tensor c3 = amp::cast_parameter(p, DType::bf16);
  EXPECT_TRUE(c3.is_same(c1)) << "the same memory, written again";
  EXPECT_EQ(c3.to_vector<float>(), p.detach().to(DType::bf16).to_vector<float>());
  {  // torch.autocast's cache_enabled = false: a cast at every use
    amp::Autocast ac(Device::cpu(), DType::bf16, true, /*cache_enabled=*/false);
    EXPECT_FALSE(amp::cast_parameter(p, DType::bf16).is_same(c1));
  }
  EXPECT_TRUE(amp::cast_parameter(p, DType::bf16).is_same(c1));
  EXPECT_FALSE(amp::cast_parameter(p, DType::f16).is_same(c3));  // another dtype: another copy
  amp::never_keep_cast(p);  // as ZeroAdamW's parameters: a cast at every use, no copy kept
  EXPECT_FALSE(amp::kept_copy(p).defined());
  EXPECT_FALSE(amp::cast_parameter(p, DType::bf16).is_same(amp::cast_parameter(p, DType::bf16)));
  Tensor activation = randn({5, 3});
  EXPECT_FALSE(amp::cast_parameter(activation, DType::bf16).is_same(amp::cast_parameter(activation, DType::bf16)));
}
