// SGD against trajectories computed here, in double, from the update formulas.
#include <gtest/gtest.h>

#include <vector>

#include <kiln/optim/sgd.h>

namespace kiln::optim {
namespace {

using Vec = std::vector<double>;

Tensor param(const Vec& v) {
  Tensor p = tensor(v, {int64_t(v.size())}, {.dtype = DType::f64});
  p.requires_grad_();
  return p;
}
Tensor grad_of(const Vec& v) { return tensor(v, {int64_t(v.size())}, {.dtype = DType::f64}); }

const std::vector<Vec> kGrads = {{0.5, -1.0}, {0.1, 0.3}, {-0.2, 0.4}};

// PyTorch's SGD written out on scalars.
std::vector<Vec> reference(Vec p, double lr, double momentum, double dampening, double wd, bool nesterov) {
  std::vector<Vec> out;
  Vec buf(p.size());
  for (size_t t = 0; t < kGrads.size(); ++t) {
    for (size_t j = 0; j < p.size(); ++j) {
      double d = kGrads[t][j] + wd * p[j];
      if (momentum != 0.0) {
        buf[j] = t == 0 ? d : momentum * buf[j] + (1.0 - dampening) * d;
        d = nesterov ? d + momentum * buf[j] : buf[j];
      }
      p[j] -= lr * d;
    }
    out.push_back(p);
  }
  return out;
}

void run_and_compare(const SGDOptions& o) {
  const Vec p0 = {1.0, -2.0};
  Tensor p = param(p0);
  SGD opt({p}, o);
  const auto expected = reference(p0, o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov);
  for (size_t t = 0; t < kGrads.size(); ++t) {
    p.set_grad(grad_of(kGrads[t]));
    opt.step();
    const auto got = p.to_vector<double>();
    for (size_t j = 0; j < p0.size(); ++j) EXPECT_NEAR(got[j], expected[t][j], 1e-12) << "step " << t + 1 << " elem " << j;
  }
}

TEST(SGD, PlainStep) {
  run_and_compare({.lr = 0.1});
  // And the first step by hand: p - lr * g.
  Tensor p = param({1.0, -2.0});
  SGD opt({p}, {.lr = 0.1});
  p.set_grad(grad_of({0.5, -1.0}));
  opt.step();
  EXPECT_DOUBLE_EQ(p.to_vector<double>()[0], 0.95);
  EXPECT_DOUBLE_EQ(p.to_vector<double>()[1], -1.9);
}

TEST(SGD, Momentum) { run_and_compare({.lr = 0.1, .momentum = 0.9}); }
TEST(SGD, MomentumDampening) { run_and_compare({.lr = 0.1, .momentum = 0.9, .dampening = 0.3}); }
TEST(SGD, Nesterov) { run_and_compare({.lr = 0.1, .momentum = 0.9, .nesterov = true}); }
TEST(SGD, WeightDecay) { run_and_compare({.lr = 0.1, .weight_decay = 0.05}); }
TEST(SGD, NesterovWithWeightDecay) { run_and_compare({.lr = 0.05, .momentum = 0.8, .weight_decay = 0.1, .nesterov = true}); }

TEST(SGD, NesterovDiffersFromPlainMomentum) {
  // Guards the comparison above: the two rules must give different trajectories on this problem.
  auto a = reference({1.0, -2.0}, 0.1, 0.9, 0.0, 0.0, false);
  auto b = reference({1.0, -2.0}, 0.1, 0.9, 0.0, 0.0, true);
  EXPECT_NE(a.back()[0], b.back()[0]);
}

TEST(SGD, LeavesGradientUntouchedAndSkipsParamsWithoutGrad) {
  Tensor p = param({1.0, 2.0}), q = param({3.0, 4.0});
  SGD opt({p, q}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.5, .nesterov = true});
  p.set_grad(grad_of({1.0, 1.0}));
  opt.step();
  EXPECT_EQ(p.grad().to_vector<double>(), (Vec{1.0, 1.0}));
  EXPECT_EQ(q.to_vector<double>(), (Vec{3.0, 4.0}));
  EXPECT_TRUE(opt.state(1).empty());
  EXPECT_FALSE(opt.state(0).empty());
}

TEST(SGD, F32Parameters) {
  Tensor p = tensor({1.0, -2.0}, {2});
  p.requires_grad_();
  SGD opt({p}, {.lr = 0.1, .momentum = 0.9});
  const auto expected = reference({1.0, -2.0}, 0.1, 0.9, 0.0, 0.0, false);
  for (size_t t = 0; t < kGrads.size(); ++t) {
    p.set_grad(tensor(kGrads[t], {2}));
    opt.step();
  }
  EXPECT_EQ(p.dtype(), DType::f32);
  EXPECT_EQ(opt.state(0).tensors.at("momentum_buffer").dtype(), DType::f32);
  for (size_t j = 0; j < 2; ++j) EXPECT_NEAR(p.to_vector<double>()[j], expected.back()[j], 1e-6);
}

TEST(SGD, ZeroGrad) {
  Tensor p = param({1.0, 2.0});
  SGD opt({p});
  p.set_grad(grad_of({1.0, 1.0}));
  opt.zero_grad(/*set_to_none=*/false);
  ASSERT_TRUE(p.grad().defined());
  EXPECT_EQ(p.grad().to_vector<double>(), (Vec{0.0, 0.0}));
  opt.zero_grad();
  EXPECT_FALSE(p.grad().defined());
}

TEST(SGD, ParamGroupsUseTheirOwnOptions) {
  Tensor p = param({1.0}), q = param({1.0});
  SGD opt({p}, {.lr = 0.1});
  opt.add_param_group({{q}, {{"lr", 0.5}}});  // the rest from the defaults
  EXPECT_EQ(opt.param_groups().size(), 2u);
  EXPECT_EQ(opt.param_groups()[1].get("momentum"), 0.0);
  p.set_grad(grad_of({1.0}));
  q.set_grad(grad_of({1.0}));
  opt.step();
  EXPECT_DOUBLE_EQ(p.to_vector<double>()[0], 0.9);
  EXPECT_DOUBLE_EQ(q.to_vector<double>()[0], 0.5);
  EXPECT_THROW(opt.add_param_group({{p}, {}}), Error);  // already in group 0
}

TEST(SGD, RejectsBadOptions) {
  Tensor p = param({1.0});
  EXPECT_THROW(SGD({p}, {.lr = 0.1, .nesterov = true}), Error);  // nesterov without momentum
  EXPECT_THROW(SGD({p}, {.lr = -1.0}), Error);
}

}  // namespace
}  // namespace kiln::optim
