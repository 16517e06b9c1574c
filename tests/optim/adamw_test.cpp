// AdamW against a trajectory computed here, in double, from the update formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/flat_parameters.h>

namespace kiln::optim {
namespace {

using Vec = std::vector<double>;

const std::vector<Vec> kGrads = {{0.5, -1.0}, {0.1, 0.3}, {-0.2, 0.4}};

// Decoupled weight decay, then Adam with bias correction, written out on scalars.
std::vector<Vec> reference(Vec p, double lr, double b1, double b2, double eps, double wd) {
  std::vector<Vec> out;
  Vec m(p.size(), 0.0), v(p.size(), 0.0);
  for (size_t t = 1; t <= kGrads.size(); ++t) {
    for (size_t j = 0; j < p.size(); ++j) {
      const double g = kGrads[t - 1][j];
      p[j] -= lr * wd * p[j];
      m[j] = b1 * m[j] + (1 - b1) * g;
      v[j] = b2 * v[j] + (1 - b2) * g * g;
      const double m_hat = m[j] / (1 - std::pow(b1, double(t)));
      const double v_hat = v[j] / (1 - std::pow(b2, double(t)));
      p[j] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
    out.push_back(p);
  }
  return out;
}

TEST(AdamW, TrajectoryMatchesFormulas) {
  const Vec p0 = {1.0, -2.0};
  Tensor p = tensor(p0, {2}, {.dtype = DType::f64});
  p.requires_grad_();
  AdamW opt({p}, {.lr = 0.01, .betas = {0.8, 0.95}, .eps = 1e-6, .weight_decay = 0.1});
  const auto expected = reference(p0, 0.01, 0.8, 0.95, 1e-6, 0.1);
  for (size_t t = 0; t < kGrads.size(); ++t) {
    p.set_grad(tensor(kGrads[t], {2}, {.dtype = DType::f64}));
    opt.step();
    const auto got = p.to_vector<double>();
    for (size_t j = 0; j < 2; ++j) EXPECT_NEAR(got[j], expected[t][j], 1e-12) << "step " << t + 1 << " elem " << j;
  }
  EXPECT_EQ(opt.state(0).step, 3);
}

TEST(AdamW, FirstStepByHand) {
  // t = 1: m_hat = g, v_hat = g^2, so p1 = p0 (1 - lr wd) - lr g / (|g| + eps).
  Tensor p = tensor({2.0}, {1}, {.dtype = DType::f64});
  p.requires_grad_();
  AdamW opt({p}, {.lr = 0.1, .weight_decay = 0.5});
  p.set_grad(tensor({-4.0}, {1}, {.dtype = DType::f64}));
  opt.step();
  EXPECT_NEAR(p.to_vector<double>()[0], 2.0 * (1 - 0.05) + 0.1 * 4.0 / (4.0 + 1e-8), 1e-14);
}

TEST(AdamW, DefaultsAndDecoupledDecay) {
  const AdamWOptions d;
  EXPECT_EQ(d.lr, 1e-3);
  EXPECT_EQ(d.betas.first, 0.9);
  EXPECT_EQ(d.betas.second, 0.999);
  EXPECT_EQ(d.eps, 1e-8);
  EXPECT_EQ(d.weight_decay, 1e-2);
  // With a zero gradient the Adam term vanishes and only the decay acts: p <- p (1 - lr wd).
  Tensor p = tensor({3.0, -1.0}, {2}, {.dtype = DType::f64});
  p.requires_grad_();
  AdamW opt({p}, {.lr = 1e-3, .weight_decay = 0.01});
  p.set_grad(zeros({2}, {.dtype = DType::f64}));
  opt.step();
  EXPECT_DOUBLE_EQ(p.to_vector<double>()[0], 3.0 * (1 - 1e-5));
  EXPECT_DOUBLE_EQ(p.to_vector<double>()[1], -1.0 * (1 - 1e-5));
}

TEST(AdamW, F32ParametersKeepF32State) {
  const Vec p0 = {1.0, -2.0};
  Tensor p = tensor(p0, {2});
  p.requires_grad_();
  AdamW opt({p}, {.lr = 0.01, .weight_decay = 0.1});
  for (const auto& g : kGrads) {
    p.set_grad(tensor(g, {2}));
    opt.step();
  }
  const auto expected = reference(p0, 0.01, 0.9, 0.999, 1e-8, 0.1).back();
  EXPECT_EQ(opt.state(0).tensors.at("exp_avg").dtype(), DType::f32);
  EXPECT_EQ(opt.state(0).tensors.at("exp_avg_sq").dtype(), DType::f32);
  for (size_t j = 0; j < 2; ++j) EXPECT_NEAR(p.to_vector<double>()[j], expected[j], 1e-6);
}

TEST(AdamW, RejectsBadBetas) {
  Tensor p = tensor({1.0}, {1});
  EXPECT_THROW(AdamW({p}, {.betas = {0.9, 1.0}}), Error);
  EXPECT_THROW(AdamW({p}, {.lr = -0.1}), Error);
}

// AdamW writes a kept copy along with the update: the next forward under autocast uses it as it is and
// equals the product with a fresh cast of the new weight; a backward that saved the copy before the
// weight changed fails its version check instead of using the new values.
TEST(Autocast, AdamWWritesTheKeptCopyAndAStaleSaveIsCaught) {
  Tensor w = randn({4, 6}).requires_grad_(true), b = randn({4}).requires_grad_(true), x = randn({3, 6});
  AdamW opt({w, b}, {.lr = 0.1});
  for (int step = 0; step < 3; ++step) {
    Tensor y;
    {
      amp::Autocast ac(Device::cpu(), DType::bf16);
      y = nn::functional::linear(x, w, b);
    }
    const Tensor want = nn::functional::linear(x.to(DType::bf16), w.detach().to(DType::bf16), b.detach().to(DType::bf16));
    EXPECT_EQ(y.to_vector<float>(), want.to_vector<float>()) << "step " << step;
    opt.zero_grad();
    sum(y).backward();
    const Tensor copy = amp::kept_copy(w);
    ASSERT_TRUE(copy.defined());
    const uint64_t copy_version = copy.version();
    opt.step();
    EXPECT_GT(amp::kept_copy(w).version(), copy_version) << "AdamW wrote the copy";
    EXPECT_EQ(amp::kept_copy(w).to_vector<float>(), w.detach().to(DType::bf16).to_vector<float>());
    EXPECT_TRUE(amp::cast_parameter(w, DType::bf16).is_same(copy)) << "current after the step: no cast";
  }
  Tensor y;
  {
    amp::Autocast ac(Device::cpu(), DType::bf16);
    y = nn::functional::linear(x.requires_grad_(true), w, b);
  }
  opt.step();  // the weight (and its copy) change under the saved copy
  EXPECT_THROW(sum(y).backward(), Error);
}

// Parameters that share one storage (FlatParameters' views) share its version counter: AdamW marks their
// copies current once every update moved it, so each is current after the step, not only the last one.
TEST(Autocast, AdamWLeavesEveryKeptCopyOfFlatParametersCurrent) {
  Tensor w1 = randn({4, 6}).requires_grad_(true), w2 = randn({3, 4}).requires_grad_(true), x = randn({2, 6});
  FlatParameters flat({w1, w2});
  AdamW opt({w1, w2}, {.lr = 0.1});
  Tensor copies[2];
  for (int step = 0; step < 2; ++step) {
    Tensor y;
    {
      amp::Autocast ac(Device::cpu(), DType::bf16);
      y = nn::functional::linear(nn::functional::linear(x, w1), w2);
      copies[0] = amp::kept_copy(w1);
      copies[1] = amp::kept_copy(w2);
    }
    opt.zero_grad();
    sum(y).backward();
    opt.step();
    for (const Tensor* w : {&w1, &w2}) {
      const uint64_t written = amp::kept_copy(*w).version();
      const Tensor c = amp::cast_parameter(*w, DType::bf16);
      EXPECT_EQ(c.version(), written) << "step " << step << ": cast again after AdamW wrote it";
      EXPECT_EQ(c.to_vector<float>(), w->detach().to(DType::bf16).to_vector<float>());
    }
  }
  EXPECT_TRUE(copies[0].is_same(amp::kept_copy(w1)) && copies[1].is_same(amp::kept_copy(w2)));
}

// step_only over two disjoint parts, one after the other, is one step(): the same weights, moments and
// per-parameter step counts (what DistributedDataParallel's overlapped step relies on); a parameter outside
// the selection keeps its state untouched.
TEST(AdamW, StepOnlyOverTwoPartsEqualsOneStep) {
  manual_seed(12);
  Tensor a1 = randn({3, 4}).requires_grad_(true), b1 = randn({4}).requires_grad_(true);
  Tensor a2 = a1.detach().clone().requires_grad_(true), b2 = b1.detach().clone().requires_grad_(true);
  const Tensor x = randn({5, 4});
  AdamW whole({a1, b1}, {.lr = 0.05, .weight_decay = 0.1}), parts({a2, b2}, {.lr = 0.05, .weight_decay = 0.1});
  for (int step = 0; step < 3; ++step) {
    whole.zero_grad();
    sum(mul(add(nn::functional::linear(x, a1), b1.narrow(0, 0, 3)), 2.0)).backward();
    whole.step();
    parts.zero_grad();
    sum(mul(add(nn::functional::linear(x, a2), b2.narrow(0, 0, 3)), 2.0)).backward();
    parts.step_only([&](const Tensor& p) { return p.is_same(b2); });
    if (step == 0) {
      EXPECT_EQ(parts.state(0).step, 0);  // a2 not stepped yet: no moments, no count
      EXPECT_FALSE(parts.state(0).tensors.count("exp_avg"));
      EXPECT_EQ(parts.state(1).step, 1);
    }
    parts.step_only([&](const Tensor& p) { return !p.is_same(b2); });
  }
  EXPECT_EQ(a1.to_vector<float>(), a2.to_vector<float>());
  EXPECT_EQ(b1.to_vector<float>(), b2.to_vector<float>());
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(parts.state(i).step, 3);
    EXPECT_EQ(whole.state(i).tensors.at("exp_avg_sq").to_vector<float>(),
              parts.state(i).tensors.at("exp_avg_sq").to_vector<float>());
  }
}

// step_unless (GradScaler's step without a graph): a set flag leaves weights, moments and step counts as
// they were; a clear one is step().
TEST(AdamW, StepUnlessStepsOnlyWhereTheFlagIsClear) {
  manual_seed(13);
  Tensor w = randn({3, 4}).requires_grad_(true), twin = w.detach().clone().requires_grad_(true);
  AdamW opt({w}, {.lr = 0.05}), plain({twin}, {.lr = 0.05});
  const Tensor g = randn({3, 4});
  w.set_grad(g.clone());
  twin.set_grad(g.clone());
  opt.step_unless(full({}, 0.0, {.dtype = DType::f32}));
  plain.step();
  const std::vector<float> after_one = w.to_vector<float>();
  EXPECT_EQ(after_one, twin.to_vector<float>());
  opt.step_unless(full({}, 1.0, {.dtype = DType::f32}));
  EXPECT_EQ(w.to_vector<float>(), after_one);
  EXPECT_EQ(opt.state(0).step, 1);
  EXPECT_EQ(opt.state(0).tensors.at("exp_avg").to_vector<float>(), plain.state(0).tensors.at("exp_avg").to_vector<float>());
  EXPECT_THROW(opt.step_unless(full({2}, 0.0, {.dtype = DType::f32})), Error);  // not a flag
}

// The update kernel's own skip (AdamWHyper::found_inf, what a CUDA graph replay reads): a set flag writes
// nothing, parameters, moments and kept copy; a clear one takes the step.
TEST(AdamW, TheUpdateKernelWritesNothingWhereTheFlagIsSet) {
  manual_seed(14);
  Tensor p = randn({257}), g = randn({257}), m = mul(randn({257}), 0.01), v = mul(abs(randn({257})), 1e-3);
  Tensor copy = zeros({257}, {.dtype = DType::bf16});
  const std::vector<std::vector<float>> before{p.to_vector<float>(), m.to_vector<float>(), v.to_vector<float>(),
                                               copy.to_vector<float>()};
  Tensor flag = full({}, 1.0, {.dtype = DType::f32});
  AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1, 1 - 0.9, std::sqrt(1 - 0.999)};
  h.found_inf = flag.data_ptr<float>();
  kernels::adamw_step({p}, {g}, {m}, {v}, {copy}, h);
  EXPECT_EQ(p.to_vector<float>(), before[0]);
  EXPECT_EQ(m.to_vector<float>(), before[1]);
  EXPECT_EQ(v.to_vector<float>(), before[2]);
  EXPECT_EQ(copy.to_vector<float>(), before[3]);
  flag.zero_();
  kernels::adamw_step({p}, {g}, {m}, {v}, {copy}, h);
  EXPECT_NE(p.to_vector<float>(), before[0]);
  EXPECT_EQ(copy.to_vector<float>(), cast(p, DType::bf16).to_vector<float>());
}

}  // namespace
}  // namespace kiln::optim
