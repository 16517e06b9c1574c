// Conv2d against a direct loop over the definition; pooling by hand.
#include <gtest/gtest.h>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/random.h>
#include <kiln/nn/conv2d.h>
#include <kiln/nn/pooling.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::error_message;
using testing::expect_close;
using testing::values;

// out[n,o,y,x] = b[o] + Σ_{c,i,j} w[o,c,i,j] · in[n,c, y·s + i·d - p, x·s + j·d - p]
std::vector<double> reference_conv(const Tensor& input, const Tensor& weight, const Tensor& bias, int64_t s, int64_t p,
                                   int64_t d, int64_t Ho, int64_t Wo) {
  auto in = values(input), w = values(weight), b = values(bias);
  int64_t N = input.size(0), C = input.size(1), H = input.size(2), W = input.size(3);
  int64_t O = weight.size(0), K = weight.size(2);
  std::vector<double> out;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t y = 0; y < Ho; ++y)
        for (int64_t x = 0; x < Wo; ++x) {
          double acc = b[size_t(o)];
          for (int64_t c = 0; c < C; ++c)
            for (int64_t i = 0; i < K; ++i)
              for (int64_t j = 0; j < K; ++j) {
                int64_t yy = y * s + i * d - p, xx = x * s + j * d - p;
                if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
                acc += w[size_t(((o * C + c) * K + i) * K + j)] * in[size_t(((n * C + c) * H + yy) * W + xx)];
              }
          out.push_back(acc);
        }
  return out;
}

TEST(Conv2d, OutputShapeFollowsStridePaddingDilation) {
  Conv2d conv(3, 8, 3, {.stride = 2, .padding = 1});
  EXPECT_EQ(conv.weight.shape(), (Shape{8, 3, 3, 3}));
  EXPECT_EQ(conv.bias.shape(), (Shape{8}));
  EXPECT_EQ(conv(zeros({2, 3, 32, 32})).shape(), (Shape{2, 8, 16, 16}));
  Conv2d dilated(3, 4, {3, 5}, {.dilation = 2});
  // H: 10 - 2·2 = 6, W: 12 - 2·4 = 4
  EXPECT_EQ(dilated(zeros({1, 3, 10, 12})).shape(), (Shape{1, 4, 6, 4}));
  EXPECT_EQ(dilated(zeros({3, 10, 12})).shape(), (Shape{4, 6, 4}));  // unbatched
}

TEST(Conv2d, HandCheckedValue) {
  Conv2d conv(1, 1, 3, {.padding = 1});
  {
    NoGradGuard g;
    conv.weight.copy_(tensor({1, 0, -1, 2, 0, -2, 1, 0, -1}, {1, 1, 3, 3}));  // Sobel x
    conv.bias.fill_(0.5);
  }
  Tensor x = arange(0.0, 16.0).reshape({1, 1, 4, 4});  // x[r, c] = 4r + c
  Tensor y = conv(x);
  ASSERT_EQ(y.shape(), (Shape{1, 1, 4, 4}));
  auto v = values(y);
  // Interior (1,1): rows 0..2, cols 0..2: Σ (x[r,0] - x[r,2]) · (1,2,1) = -2·4 = -8, plus 0.5.
  EXPECT_NEAR(v[5], -7.5, 1e-5);
  // Corner (0,0) with zero padding: w[1,2]·x[0,1] + w[2,2]·x[1,1] = -2·1 - 1·5 = -7, plus 0.5.
  EXPECT_NEAR(v[0], -6.5, 1e-5);
}

TEST(Conv2d, MatchesTheDefinition) {
  manual_seed(10);
  Conv2d conv(3, 2, 3, {.stride = 2, .padding = 1, .dilation = 2});
  Tensor x = randn({2, 3, 7, 6});
  Tensor y = conv(x);
  // H: (7 + 2 - 4 - 1)/2 + 1 = 3, W: (6 + 2 - 4 - 1)/2 + 1 = 2
  ASSERT_EQ(y.shape(), (Shape{2, 2, 3, 2}));
  expect_close(values(y), reference_conv(x, conv.weight, conv.bias, 2, 1, 2, 3, 2), 1e-4);
}

TEST(Conv2d, BadInputsNameTheLayer) {
  Conv2d conv(3, 8, 3);
  std::string rank = error_message([&] { conv(zeros({3, 32})); });
  EXPECT_NE(rank.find("Conv2d(3, 8"), std::string::npos) << rank;
  EXPECT_NE(rank.find("f32[3, 32]"), std::string::npos) << rank;
  std::string channels = error_message([&] { conv(zeros({1, 4, 8, 8})); });
  EXPECT_NE(channels.find("3 input channels"), std::string::npos) << channels;
  EXPECT_NE(channels.find("[1, 4, 8, 8]"), std::string::npos) << channels;
  EXPECT_THROW(conv(zeros({1, 3, 2, 2})), Error);  // smaller than the kernel
  EXPECT_THROW(Conv2d(3, 8, 3, {.stride = 0}), Error);
}

TEST(Pooling, MaxAndAverageByHand) {
  Tensor x = arange(0.0, 16.0).reshape({1, 1, 4, 4});
  MaxPool2d max_pool(2);
  AvgPool2d avg_pool(2);
  EXPECT_EQ(values(max_pool(x)), (std::vector<double>{5, 7, 13, 15}));
  expect_close(values(avg_pool(x)), {2.5, 4.5, 10.5, 12.5}, 1e-6);
  // Overlapping windows with padding: stride 1, padding 1, kernel 3 keeps the size.
  MaxPool2d same(3, {.stride = 1, .padding = 1});
  Tensor y = same(x);
  EXPECT_EQ(y.shape(), (Shape{1, 1, 4, 4}));
  EXPECT_EQ(values(y)[0], 5.0);
  EXPECT_EQ(values(y)[15], 15.0);
  // AvgPool2d counts padding in the divisor: the corner window holds 0, 1, 4, 5 among 9 cells.
  AvgPool2d avg_same(3, {.stride = 1, .padding = 1});
  EXPECT_NEAR(values(avg_same(x))[0], 10.0 / 9.0, 1e-6);
  // Non-square kernels and unbatched inputs.
  EXPECT_EQ(MaxPool2d({2, 1})(zeros({3, 4, 5})).shape(), (Shape{3, 2, 5}));
}

TEST(Pooling, BadInputsNameTheLayer) {
  MaxPool2d pool(2);
  std::string msg = error_message([&] { pool(zeros({4, 4})); });
  EXPECT_NE(msg.find("MaxPool2d"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 4]"), std::string::npos) << msg;
  EXPECT_THROW(MaxPool2d(2, {.padding = 2}), Error);
}

}  // namespace
}  // namespace kiln::nn
