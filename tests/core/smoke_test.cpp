#include <gtest/gtest.h>

#include <kiln/core/ops.h>

using namespace kiln;

TEST(Smoke, AddBroadcast) {
  Tensor a = tensor({1, 2, 3}, {3});
  Tensor b = tensor({10, 20}, {2, 1});
  Tensor c = a + b;
  EXPECT_EQ(c.sizes(), (Shape{2, 3}));
  EXPECT_EQ(c.to_vector<float>(), (std::vector<float>{11, 12, 13, 21, 22, 23}));
}
