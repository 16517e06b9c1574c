// Philox4x32-10 against Random123's known answers, and the generators built on it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <thread>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "core_test_util.h"

using namespace kiln;

TEST(Philox, KnownAnswers) {
  using A4 = std::array<uint32_t, 4>;
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}), (A4{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}),
            (A4{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
            (A4{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Philox, StreamMapsCounterAndSeedOntoTheRawGenerator) {
  uint64_t counter = 0x0000000500000003ull, seed = 0x1234567890abcdefull;
  EXPECT_EQ(philox4x32(counter, seed), philox4x32_10({3u, 5u, 0u, 0u}, {0x90abcdefu, 0x12345678u}));
  EXPECT_NE(philox4x32(0, 1), philox4x32(1, 1));
  EXPECT_NE(philox4x32(0, 1), philox4x32(0, 2));
}

TEST(Philox, UnitFloat) {
  EXPECT_EQ(uint_to_unit_float(0u), 0.0f);
  EXPECT_LT(uint_to_unit_float(0xffffffffu), 1.0f);
  EXPECT_EQ(uint_to_unit_float(0x80000000u), 0.5f);
}

TEST(Generator, SameSeedSameNumbers) {
  Generator a(42), b(42), c(43);
  Tensor x = rand({1000}, {}, &a), y = rand({1000}, {}, &b), z = rand({1000}, {}, &c);
  EXPECT_EQ(x.to_vector<float>(), y.to_vector<float>());
  EXPECT_NE(x.to_vector<float>(), z.to_vector<float>());
  // the next draws continue the same stream
  EXPECT_EQ(randn({37}, {}, &a).to_vector<float>(), randn({37}, {}, &b).to_vector<float>());
  EXPECT_EQ(a.state().offset, b.state().offset);
}

TEST(Generator, ManualSeedResets) {
  Generator g(7);
  auto first = rand({100}, {}, &g).to_vector<float>();
  auto second = rand({100}, {}, &g).to_vector<float>();
  EXPECT_NE(first, second);
  g.manual_seed(7);
  EXPECT_EQ(g.state().offset, 0u);
  EXPECT_EQ(rand({100}, {}, &g).to_vector<float>(), first);

  manual_seed(99);
  auto d1 = randn({50}).to_vector<float>();
  manual_seed(99);
  EXPECT_EQ(randn({50}).to_vector<float>(), d1);
}

TEST(Generator, SetStateReplays) {
  Generator g(5);
  (void)rand({13}, {}, &g);
  GeneratorState s = g.state();
  auto v = randn({20}, {}, &g).to_vector<float>();
  g.set_state(s);
  EXPECT_EQ(randn({20}, {}, &g).to_vector<float>(), v);
}

TEST(Generator, UniformElementsComeFromTheDocumentedPhiloxWords) {
  Generator g(1234);
  (void)rand({5}, {}, &g);  // offset 2
  ASSERT_EQ(g.state().offset, 2u);
  auto v = rand({11}, {}, &g).to_vector<float>();
  for (uint64_t i = 0; i < v.size(); ++i)
    EXPECT_EQ(v[i], uint_to_unit_float(philox4x32(2 + i / 4, 1234)[i % 4])) << i;
}

TEST(Generator, UniformInUnitIntervalWithMeanHalf) {
  Generator g(3);
  auto v = rand({100000}, {}, &g).to_vector<double>();
  double lo = *std::min_element(v.begin(), v.end()), hi = *std::max_element(v.begin(), v.end());
  EXPECT_GE(lo, 0.0);
  EXPECT_LT(hi, 1.0);
  double mean = std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
  EXPECT_NEAR(mean, 0.5, 0.01);
  // a quarter of the samples in each quarter of the interval
  int64_t q = std::count_if(v.begin(), v.end(), [](double x) { return x < 0.25; });
  EXPECT_NEAR(double(q) / double(v.size()), 0.25, 0.01);
  auto d = rand({1000}, {.dtype = DType::f64}, &g).to_vector<double>();
  EXPECT_GE(*std::min_element(d.begin(), d.end()), 0.0);
  EXPECT_LT(*std::max_element(d.begin(), d.end()), 1.0);
}

TEST(Generator, UniformStaysBelowHighInHalfTypes) {
  // Rounding a value just below 1 into 8 or 11 mantissa bits must not produce 1: the interval is [0, 1).
  for (DType t : {DType::bf16, DType::f16}) {
    Generator g(11);
    auto v = rand({100000}, {.dtype = t}, &g).to_vector<double>();
    EXPECT_GE(*std::min_element(v.begin(), v.end()), 0.0) << dtype_name(t);
    EXPECT_LT(*std::max_element(v.begin(), v.end()), 1.0) << dtype_name(t);
    Tensor u = empty({100000}, {.dtype = t});
    uniform_(u, -2.0, 3.0, &g);
    auto w = u.to_vector<double>();
    EXPECT_GE(*std::min_element(w.begin(), w.end()), -2.0) << dtype_name(t);
    EXPECT_LT(*std::max_element(w.begin(), w.end()), 3.0) << dtype_name(t);
  }
}

TEST(Generator, NormalMomentsOver100k) {
  Generator g(17);
  auto v = randn({100000}, {}, &g).to_vector<double>();
  double mean = std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
  double sq = 0;
  for (double x : v) sq += (x - mean) * (x - mean);
  double sd = std::sqrt(sq / double(v.size() - 1));
  EXPECT_NEAR(mean, 0.0, 0.015);
  EXPECT_NEAR(sd, 1.0, 0.015);
  for (double x : v) ASSERT_TRUE(std::isfinite(x));
  // a tail fraction: P(|z| > 2) = 0.0455
  double tail = double(std::count_if(v.begin(), v.end(), [](double x) { return std::fabs(x) > 2; })) / double(v.size());
  EXPECT_NEAR(tail, 0.0455, 0.004);

  Tensor t = empty({20000}, {.dtype = DType::f64});
  normal_(t, 3.0, 0.5, &g);
  auto w = t.to_vector<double>();
  double m2 = std::accumulate(w.begin(), w.end(), 0.0) / double(w.size());
  EXPECT_NEAR(m2, 3.0, 0.02);
}

TEST(Generator, OffsetAdvancesByBlocks) {
  Generator g(0);
  EXPECT_EQ(g.state().offset, 0u);
  (void)rand({10}, {}, &g);  // ceil(10/4) = 3
  EXPECT_EQ(g.state().offset, 3u);
  (void)rand({8}, {}, &g);  // 2
  EXPECT_EQ(g.state().offset, 5u);
  (void)randn({5}, {}, &g);  // ceil(5/2) = 3
  EXPECT_EQ(g.state().offset, 8u);
  (void)randn({2, 3}, {}, &g);  // 3
  EXPECT_EQ(g.state().offset, 11u);
  (void)rand({1}, {.dtype = DType::f64}, &g);  // 1
  EXPECT_EQ(g.state().offset, 12u);
  Tensor t = zeros({4, 3});
  uniform_(t, 0, 1, &g);  // 3
  EXPECT_EQ(g.state().offset, 15u);
  normal_(t, 0, 1, &g);  // 6
  EXPECT_EQ(g.state().offset, 21u);
}

TEST(Generator, NonContiguousFillMatchesContiguousDraw) {
  Generator a(8), b(8);
  Tensor base = zeros({4, 6});
  Tensor view = base.t();  // (6, 4), non-contiguous
  uniform_(view, 0, 1, &a);
  Tensor ref = rand({6, 4}, {}, &b);
  EXPECT_EQ(view.to_vector<float>(), ref.to_vector<float>());
}

TEST(Generator, RandpermIsAPermutation) {
  Generator g(21);
  for (int64_t n : {1, 2, 10, 1000}) {
    Tensor p = randperm(n, &g);
    EXPECT_EQ(p.dtype(), DType::i64);
    auto v = p.to_vector<int64_t>();
    ASSERT_EQ(int64_t(v.size()), n);
    std::sort(v.begin(), v.end());
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(v[size_t(i)], i);
  }
  Generator a(5), b(5);
  EXPECT_EQ(randperm(50, &a).to_vector<int64_t>(), randperm(50, &b).to_vector<int64_t>());
  auto v = randperm(1000, &g).to_vector<int64_t>();
  int64_t fixed = 0;
  for (int64_t i = 0; i < 1000; ++i) fixed += v[size_t(i)] == i;
  EXPECT_LT(fixed, 10);  // not the identity (expected ~1 fixed point)
}

TEST(Generator, RandintRangeAndRandomBelow) {
  Generator g(4);
  auto v = randint(-3, 5, {10000}, {.dtype = DType::i64}, &g).to_vector<int64_t>();
  EXPECT_EQ(*std::min_element(v.begin(), v.end()), -3);
  EXPECT_EQ(*std::max_element(v.begin(), v.end()), 4);
  for (int i = 0; i < 1000; ++i) {
    uint64_t r = g.random_below(7);
    ASSERT_LT(r, 7u);
  }
  EXPECT_KILN_ERROR(randint(3, 3, {2}, {.dtype = DType::i64}, &g), "randint");
  EXPECT_KILN_ERROR(rand({3}, {.dtype = DType::i32}, &g), "floating");
}

// The default generator is shared by every thread: concurrent draws must each claim their own blocks
// (no two identical draws, no lost offsets).
TEST(Random, ConcurrentDrawsFromTheDefaultGeneratorNeverOverlap) {
  manual_seed(5);
  constexpr int kThreads = 8, kDraws = 1000;
  std::vector<std::vector<std::vector<float>>> draws(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kDraws; ++i) draws[size_t(t)].push_back(randn({8}).to_vector<float>());
    });
  for (auto& th : threads) th.join();
  // Whole draws (8 values) as keys: two equal ones mean the same blocks were used (single floats of
  // different draws may coincide by chance).
  std::set<std::vector<float>> seen;
  for (const auto& d : draws) seen.insert(d.begin(), d.end());
  EXPECT_EQ(seen.size(), size_t(kThreads * kDraws)) << "two draws used the same Philox blocks";
  // randn of 8 values claims 4 blocks: every claim is counted.
  EXPECT_EQ(default_generator().state().offset, uint64_t(kThreads * kDraws * 4));
}
