#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <kiln/optim/clip_grad.h>

namespace kiln::optim {
namespace {

using Vec = std::vector<double>;

Tensor param_with_grad(const Vec& g) {
  Tensor p = zeros({int64_t(g.size())}, {.dtype = DType::f64});
  p.requires_grad_();
  p.set_grad(tensor(g, {int64_t(g.size())}, {.dtype = DType::f64}));
  return p;
}

TEST(ClipGradNorm, ScalesToMaxNormAndReturnsPreClipNorm) {
  // Global 2-norm of (3, 4, 12) is 13.
  Tensor a = param_with_grad({3.0, 4.0}), b = param_with_grad({12.0});
  const double norm = clip_grad_norm({a, b}, 6.5);
  EXPECT_DOUBLE_EQ(norm, 13.0);
  const double c = 6.5 / (13.0 + 1e-6);
  EXPECT_NEAR(a.grad().to_vector<double>()[0], 3.0 * c, 1e-14);
  EXPECT_NEAR(a.grad().to_vector<double>()[1], 4.0 * c, 1e-14);
  EXPECT_NEAR(b.grad().to_vector<double>()[0], 12.0 * c, 1e-14);
  // The clipped gradients have (almost exactly) the max norm.
  const auto ga = a.grad().to_vector<double>();
  const double after = std::sqrt(ga[0] * ga[0] + ga[1] * ga[1] + std::pow(b.grad().to_vector<double>()[0], 2));
  EXPECT_NEAR(after, 6.5, 1e-6);
}

TEST(ClipGradNorm, LeavesSmallGradientsAlone) {
  Tensor a = param_with_grad({3.0, 4.0});
  EXPECT_DOUBLE_EQ(clip_grad_norm({a}, 10.0), 5.0);
  EXPECT_EQ(a.grad().to_vector<double>(), (Vec{3.0, 4.0}));
}

TEST(ClipGradNorm, OtherNormsAndMissingGradients) {
  Tensor a = param_with_grad({3.0, -4.0}), b = param_with_grad({-12.0});
  Tensor none = zeros({3}, {.dtype = DType::f64});
  none.requires_grad_();
  EXPECT_DOUBLE_EQ(clip_grad_norm({a, b, none}, 100.0, 1.0), 19.0);
  EXPECT_DOUBLE_EQ(clip_grad_norm({a, b, none}, 100.0, kInfNorm), 12.0);
  EXPECT_NEAR(clip_grad_norm({a, b}, 100.0, 3.0), std::cbrt(27.0 + 64.0 + 1728.0), 1e-12);
  EXPECT_DOUBLE_EQ(clip_grad_norm({a, b}, 6.0, kInfNorm), 12.0);
  EXPECT_NEAR(b.grad().to_vector<double>()[0], -12.0 * 6.0 / (12.0 + 1e-6), 1e-14);
  EXPECT_EQ(clip_grad_norm({none}, 1.0), 0.0);
}

TEST(ClipGradNorm, NonFiniteNorm) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor a = param_with_grad({1.0, nan});
  EXPECT_THROW(clip_grad_norm({a}, 1.0, 2.0, /*error_if_nonfinite=*/true), Error);
  EXPECT_EQ(a.grad().to_vector<double>()[0], 1.0);  // untouched by the failed call
  EXPECT_TRUE(std::isnan(clip_grad_norm({a}, 1.0)));
  Tensor b = param_with_grad({1.0, std::numeric_limits<double>::infinity()});
  EXPECT_THROW(clip_grad_norm({b}, 1.0, kInfNorm, true), Error);
}

TEST(ClipGradNorm, F32Gradients) {
  Tensor p = zeros({2});
  p.requires_grad_();
  p.set_grad(tensor({30.0, 40.0}, {2}));
  EXPECT_NEAR(clip_grad_norm({p}, 1.0), 50.0, 1e-4);
  EXPECT_NEAR(p.grad().to_vector<double>()[0], 0.6, 1e-6);
  EXPECT_NEAR(p.grad().to_vector<double>()[1], 0.8, 1e-6);
}

// The device-side variant gives the same norm and gradients without reading anything on the host.
TEST(ClipGradNorm, AsyncMatchesTheHostVariant) {
  for (double norm_type : {2.0, 1.0, 3.0, kInfNorm})
    for (double max_norm : {0.5, 100.0}) {
      Tensor a = param_with_grad({3.0, -4.0}), b = param_with_grad({-12.0, 0.25});
      Tensor c = param_with_grad({3.0, -4.0}), d = param_with_grad({-12.0, 0.25});
      const double host = clip_grad_norm({a, b}, max_norm, norm_type);
      Tensor dev = clip_grad_norm_async({c, d}, max_norm, norm_type);
      EXPECT_EQ(dev.dim(), 0);
      EXPECT_NEAR(dev.item<double>(), host, 1e-12) << norm_type;
      for (int i = 0; i < 2; ++i) {
        EXPECT_NEAR(a.grad().to_vector<double>()[i], c.grad().to_vector<double>()[i], 1e-12) << norm_type;
        EXPECT_NEAR(b.grad().to_vector<double>()[i], d.grad().to_vector<double>()[i], 1e-12) << norm_type;
      }
    }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor e = param_with_grad({1.0, nan});
  EXPECT_TRUE(std::isnan(clip_grad_norm_async({e}, 1.0, kInfNorm).item<double>()));
  EXPECT_TRUE(std::isnan(e.grad().to_vector<double>()[0]));  // the NaN factor is applied, as in PyTorch
  Tensor f = zeros({2});
  f.requires_grad_();
  f.set_grad(tensor({30.0, 40.0}, {2}));
  EXPECT_NEAR(clip_grad_norm_async({f}, 1.0).item<double>(), 50.0, 1e-4);
  EXPECT_NEAR(f.grad().to_vector<double>()[1], 0.8, 1e-6);
}

}  // namespace
}  // namespace kiln::optim
