// WindowSampler: batches of random windows (nanoGPT's get_batch).
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include <kiln/core/data/window_sampler.h>

namespace kiln::data {
namespace {

TEST(WindowSampler, WindowsAreConsecutiveTokensAndTargetsAreShiftedByOne) {
  std::vector<int32_t> tokens(50);
  std::iota(tokens.begin(), tokens.end(), 100);  // token i is 100 + i, so a value names its position
  WindowSampler sampler(tokens, 6, 8);
  Generator gen(3);
  std::vector<int64_t> starts;
  for (int round = 0; round < 20; ++round) {
    auto [x, y] = sampler.sample(gen);
    ASSERT_EQ(x.sizes(), (Shape{6, 8}));
    ASSERT_EQ(y.sizes(), (Shape{6, 8}));
    ASSERT_EQ(x.dtype(), DType::i64);
    const auto xs = x.contiguous().to_vector<int64_t>(), ys = y.contiguous().to_vector<int64_t>();
    for (int64_t b = 0; b < 6; ++b) {
      const int64_t start = xs[size_t(b * 8)] - 100;
      ASSERT_GE(start, 0);
      ASSERT_LT(start, 50 - 8);  // the window's last target is token start + 8 <= 49
      starts.push_back(start);
      for (int64_t t = 0; t < 8; ++t) {
        EXPECT_EQ(xs[size_t(b * 8 + t)], 100 + start + t);
        EXPECT_EQ(ys[size_t(b * 8 + t)], 100 + start + t + 1);
      }
    }
  }
  // 120 draws from 42 offsets reach both ends of the range.
  EXPECT_EQ(*std::min_element(starts.begin(), starts.end()), 0);
  EXPECT_EQ(*std::max_element(starts.begin(), starts.end()), 41);
}

TEST(WindowSampler, BatchesFollowTheGeneratorState) {
  std::vector<int32_t> tokens(1000);
  std::iota(tokens.begin(), tokens.end(), 0);
  WindowSampler sampler(tokens, 4, 16);
  Generator a(7);
  sampler.sample(a);
  const auto saved = a.state();  // as a checkpoint stores it
  const auto next = sampler.sample(a).first.to_vector<int64_t>();
  Generator b(0);
  b.set_state(saved);
  EXPECT_EQ(sampler.sample(b).first.to_vector<int64_t>(), next);
}

TEST(WindowSampler, ShardsConcatenateToTheGlobalBatchAndLeaveTheSameGeneratorState) {
  std::vector<int32_t> tokens(1000);
  std::iota(tokens.begin(), tokens.end(), 0);
  const WindowSampler global(tokens, 12, 16);
  Generator g(11);
  global.sample(g);  // not the first batch: the shards follow any state
  const auto state = g.state();
  const auto whole = global.sample(g).first.to_vector<int64_t>();
  for (const int64_t shards : {1, 2, 3, 4}) {
    const WindowSampler part(tokens, 12 / shards, 16);
    std::vector<int64_t> joined;
    for (int64_t s = 0; s < shards; ++s) {
      Generator r(0);
      r.set_state(state);  // every rank holds the same state
      const auto piece = part.sample(r, s, shards).first.to_vector<int64_t>();
      joined.insert(joined.end(), piece.begin(), piece.end());
      EXPECT_EQ(r.state().offset, g.state().offset) << "shard " << s << " of " << shards;
    }
    EXPECT_EQ(joined, whole) << shards << " shards";
  }
  Generator r(0);
  EXPECT_THROW(global.sample(r, 2, 2), Error);
  EXPECT_THROW(global.sample(r, -1, 2), Error);
  EXPECT_THROW(global.sample(r, 0, 0), Error);
}

TEST(WindowSampler, RefusesSequencesTooShortAndBadSizes) {
  EXPECT_THROW(WindowSampler(std::vector<int32_t>(9, 0), 2, 8), Error);  // needs block_size + 2 = 10 tokens
  EXPECT_NO_THROW(WindowSampler(std::vector<int32_t>(10, 0), 2, 8));
  EXPECT_THROW(WindowSampler(std::vector<int32_t>(100, 0), 0, 8), Error);
  EXPECT_THROW(WindowSampler(std::vector<int32_t>(100, 0), 2, 0), Error);
  EXPECT_THROW(WindowSampler(std::vector<int32_t>{1, 2, -3, 4, 5, 6}, 1, 2), Error);
}

}  // namespace
}  // namespace kiln::data
