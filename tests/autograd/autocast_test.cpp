#include <gtest/gtest.h>

#include <kiln/core/autocast.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

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
