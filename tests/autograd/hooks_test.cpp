// Tensor hooks and retain_grad.
#include <gtest/gtest.h>

#include <kiln/core/ops.h>

#include "../core/core_test_util.h"

using namespace kiln;

TEST(Hooks, CalledWithTheGradient) {
  Tensor x = tensor({1, 2, 3}, {3}, {.requires_grad = true});
  Tensor y = x * 2.0;
  std::vector<float> seen;
  int calls = 0;
  y.register_hook([&](const Tensor& g) {
    ++calls;
    seen = g.to_vector<float>();
    return Tensor();  // keep the gradient
  });
  (y * tensor({1, 10, 100}, {3})).sum().backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, (std::vector<float>{1, 10, 100}));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 20, 200}));
}

TEST(Hooks, CanReplaceTheGradient) {
  Tensor x = tensor({1, 2, 3}, {3}, {.requires_grad = true});
  Tensor y = x * 2.0;
  y.register_hook([](const Tensor& g) { return g * 0.5; });
  y.sum().backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{1, 1, 1}));
}

TEST(Hooks, HooksRunInRegistrationOrderAndChain) {
  Tensor x = tensor({1, 2}, {2}, {.requires_grad = true});
  Tensor y = x * 1.0;
  std::vector<int> order;
  y.register_hook([&](const Tensor& g) {
    order.push_back(1);
    return g + 1.0;
  });
  y.register_hook([&](const Tensor& g) {
    order.push_back(2);
    EXPECT_EQ(g.to_vector<float>(), (std::vector<float>{2, 2}));  // sees the first hook's result
    return g * 3.0;
  });
  y.sum().backward();
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{6, 6}));
}

TEST(Hooks, HookOnALeaf) {
  Tensor x = tensor({1, 2}, {2}, {.requires_grad = true});
  x.register_hook([](const Tensor& g) { return g * -1.0; });
  (x * 5.0).sum().backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{-5, -5}));
  // the hook sees the summed gradient from every use
  Tensor w = tensor({1, 2}, {2}, {.requires_grad = true});
  int calls = 0;
  std::vector<float> seen;
  w.register_hook([&](const Tensor& g) {
    ++calls;
    seen = g.to_vector<float>();
    return Tensor();
  });
  (w * 2.0 + w * 3.0).sum().backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, (std::vector<float>{5, 5}));
  EXPECT_KILN_ERROR(zeros({2}).register_hook([](const Tensor& g) { return g; }), "register_hook");
}

TEST(Hooks, RetainGradOnANonLeaf) {
  Tensor x = tensor({1, 2, 3}, {3}, {.requires_grad = true});
  Tensor y = x * x;
  Tensor z = y * 3.0;
  y.retain_grad();
  z.sum().backward(Tensor(), true);
  ASSERT_TRUE(y.grad().defined());
  EXPECT_EQ(y.grad().to_vector<float>(), (std::vector<float>{3, 3, 3}));
  EXPECT_FALSE(z.grad().defined());  // not retained
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{6, 12, 18}));
  z.sum().backward();  // accumulates like a leaf's grad
  EXPECT_EQ(y.grad().to_vector<float>(), (std::vector<float>{6, 6, 6}));
  // retain_grad on a leaf is a no-op; on a tensor without grad it is an error
  x.retain_grad();
  EXPECT_KILN_ERROR(zeros({1}).retain_grad(), "retain_grad");
}

TEST(Hooks, RetainedGradIsAnIndependentCopy) {
  Tensor x = tensor({1, 2}, {2}, {.requires_grad = true});
  Tensor y = x + 0.0;
  y.retain_grad();
  y.sum().backward();
  Tensor g = y.grad();
  g.mul_(100.0);
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{1, 1}));
}
