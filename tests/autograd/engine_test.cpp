// The backward pass: accumulation into .grad, retain_graph, grad modes, detach, requires_grad
// propagation, in-place checks on tensors that require grad, and gradcheck itself.
#include <gtest/gtest.h>

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/gradcheck.h>
#include <kiln/autograd/node.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "../core/core_test_util.h"

using namespace kiln;
using kiln::test::AllClose;

namespace {
Tensor leaf(std::initializer_list<double> v, const Shape& s, DType t = DType::f32) {
  return tensor(v, s, {.dtype = t, .requires_grad = true});
}
}  // namespace

TEST(Engine, BackwardOnScalarAccumulatesIntoGrad) {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor w = leaf({4, 5, 6}, {3});
  Tensor loss = (x * w).sum();
  EXPECT_TRUE(loss.requires_grad());
  EXPECT_FALSE(loss.is_leaf());
  EXPECT_FALSE(x.grad().defined());
  loss.backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{4, 5, 6}));
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(x.grad().sizes(), x.sizes());
  EXPECT_EQ(x.grad().dtype(), DType::f32);
  EXPECT_FALSE(x.grad().requires_grad());
}

TEST(Engine, GradientsAccumulateOverTwoBackwardCalls) {
  Tensor x = leaf({1, 2}, {2});
  (x * x).sum().backward();  // 2x
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 4}));
  (x * 3.0).sum().backward();  // + 3
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{5, 7}));
  x.set_grad(Tensor());
  EXPECT_FALSE(x.grad().defined());
  x.sum().backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{1, 1}));
}

TEST(Engine, GradientSumsOverSeveralPaths) {
  // y = x*x + exp(x) + x used three times; dy/dx = 2x + exp(x) + 1
  Tensor x = leaf({0.5, -1.0, 2.0}, {3}, DType::f64);
  Tensor y = (x * x + exp(x) + x).sum();
  y.backward();
  std::vector<double> want;
  for (double v : {0.5, -1.0, 2.0}) want.push_back(2 * v + std::exp(v) + 1);
  EXPECT_TRUE(AllClose(x.grad().to_vector<double>(), want, 1e-12));
}

TEST(Engine, BroadcastGradientsAreSummedToTheInputShape) {
  Tensor a = leaf({1, 2, 3}, {3, 1});
  Tensor b = leaf({10, 20}, {2});
  (a * b).sum().backward();
  EXPECT_EQ(a.grad().sizes(), (Shape{3, 1}));
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{30, 30, 30}));
  EXPECT_EQ(b.grad().to_vector<float>(), (std::vector<float>{6, 6}));
}

TEST(Engine, NonScalarBackwardNeedsAGradient) {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor y = x * 2.0;
  EXPECT_KILN_ERROR(y.backward(), "backward", "non-scalar");
  EXPECT_KILN_ERROR(y.backward(ones({2})), "backward");
  y.backward(tensor({1, 10, 100}, {3}));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 20, 200}));
  EXPECT_KILN_ERROR(zeros({1}).backward(), "backward", "does not require grad");
}

TEST(Engine, BackwardTwiceNeedsRetainGraph) {
  Tensor x = leaf({1, 2}, {2});
  Tensor y = exp(x).sum();
  y.backward();
  EXPECT_KILN_ERROR(y.backward(), "second time", "retain_graph");

  Tensor z = exp(x).sum();
  x.set_grad(Tensor());
  z.backward(Tensor(), /*retain_graph=*/true);
  auto g1 = x.grad().to_vector<double>();
  z.backward(Tensor(), true);
  auto g2 = x.grad().to_vector<double>();
  EXPECT_TRUE(AllClose(g2, {2 * g1[0], 2 * g1[1]}, 1e-6));
  z.backward();  // a last pass that frees the graph
  EXPECT_KILN_ERROR(z.backward(), "second time");
}

TEST(Engine, NoGradGuardAndEnableGradGuard) {
  Tensor x = leaf({1, 2}, {2});
  EXPECT_TRUE(autograd::is_grad_enabled());
  {
    NoGradGuard ng;
    EXPECT_FALSE(autograd::is_grad_enabled());
    Tensor y = x * 2.0;
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(y.is_leaf());
    EXPECT_FALSE(matmul(x, x).requires_grad());
    {
      EnableGradGuard eg;
      EXPECT_TRUE(autograd::is_grad_enabled());
      Tensor z = x * 3.0;
      EXPECT_TRUE(z.requires_grad());
      z.sum().backward();
    }
    EXPECT_FALSE(autograd::is_grad_enabled());
    {
      NoGradGuard nested;
    }
    EXPECT_FALSE(autograd::is_grad_enabled());
  }
  EXPECT_TRUE(autograd::is_grad_enabled());
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{3, 3}));
}

TEST(Engine, DetachCutsTheGraph) {
  Tensor x = leaf({1, 2}, {2});
  Tensor y = x * x;
  Tensor d = y.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_TRUE(d.is_leaf());
  EXPECT_TRUE(d.shares_storage(y));
  Tensor loss = (y + d).sum();  // only the y path carries gradient
  loss.backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 4}));
  // detach of a leaf
  Tensor xd = x.detach();
  EXPECT_FALSE(xd.requires_grad());
  EXPECT_FALSE((xd * 2.0).requires_grad());
}

TEST(Engine, RequiresGradPropagation) {
  Tensor a = leaf({1, 2}, {2});
  Tensor b = tensor({3, 4}, {2});
  EXPECT_TRUE(a.requires_grad());
  EXPECT_FALSE(b.requires_grad());
  EXPECT_FALSE((b * 2.0).requires_grad());
  EXPECT_TRUE((a + b).requires_grad());
  EXPECT_TRUE((b + a).requires_grad());
  EXPECT_TRUE(a.view({2, 1}).requires_grad());
  EXPECT_TRUE(a.unsqueeze(0).expand({3, 2}).requires_grad());
  EXPECT_TRUE(cat({a, b}).requires_grad());
  EXPECT_TRUE(a.to(DType::f64).requires_grad());
  EXPECT_FALSE(eq(a, b).requires_grad());  // comparisons carry no gradient
  EXPECT_FALSE(argmax(a, 0).requires_grad());
  // gradient only reaches inputs that require it
  (a * b).sum().backward();
  EXPECT_FALSE(b.grad().defined());
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{3, 4}));
  // requires_grad_(false) on a leaf stops tracking; non-leaves cannot stop
  Tensor c = leaf({1}, {1});
  c.requires_grad_(false);
  EXPECT_FALSE((c * 2.0).requires_grad());
  EXPECT_KILN_ERROR((a * 2.0).requires_grad_(false), "requires_grad_", "leaf");
  // gradient through a cast lands in the leaf's dtype
  Tensor h = leaf({1, 2}, {2}, DType::f64);
  (h.to(DType::f32) * 2.0).sum().backward();
  EXPECT_EQ(h.grad().dtype(), DType::f64);
  EXPECT_EQ(h.grad().to_vector<double>(), (std::vector<double>{2, 2}));
}

TEST(Engine, GradientsThroughViews) {
  Tensor x = tensor({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::f64, .requires_grad = true});
  Tensor w = tensor({1, 10, 100}, {3}, {.dtype = DType::f64});
  // every element picked by some view chain, weighted differently
  Tensor y = (x.t().select(0, 2) * 7.0).sum() + (x.slice(1, 0, 3, 2) * 2.0).sum() + (x.view({6}).narrow(0, 1, 2)).sum() +
             (x.select(0, 1) * w).sum() + x.unsqueeze(0).expand({4, 2, 3}).sum();
  y.backward();
  // column 2 (*7) ; columns 0,2 (*2) ; flat elements 1,2 ; row 1 times w ; all ones times 4
  std::vector<double> want = {2 + 0 + 4, 1 + 4, 7 + 2 + 1 + 4, 2 + 1 + 4, 10 + 4, 7 + 2 + 100 + 4};
  EXPECT_TRUE(AllClose(x.grad().to_vector<double>(), want, 0));
}

TEST(Engine, InPlaceOnTensorsThatRequireGradThrows) {
  Tensor x = leaf({1, 2}, {2});
  EXPECT_KILN_ERROR(x.mul_(2.0), "mul_", "requires grad", "NoGradGuard");
  EXPECT_KILN_ERROR(x.add_(ones({2})), "add_", "requires grad");
  EXPECT_KILN_ERROR(x.fill_(0.0), "fill_");
  EXPECT_KILN_ERROR(x.zero_(), "fill_");
  EXPECT_KILN_ERROR(x.copy_(ones({2})), "copy_");
  EXPECT_KILN_ERROR(x.narrow(0, 0, 1).fill_(3.0), "fill_");  // a view of it requires grad too
  Tensor y = x * 2.0;
  EXPECT_KILN_ERROR(y.add_(1.0), "add_");  // non-leaf as well
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{1, 2}));
  {
    NoGradGuard ng;
    x.mul_(2.0);  // allowed: an optimizer-style update
    x.sub_(ones({2}));
  }
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{1, 3}));
  EXPECT_TRUE(x.requires_grad());
  EXPECT_TRUE(x.is_leaf());
}

TEST(Engine, GradcheckAcceptsCorrectAndDetectsWrongGradients) {
  auto good = [](const std::vector<Tensor>& in) { return tanh(in[0]) * in[1]; };
  Tensor a = tensor({0.3, -0.7, 1.1}, {3}, {.dtype = DType::f64, .requires_grad = true});
  Tensor b = tensor({2.0, 0.5, -1.0}, {3}, {.dtype = DType::f64, .requires_grad = true});
  auto ok = autograd::gradcheck(good, {a, b});
  EXPECT_TRUE(ok.ok) << ok.message;
  EXPECT_LT(ok.max_abs_error, 1e-6);

  // a custom op y = x³ whose backward claims 2x² (wrong)
  auto wrong = [](const std::vector<Tensor>& in) {
    const Tensor& x = in[0];
    Tensor y;
    {
      NoGradGuard ng;
      y = x * x * x;
    }
    if (autograd::any_requires_grad({x}))
      autograd::record("bad_cube", {x}, {y}, [x](const std::vector<Tensor>& g) {
        return std::vector<Tensor>{g[0] * x.detach() * x.detach() * 2.0};
      });
    return y;
  };
  auto bad = autograd::gradcheck(wrong, {a});
  EXPECT_FALSE(bad.ok);
  EXPECT_NE(bad.message.find("input 0"), std::string::npos) << bad.message;
  EXPECT_GT(bad.max_abs_error, 0.1);

  // the same op with the right backward passes
  auto right = [](const std::vector<Tensor>& in) {
    const Tensor& x = in[0];
    Tensor y;
    {
      NoGradGuard ng;
      y = x * x * x;
    }
    if (autograd::any_requires_grad({x}))
      autograd::record("cube", {x}, {y}, [x](const std::vector<Tensor>& g) {
        return std::vector<Tensor>{g[0] * x.detach() * x.detach() * 3.0};
      });
    return y;
  };
  EXPECT_TRUE(autograd::gradcheck(right, {a}).ok);
  EXPECT_KILN_ERROR(autograd::gradcheck(good, {a.detach().to(DType::f32).requires_grad_(), b}), "gradcheck", "f64");
}

TEST(AccumulateGrad, NeverAliasesATensorTheUserStillHolds) {
  using namespace kiln;
  Tensor x = randn({3}).requires_grad_(true);
  Tensor seed = ones({3});
  Tensor y = x * 1.0;
  y.backward(seed);  // the seed reaches x's accumulator through mul's backward: a fresh tensor
  Tensor g1 = x.grad();
  Tensor z = x.clone();
  z.backward(seed);  // clone's backward passes the user's seed straight through: must be copied
  EXPECT_FALSE(x.grad().shares_storage(seed));
  EXPECT_EQ(x.grad().to_vector<float>(), std::vector<float>(3, 2.0f));
  EXPECT_EQ(seed.to_vector<float>(), std::vector<float>(3, 1.0f));  // the user's tensor is untouched
  x.set_grad(Tensor());
  Tensor w = x.clone();
  w.backward(seed);
  EXPECT_FALSE(x.grad().shares_storage(seed));
  x.grad().add_(ones({3}));
  EXPECT_EQ(seed.to_vector<float>(), std::vector<float>(3, 1.0f));
  (void)g1;
}

// is_implicit_seed: true for the ones a pass made for a root given no gradient, in the root's node; false
// for a gradient passed in (even of ones), below the root (also for the seed tensor itself, which add
// passes on), with a hook on the root, with several roots, and outside the pass.
TEST(Engine, ImplicitSeedIsKnownOnlyToTheRootsNode) {
  std::vector<int> seen;  // what the probe's backward saw, in order
  auto probe = [&](const Tensor& x) {
    Tensor out = x.detach().sum();
    autograd::record("seed_probe", {x}, {out}, [&seen, n = x.numel()](const std::vector<Tensor>& g) {
      seen.push_back(autograd::is_implicit_seed(g[0]) ? 1 : 0);
      return std::vector<Tensor>{g[0].expand({n}).contiguous()};
    });
    return out;
  };
  Tensor x = leaf({1, 2, 3}, {3});
  probe(x).backward();
  probe(x).backward(ones({}));
  mul(probe(x), 1.0).backward();
  Tensor c = leaf({0}, {});
  add(probe(x), c).backward();  // add passes the seed itself on: below the root it counts as any gradient
  Tensor hooked = probe(x);
  hooked.register_hook([](const Tensor& g) { return g; });
  hooked.backward();
  Tensor a = probe(x), b = probe(x);
  autograd::run_backward({a, b}, {}, false);
  Tensor kept = probe(x);
  kept.backward(Tensor(), /*retain_graph=*/true);
  kept.backward();
  EXPECT_EQ(seen, (std::vector<int>{1, 0, 0, 0, 0, 0, 0, 1, 1}));
  EXPECT_FALSE(autograd::is_implicit_seed(ones({})));
  EXPECT_EQ(x.grad().to_vector<float>(), std::vector<float>(3, 9.0f));
}
