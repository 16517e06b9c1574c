// pad_sequence and padding_mask: torch.nn.utils.rnn.pad_sequence's layout, and the mask of the padding.
#include <gtest/gtest.h>

#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/data/pad_sequence.h>
#include <kiln/core/ops.h>

namespace kiln::data {
namespace {

TEST(PadSequence, PadsToTheLongestAndKeepsTheValues) {
  Tensor a = from_vector(std::vector<int64_t>{1, 2, 3}, {3}), b = from_vector(std::vector<int64_t>{4}, {1}),
         c = from_vector(std::vector<int64_t>{5, 6}, {2});
  Tensor x = pad_sequence({a, b, c}, true, -1);
  EXPECT_EQ(x.sizes(), (Shape{3, 3}));
  EXPECT_EQ(x.dtype(), DType::i64);
  EXPECT_EQ(x.contiguous().to_vector<int64_t>(), (std::vector<int64_t>{1, 2, 3, 4, -1, -1, 5, 6, -1}));
  Tensor t = pad_sequence({a, b, c}, false);
  EXPECT_EQ(t.sizes(), (Shape{3, 3}));
  EXPECT_EQ(t.contiguous().to_vector<int64_t>(), (std::vector<int64_t>{1, 4, 5, 2, 0, 6, 3, 0, 0}));
  // trailing dims are kept; mismatched ones are an error naming the sequence
  Tensor f = pad_sequence({ones({2, 3}), ones({4, 3})});
  EXPECT_EQ(f.sizes(), (Shape{2, 4, 3}));
  EXPECT_EQ(sum(f).item<double>(), 18.0);
  EXPECT_THROW(pad_sequence({ones({2, 3}), ones({2, 4})}), Error);
  EXPECT_THROW(pad_sequence({}), Error);
}

TEST(PadSequence, GradientsReachEachSequence) {
  Tensor a = ones({2, 2}).requires_grad_(true), b = ones({3, 2}).requires_grad_(true);
  Tensor w = arange(0.0, 12.0, 1.0).reshape({2, 3, 2});
  sum(mul(pad_sequence({a, b}), w)).backward();
  EXPECT_EQ(a.grad().contiguous().to_vector<double>(), (std::vector<double>{0, 1, 2, 3}));
  EXPECT_EQ(b.grad().contiguous().to_vector<double>(), (std::vector<double>{6, 7, 8, 9, 10, 11}));
}

TEST(PaddingMask, TrueAtPositionsPastEachLength) {
  Tensor m = padding_mask({3, 1, 0}, 3);
  EXPECT_EQ(m.dtype(), DType::boolean);
  EXPECT_EQ(cast(m, DType::i64).contiguous().to_vector<int64_t>(), (std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1, 1}));
  EXPECT_THROW(padding_mask({4}, 3), Error);
}

}  // namespace
}  // namespace kiln::data
