// The sketched layers on the GPU against the CPU: sketched_linear's output and every gradient (x, S1, S2,
// bias) in f32/bf16/f16 for L = 1 and L > 1, k <= 96 and k > 96 (where the public reference mis-scaled),
// odd sizes, 3-D and non-contiguous inputs; autocast (bf16 compute, f32 gradients); SKConv2d; and the
// seeded sketches, which must be the same numbers on both devices. Norm-relative errors are printed.
#include <cmath>
#include <cstdio>
#include <string>

#include <kiln/core/autocast.h>
#include <kiln/core/ops.h>
#include <kiln/core/shape.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/sk_conv2d.h>
#include <kiln/nn/sk_linear.h>

#include "compare_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

struct Result {
  Tensor y, dx, ds1, ds2, db;
};

Tensor leaf(const Tensor& t, Device dev) {
  Tensor l = t.to(dev).detach();
  l.requires_grad_(true);
  return l;
}

Result run(const Tensor& x, const Tensor& s1, const Tensor& s2, const Tensor& u1, const Tensor& u2, const Tensor& b,
           const Tensor& g, Device dev, bool transposed_x) {
  Tensor xl = leaf(transposed_x ? x.transpose(-1, -2).contiguous() : x, dev);
  Tensor xv = transposed_x ? xl.transpose(-1, -2) : xl;  // a non-contiguous view
  Tensor s1l = leaf(s1, dev), s2l = leaf(s2, dev), bl = leaf(b, dev);
  Tensor y = F::sketched_linear(xv, s1l, s2l, u1.to(dev), u2.to(dev), bl);
  y.backward(g.to(dev));
  Tensor dx = transposed_x ? xl.grad().transpose(-1, -2) : xl.grad();
  return {y.detach(), dx, s1l.grad(), s2l.grad(), bl.grad()};
}

struct Case {
  int64_t L, in, k, out;
  Shape lead;
  bool transposed_x;
};

void check(const Case& c, DType t) {
  const double sk = 1.0 / std::sqrt(double(c.k));
  Shape xs = c.lead;
  xs.push_back(c.in);
  Shape ys = c.lead;
  ys.push_back(c.out);
  Tensor x = rnd(xs, t), b = rnd({c.out}, t), g = rnd(ys, t);
  // Trained factors of the size a dense init gives (about W · U), sketches ±1/sqrt(k).
  Tensor s1 = cast(mul(randn({c.L, c.in, c.k}), 1.0 / std::sqrt(double(c.in))), t);
  Tensor s2 = cast(mul(randn({c.L, c.k, c.out}), 1.0 / std::sqrt(double(c.in))), t);
  Tensor u1 = cast(mul(sign(randn({c.L, c.k, c.out})), sk), t), u2 = cast(mul(sign(randn({c.L, c.in, c.k})), sk), t);
  const std::string what = std::string(dtype_name(t)) + " L=" + std::to_string(c.L) + " in=" + std::to_string(c.in) +
                           " k=" + std::to_string(c.k) + " out=" + std::to_string(c.out) + " x" + shape_str(xs) +
                           (c.transposed_x ? " (non-contiguous)" : "");
  Result rc = run(x, s1, s2, u1, u2, b, g, Device::cpu(), c.transposed_x);
  Result rg = run(x, s1, s2, u1, u2, b, g, gpu(), c.transposed_x);
  ASSERT_TRUE(rg.y.device().is_cuda());
  ASSERT_EQ(rg.y.sizes(), ys) << what;
  ASSERT_EQ(rg.y.dtype(), t) << what;
  const double e[5] = {rel_err(rg.y, rc.y), rel_err(rg.dx, rc.dx), rel_err(rg.ds1, rc.ds1), rel_err(rg.ds2, rc.ds2),
                       rel_err(rg.db, rc.db)};
  std::printf("SKETCHED_ERR %-60s y=%.2e dx=%.2e ds1=%.2e ds2=%.2e db=%.2e\n", what.c_str(), e[0], e[1], e[2], e[3], e[4]);
  const char* names[5] = {"y", "dx", "ds1", "ds2", "db"};
  for (int i = 0; i < 5; ++i) EXPECT_LT(e[i], 2 * tol_for(t)) << what << " " << names[i];
}

const Case kCases[] = {
    {1, 256, 64, 192, {33}, false},        // L = 1, k <= 96
    {1, 256, 128, 320, {2, 17}, false},    // L = 1, k > 96, 3-D
    {3, 200, 16, 96, {40}, false},         // L > 1, k <= 96
    {2, 300, 100, 260, {3, 11}, false},    // L > 1, k > 96
    {2, 131, 7, 67, {29}, true},           // odd sizes, non-contiguous x
    {1, 4096, 64, 4096, {64}, false},      // the benchmark's shape
};

TEST(CudaSketchedLinear, MatchesCpuF32) {
  KILN_REQUIRE_GPU();
  manual_seed(31);
  for (const Case& c : kCases) check(c, DType::f32);
}

TEST(CudaSketchedLinear, MatchesCpuBf16) {
  KILN_REQUIRE_GPU();
  manual_seed(32);
  for (const Case& c : kCases) check(c, DType::bf16);
}

TEST(CudaSketchedLinear, MatchesCpuF16) {
  KILN_REQUIRE_GPU();
  manual_seed(33);
  for (const Case& c : kCases) check(c, DType::f16);
}

TEST(CudaSketchedLinear, AutocastComputesInBf16WithF32Gradients) {
  KILN_REQUIRE_GPU();
  manual_seed(34);
  nn::SKLinear cpu(512, 384, {.num_terms = 2, .low_rank = 32, .seed = 9});
  nn::SKLinear dev(512, 384, {.num_terms = 2, .low_rank = 32, .seed = 9, .device = gpu()});
  dev.load_state_dict(cpu.state_dict());
  Tensor x = randn({48, 512}), g = randn({48, 384});
  Result r[2];
  for (int i = 0; i < 2; ++i) {
    nn::SKLinear& m = i == 0 ? cpu : dev;
    const Device d = i == 0 ? Device::cpu() : gpu();
    Tensor xl = leaf(x, d), y;
    {
      amp::Autocast ac(d, DType::bf16);
      y = m(xl);
    }
    EXPECT_EQ(y.dtype(), DType::bf16);
    y.backward(cast(g, DType::bf16).to(d));
    r[i] = {y.detach(), xl.grad(), m.s1.grad(), m.s2.grad(), m.bias.grad()};
    EXPECT_EQ(m.s1.grad().dtype(), DType::f32);
    EXPECT_EQ(m.bias.grad().dtype(), DType::f32);
  }
  EXPECT_LT(rel_err(r[1].y, r[0].y), 2e-2);
  EXPECT_LT(rel_err(r[1].dx, r[0].dx), 2e-2);
  EXPECT_LT(rel_err(r[1].ds1, r[0].ds1), 2e-2);
  EXPECT_LT(rel_err(r[1].ds2, r[0].ds2), 2e-2);
  EXPECT_LT(rel_err(r[1].db, r[0].db), 2e-2);
}

TEST(CudaSketchedLinear, SeededSketchesAreTheSameOnBothDevices) {
  KILN_REQUIRE_GPU();
  nn::SKLinear a(300, 200, {.num_terms = 2, .low_rank = 8, .seed = 77});
  nn::SKLinear b(300, 200, {.num_terms = 2, .low_rank = 8, .seed = 77, .device = gpu()});
  EXPECT_TRUE(same_values(a.u1, b.u1));
  EXPECT_TRUE(same_values(a.u2, b.u2));
}

TEST(CudaSKConv2d, MatchesCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(35);
  for (DType t : {DType::f32, DType::bf16}) {
    nn::SKConv2d cpu(16, 64, 3, {.num_terms = 2, .low_rank = 6, .stride = 2, .padding = 1, .seed = 4});
    nn::SKConv2d dev(16, 64, 3, {.num_terms = 2, .low_rank = 6, .stride = 2, .padding = 1, .seed = 4, .device = gpu()});
    dev.load_state_dict(cpu.state_dict());
    cpu.to(t);
    dev.to(t);
    Tensor x = rnd({3, 16, 15, 13}, t);
    Tensor xc = leaf(x, Device::cpu()), xg = leaf(x, gpu());
    Tensor yc = cpu(xc), yg = dev(xg);
    Tensor g = rnd(yc.sizes(), t);
    yc.backward(g);
    yg.backward(g.to(gpu()));
    const double e[4] = {rel_err(yg, yc), rel_err(xg.grad(), xc.grad()), rel_err(dev.s1.grad(), cpu.s1.grad()),
                         rel_err(dev.bias.grad(), cpu.bias.grad())};
    std::printf("SKCONV_ERR %s y=%.2e dx=%.2e ds1=%.2e db=%.2e\n", dtype_name(t), e[0], e[1], e[2], e[3]);
    for (double v : e) EXPECT_LT(v, 2 * tol_for(t)) << dtype_name(t);
  }
}

}  // namespace
