// Adam (L2 weight decay through the moments, PyTorch's torch.optim.Adam) against its update written out.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/optim/adamw.h>

using namespace kiln;

namespace {

// Adam with L2 weight decay, against the update written out in double (PyTorch's torch.optim.Adam).
TEST(Adam, TrajectoryMatchesFormulas) {
  const std::vector<std::vector<double>> grads = {{0.5, -1.0}, {0.1, 0.3}, {-0.2, 0.4}};
  const double lr = 0.01, b1 = 0.8, b2 = 0.95, eps = 1e-6, wd = 0.1;
  std::vector<double> p = {1.0, -2.0}, m(2, 0.0), v(2, 0.0);
  Tensor param = from_vector(p, {2}, {.dtype = DType::f64});
  param.requires_grad_();
  optim::Adam opt({param}, {.lr = lr, .betas = {b1, b2}, .eps = eps, .weight_decay = wd});
  EXPECT_EQ(opt.type(), "Adam");
  for (size_t t = 1; t <= grads.size(); ++t) {
    param.set_grad(from_vector(grads[t - 1], {2}, {.dtype = DType::f64}));
    opt.step();
    for (size_t j = 0; j < 2; ++j) {
      const double g = grads[t - 1][j] + wd * p[j];  // L2: the decay goes through the moments
      m[j] = b1 * m[j] + (1 - b1) * g;
      v[j] = b2 * v[j] + (1 - b2) * g * g;
      const double mh = m[j] / (1 - std::pow(b1, double(t))), vh = v[j] / (1 - std::pow(b2, double(t)));
      p[j] -= lr * mh / (std::sqrt(vh) + eps);
    }
    const std::vector<double> got = param.to_vector<double>();
    for (size_t j = 0; j < 2; ++j) EXPECT_NEAR(got[j], p[j], 1e-13) << "step " << t;
  }
  EXPECT_THROW(optim::Adam({param}, {.lr = -1.0}), Error);
}

}  // namespace
