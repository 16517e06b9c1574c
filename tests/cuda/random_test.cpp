// CUDA random fills against the CPU: uniform bit for bit (Philox4x32-10 on the device, the same double
// arithmetic and the same clamp below the upper bound), normal within 1 ulp of the dtype, and dropout
// masks that agree across devices for the same generator.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>

#include "cuda_test_util.h"

using namespace kiln;

namespace {

const Device kGpu = Device::cuda(0);
const DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64};

// The value's bits in dtype t as an integer ordered like the values, so |difference| counts ulps.
int64_t ordered_bits(DType t, double v) {
  auto ord = [](uint64_t bits, uint64_t sign) { return (bits & sign) ? -int64_t(bits & (sign - 1)) : int64_t(bits); };
  switch (t) {
    case DType::f32: {
      float f = float(v);
      uint32_t b;
      std::memcpy(&b, &f, 4);
      return ord(b, 0x80000000u);
    }
    case DType::f64: {
      uint64_t b;
      std::memcpy(&b, &v, 8);
      return ord(b, 0x8000000000000000ull);
    }
    case DType::f16: return ord(Half(float(v)).bits, 0x8000u);
    case DType::bf16: return ord(BFloat16(float(v)).bits, 0x8000u);
    default: return int64_t(v);
  }
}

// Fills a CPU and a CUDA tensor from two generators in the same state.
struct Pair {
  Tensor cpu, gpu;
};
Pair draw(Distribution dist, DType t, const Shape& s, double a, double b, uint64_t seed, int64_t skip) {
  Generator gc(seed), gg(seed);
  // advance both generators so the draw starts at a nonzero Philox offset
  if (skip > 0) {
    rand({skip}, {}, &gc);
    rand({skip}, {}, &gg);
  }
  Pair p{empty(s, {.dtype = t}), empty(s, {.dtype = t, .device = kGpu})};
  if (dist == Distribution::uniform) {
    uniform_(p.cpu, a, b, &gc);
    uniform_(p.gpu, a, b, &gg);
  } else {
    normal_(p.cpu, a, b, &gc);
    normal_(p.gpu, a, b, &gg);
  }
  EXPECT_EQ(gc.state().offset, gg.state().offset);
  return p;
}

std::string label(DType t, int64_t n, double a, double b) {
  return std::string(dtype_name(t)) + " n=" + std::to_string(n) + " [" + std::to_string(a) + ", " + std::to_string(b) + ")";
}

}  // namespace

TEST(CudaRandom, UniformIsBitExactWithTheCpu) {
  KILN_REQUIRE_GPU();
  const std::pair<double, double> ranges[] = {{0.0, 1.0}, {-2.0, 3.0}, {0.9, 1.0}, {-1.0, -0.25}, {100.0, 101.0}};
  uint64_t seed = 11;
  for (DType t : kFloatTypes) {
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(1000003)}) {
      for (auto [a, b] : ranges) {
        Pair p = draw(Distribution::uniform, t, {n}, a, b, seed++, n % 5 + 2);
        std::vector<double> c = p.cpu.to_vector<double>(), g = p.gpu.cpu().to_vector<double>();
        int64_t diff = 0, first = -1, out_of_range = 0;
        for (size_t i = 0; i < c.size(); ++i) {
          if (ordered_bits(t, c[i]) != ordered_bits(t, g[i]) && diff++ == 0) first = int64_t(i);
          if (!(g[i] < b)) ++out_of_range;  // the clamp below b (a itself may round down)
        }
        EXPECT_EQ(diff, 0) << label(t, n, a, b) << ": first difference at " << first << ": " << g[size_t(first)]
                           << " vs CPU " << c[size_t(first)];
        EXPECT_EQ(out_of_range, 0) << label(t, n, a, b);
      }
    }
  }
}

TEST(CudaRandom, NormalWithinOneUlpOfTheCpu) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 101;
  for (DType t : kFloatTypes) {
    // f64 keeps CUDA's log/cos rounding (1-2 ulp of the double); where mean + std·z cancels that is many
    // ulps of the small result, so f64 is held to 1e-15 of the magnitude of the terms instead
    const int64_t max_ulps = t == DType::f64 ? std::numeric_limits<int64_t>::max() : 1;
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(1000003)}) {
      for (auto [mean, stddev] : {std::pair{0.0, 1.0}, std::pair{3.0, 0.5}, std::pair{-1.0, 2.0}}) {
        Pair p = draw(Distribution::normal, t, {n}, mean, stddev, seed++, n % 3 + 1);
        std::vector<double> c = p.cpu.to_vector<double>(), g = p.gpu.cpu().to_vector<double>();
        int64_t worst = 0, at = 0, differing = 0, f64_far = 0;
        for (size_t i = 0; i < c.size(); ++i) {
          int64_t d = std::llabs(ordered_bits(t, c[i]) - ordered_bits(t, g[i]));
          if (t == DType::f64 && !(std::fabs(c[i] - g[i]) <= 1e-15 * (std::fabs(mean) + std::fabs(c[i] - mean))))
            ++f64_far;
          if (d > 0) ++differing;
          if (d > worst) worst = d, at = int64_t(i);
        }
        EXPECT_LE(worst, max_ulps) << label(t, n, mean, stddev) << ": element " << at << " " << g[size_t(at)]
                                   << " vs CPU " << c[size_t(at)];
        EXPECT_EQ(f64_far, 0) << label(t, n, mean, stddev);
        // off-by-one-ulp results are rare: the double values agree to ~1e-16
        if (t != DType::f64) {
          EXPECT_LE(differing, n / 1000 + 1) << label(t, n, mean, stddev);
        }
      }
    }
  }
  // the moments are right (a broken Box-Muller pairing would still match nothing above)
  Generator g(5);
  std::vector<double> v = randn({1 << 20}, {.device = kGpu}, &g).cpu().to_vector<double>();
  double s = 0, s2 = 0;
  for (double x : v) s += x, s2 += x * x;
  double m = s / double(v.size());
  EXPECT_NEAR(m, 0.0, 5e-3);
  EXPECT_NEAR(s2 / double(v.size()) - m * m, 1.0, 5e-3);
}

TEST(CudaRandom, NonContiguousTargetsAndFactories) {
  KILN_REQUIRE_GPU();
  Generator gc(9), gg(9);
  Tensor c = empty({53, 37}).t(), g = empty({53, 37}, {.device = kGpu}).t();
  normal_(c, 0.5, 2.0, &gc);
  normal_(g, 0.5, 2.0, &gg);
  std::vector<double> cv = c.to_vector<double>(), gv = g.cpu().to_vector<double>();
  for (size_t i = 0; i < cv.size(); ++i) ASSERT_LE(std::fabs(cv[i] - gv[i]), 1e-6 * std::fabs(cv[i]) + 1e-6) << i;
  EXPECT_EQ(rand({1001}, {.dtype = DType::bf16}, &gc).to_vector<float>(),
            rand({1001}, {.dtype = DType::bf16, .device = kGpu}, &gg).cpu().to_vector<float>());
  // integer tensors are rejected, as on the CPU
  Tensor i = empty({4}, {.dtype = DType::i32, .device = kGpu});
  EXPECT_THROW(uniform_(i, 0.0, 1.0, &gg), Error);
}

TEST(CudaRandom, DropoutMaskIsTheSameOnCpuAndGpu) {
  KILN_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    for (double p : {0.1, 0.5, 0.9}) {
      Generator gc(1234), gg(1234);
      Tensor x = cast(add(rand({1000, 37}, {.dtype = DType::f64}, &gc), 0.5), t);  // nonzero everywhere
      gg.set_state(gc.state());
      Tensor xc = x.clone().requires_grad_(true), xg = x.to(kGpu).requires_grad_(true);
      Tensor yc = nn::functional::dropout(xc, p, true, &gc);
      Tensor yg = nn::functional::dropout(xg, p, true, &gg);
      // backward masks the gradient by the same draw on both devices
      Generator gd(5);
      Tensor dy = cast(rand({1000, 37}, {.dtype = DType::f64}, &gd), t);
      yc.backward(dy);
      yg.backward(dy.to(kGpu));
      EXPECT_EQ(xc.grad().to_vector<double>(), xg.grad().cpu().to_vector<double>()) << dtype_name(t) << " p=" << p;
      std::vector<double> c = yc.to_vector<double>(), g = yg.cpu().to_vector<double>();
      int64_t kept = 0, mask_diff = 0, value_diff = 0;
      for (size_t i = 0; i < c.size(); ++i) {
        kept += c[i] != 0.0;
        mask_diff += (c[i] != 0.0) != (g[i] != 0.0);
        value_diff += c[i] != g[i];
      }
      EXPECT_EQ(mask_diff, 0) << dtype_name(t) << " p=" << p;
      EXPECT_EQ(value_diff, 0) << dtype_name(t) << " p=" << p;
      EXPECT_NEAR(double(kept) / double(c.size()), 1.0 - p, 0.02) << dtype_name(t) << " p=" << p;
      EXPECT_EQ(gc.state().offset, gg.state().offset);
    }
  }
}

TEST(CudaRandom, MultinomialOnTheGpuFollowsTheWeights) {
  KILN_REQUIRE_GPU();
  const std::vector<float> w = {0.5f, 0.0f, 3.0f, 1.5f};  // 0.1, 0, 0.6, 0.3
  Generator gen(11);
  const int64_t n = 20000;
  Tensor probs = from_vector(w, {1, 4}).to(kGpu);
  Tensor draws = multinomial(probs, n, true, &gen);
  EXPECT_TRUE(draws.device().is_cuda());
  std::vector<int64_t> count(4, 0);
  for (int64_t d : draws.cpu().to_vector<int64_t>()) ++count[size_t(d)];
  EXPECT_EQ(count[1], 0);
  for (size_t j : {0u, 2u, 3u}) {
    const double p = w[j] / 5.0, sigma = std::sqrt(double(n) * p * (1 - p));
    EXPECT_NEAR(double(count[j]), double(n) * p, 4 * sigma) << j;
  }
  Tensor once = multinomial(probs, 3, false, &gen).cpu();
  std::vector<int64_t> v = once.to_vector<int64_t>();
  EXPECT_NE(v[0], v[1]);
  EXPECT_NE(v[1], v[2]);
  EXPECT_NE(v[0], v[2]);
}
