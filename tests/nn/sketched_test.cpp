// The sketched layers on the CPU: sketched_linear and SKConv2d against their definitions written term by
// term, finite-difference gradients in f64, unbiasedness at init over many seeds, the size check,
// checkpoints with stored and regenerated sketches, and nn::sketch on a small model.
// (GPU = CPU: tests/cuda/sketched_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/gradcheck.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/modules.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::error_message;
using testing::expect_close;

const TensorOptions f64{.dtype = DType::f64};

// 1/(2L) · Σ_i (x·S1_i·U1_i + x·U2_i·S2_i) + b, one term at a time (x 2-D or more).
Tensor sketched_reference(const Tensor& x, const Tensor& s1, const Tensor& s2, const Tensor& u1, const Tensor& u2,
                          const Tensor& b) {
  const int64_t L = s1.size(0);
  Tensor y;
  for (int64_t i = 0; i < L; ++i) {
    Tensor term = add(matmul(matmul(x, s1.select(0, i)), u1.select(0, i)), matmul(matmul(x, u2.select(0, i)), s2.select(0, i)));
    y = y.defined() ? add(y, term) : term;
  }
  y = mul(y, 1.0 / double(2 * L));
  return b.defined() ? add(y, b) : y;
}

// Every element of the mean over S seeds (running sums sum1, sum2 of the outputs and their squares) within
// 5 standard errors of `exact` (the central limit theorem, sd estimated from the same samples: a chance
// failure about 1e-4 for 30 elements), and that bound small beside the outputs, so a mis-scaled layer (the
// reference's 2x) fails.
void expect_unbiased(const Tensor& sum1, const Tensor& sum2, const Tensor& exact, int S) {
  std::vector<double> m1 = testing::values(div(sum1, double(S))), m2 = testing::values(div(sum2, double(S)));
  std::vector<double> e = testing::values(exact);
  double rms = 0, worst = 0;
  for (size_t i = 0; i < e.size(); ++i) {
    const double sd = std::sqrt(std::max(m2[i] - m1[i] * m1[i], 0.0) * S / (S - 1));
    const double bound = 5 * sd / std::sqrt(double(S));
    EXPECT_LE(std::abs(m1[i] - e[i]), bound) << "element " << i << ": mean " << m1[i] << ", exact " << e[i];
    rms += e[i] * e[i];
    worst = std::max(worst, bound);
  }
  rms = std::sqrt(rms / double(e.size()));
  EXPECT_LT(worst, 0.5 * rms) << "the bound " << worst << " is too loose to tell a 2x error in outputs of rms " << rms;
}

struct SketchCase {
  int64_t L, in, k, out;
};

TEST(SketchedLinear, MatchesItsDefinitionTermByTerm) {
  manual_seed(11);
  // L = 1 and L > 1, k <= 96 and k > 96, odd sizes: where the public reference mis-scaled.
  for (SketchCase c : {SketchCase{1, 7, 3, 5}, SketchCase{3, 9, 2, 6}, SketchCase{1, 130, 100, 110},
                       SketchCase{2, 131, 97, 67}}) {
    SCOPED_TRACE("L=" + std::to_string(c.L) + " in=" + std::to_string(c.in) + " k=" + std::to_string(c.k) +
                 " out=" + std::to_string(c.out));
    Tensor s1 = randn({c.L, c.in, c.k}, f64), s2 = randn({c.L, c.k, c.out}, f64);
    Tensor u1 = randn({c.L, c.k, c.out}, f64), u2 = randn({c.L, c.in, c.k}, f64), b = randn({c.out}, f64);
    Tensor x = randn({4, 3, c.in}, f64);  // batched (3-D)
    Tensor y = functional::sketched_linear(x, s1, s2, u1, u2, b);
    EXPECT_EQ(y.shape(), (Shape{4, 3, c.out}));
    expect_close(y, sketched_reference(x, s1, s2, u1, u2, b), 1e-9);
    // Without a bias, and from a non-contiguous input (a transposed view).
    Tensor xt = randn({c.in, 5}, f64).t();
    expect_close(functional::sketched_linear(xt, s1, s2, u1, u2), sketched_reference(xt, s1, s2, u1, u2, Tensor()), 1e-9);
  }
}

TEST(SketchedLinear, GradientsMatchFiniteDifferences) {
  manual_seed(12);
  for (SketchCase c : {SketchCase{1, 5, 2, 4}, SketchCase{3, 6, 3, 5}}) {
    Tensor x = randn({2, 3, c.in}, f64).requires_grad_(), s1 = randn({c.L, c.in, c.k}, f64).requires_grad_();
    Tensor s2 = randn({c.L, c.k, c.out}, f64).requires_grad_(), b = randn({c.out}, f64).requires_grad_();
    Tensor u1 = randn({c.L, c.k, c.out}, f64), u2 = randn({c.L, c.in, c.k}, f64);
    auto r = autograd::gradcheck(
        [&](const std::vector<Tensor>& in) { return functional::sketched_linear(in[0], in[1], in[2], u1, u2, in[3]); },
        {x, s1, s2, b});
    EXPECT_TRUE(r.ok) << r.message;
    // Only some inputs requiring grad; a non-contiguous x.
    Tensor xt = randn({c.in, 4}, f64).t().requires_grad_();
    r = autograd::gradcheck(
        [&](const std::vector<Tensor>& in) { return functional::sketched_linear(in[0], s1.detach(), in[1], u1, u2); },
        {xt, s2});
    EXPECT_TRUE(r.ok) << r.message;
  }
}

TEST(SketchedLinear, RejectsBadInput) {
  Tensor s1 = randn({1, 4, 2}), s2 = randn({1, 2, 3}), u1 = randn({1, 2, 3}), u2 = randn({1, 4, 2});
  std::string m = error_message([&] { functional::sketched_linear(randn({2, 5}), s1, s2, u1, u2); });
  EXPECT_NE(m.find("sketched_linear"), std::string::npos) << m;
  EXPECT_NE(m.find("[2, 5]"), std::string::npos) << m;
  m = error_message([&] { functional::sketched_linear(randn({2, 4}), s1, s2, randn({1, 2, 4}), u2); });
  EXPECT_NE(m.find("u1"), std::string::npos) << m;
  m = error_message([&] { functional::sketched_linear(randn({2, 4}), s1, s2, u1.clone().requires_grad_(), u2); });
  EXPECT_NE(m.find("fixed"), std::string::npos) << m;
  m = error_message([&] { functional::sketched_linear(randn({2, 4}, f64), s1, s2, u1, u2); });
  EXPECT_NE(m.find("dtype"), std::string::npos) << m;
}

TEST(SKLinear, SketchesAreScaledSignsFromTheSeed) {
  SKLinear a(64, 48, {.num_terms = 2, .low_rank = 4, .seed = 5}), b(64, 48, {.num_terms = 2, .low_rank = 4, .seed = 5});
  EXPECT_EQ(a.u1.shape(), (Shape{2, 4, 48}));
  EXPECT_EQ(a.u2.shape(), (Shape{2, 64, 4}));
  EXPECT_EQ(a.s1.shape(), (Shape{2, 64, 4}));
  EXPECT_EQ(a.s2.shape(), (Shape{2, 4, 48}));
  int64_t plus = 0;
  for (double v : testing::values(a.u2)) {
    EXPECT_DOUBLE_EQ(std::abs(v), double(float(0.5)));
    plus += v > 0;
  }
  EXPECT_GT(plus, 200);  // 512 fair signs
  EXPECT_LT(plus, 312);
  expect_close(a.u1, b.u1, 0.0);
  expect_close(a.u2, b.u2, 0.0);
  SKLinear c(64, 48, {.num_terms = 2, .low_rank = 4, .seed = 6});
  EXPECT_GT(amax(abs(sub(a.u2, c.u2))).item<double>(), 0.0);
}

TEST(SKLinear, FromLinearIsUnbiasedOverSeeds) {
  // y_s = SKLinear_s(x) from one dense layer; E_s[y_s] = x·Wᵀ + b.
  manual_seed(13);
  Linear dense(16, 10, {.dtype = DType::f64});
  Tensor x = randn({3, 16}, f64);
  const Tensor exact = dense(x).detach();
  const int S = 3000;
  Tensor sum1 = zeros({3, 10}, f64), sum2 = zeros({3, 10}, f64);
  for (int s = 0; s < S; ++s) {
    SKLinear sk(dense, {.num_terms = 1, .low_rank = 2, .seed = uint64_t(1000 + s)});
    NoGradGuard ng;
    Tensor y = sk(x);
    sum1 = add(sum1, y);
    sum2 = add(sum2, mul(y, y));
  }
  expect_unbiased(sum1, sum2, exact, S);
}

TEST(SKLinear, RefusesSizesThatSaveNothingSayingThem) {
  std::string m = error_message([] { SKLinear(32, 32, {.num_terms = 2, .low_rank = 8}); });
  EXPECT_NE(m.find("saves nothing"), std::string::npos) << m;
  EXPECT_NE(m.find("2048"), std::string::npos) << m;  // 2·2·8·64
  EXPECT_NE(m.find("1024"), std::string::npos) << m;  // 32·32
  SKLinear ok(32, 32, {.num_terms = 2, .low_rank = 8, .allow_no_savings = true});
  EXPECT_EQ(ok.num_trained_parameters(), 2 * 8 * 64 + 32);
}

TEST(SKLinear, TrainsItsSketchedFactorsAndBiasOnly) {
  SKLinear fc(40, 24, {.num_terms = 2, .low_rank = 2, .seed = 1});
  auto named = fc.named_parameters();
  ASSERT_EQ(named.size(), 3u);
  EXPECT_EQ(named[0].first, "s1");
  EXPECT_EQ(named[1].first, "s2");
  EXPECT_EQ(named[2].first, "bias");
  sum(fc(randn({4, 40}))).backward();
  EXPECT_TRUE(fc.s1.grad().defined() && fc.s2.grad().defined() && fc.bias.grad().defined());
  EXPECT_FALSE(fc.u1.grad().defined());
}

TEST(SKLinear, CheckpointsStoredOrRegeneratedSketches) {
  manual_seed(14);
  Tensor x = randn({2, 24});
  for (bool stored : {true, false}) {
    SCOPED_TRACE(stored ? "stored" : "regenerated");
    SKLinear a(24, 16, {.low_rank = 3, .seed = 21, .store_sketches = stored});
    SKLinear b(24, 16, {.low_rank = 3, .seed = 99, .store_sketches = stored});
    StateDict sd = a.state_dict();
    EXPECT_EQ(lookup(sd, "u1").defined(), stored);
    EXPECT_EQ(lookup(sd, "sketch_seed").defined(), !stored);
    b.load_state_dict(sd);
    expect_close(b.u1, a.u1, 0.0);
    expect_close(b.u2, a.u2, 0.0);
    expect_close(b(x), a(x), 0.0);
  }
}

// ---- SKConv2d ----

// conv2d(x, S1), then y[:, o] = 1/(2L) Σ_i Σ_j U1[i, j, o] z[:, i·k + j] + b[o], one output channel at a time.
Tensor skconv_reference(const Tensor& x, const Tensor& s1, const Tensor& u1, const Tensor& b,
                        const functional::Conv2dOptions& opt) {
  const Tensor z = functional::conv2d(x, s1, Tensor(), opt);
  const int64_t twoL = u1.size(0), k = u1.size(1), cout = u1.size(2);
  std::vector<Tensor> outs;
  for (int64_t o = 0; o < cout; ++o) {
    Tensor acc = zeros({z.size(0), z.size(2), z.size(3)}, {.dtype = x.dtype()});
    for (int64_t i = 0; i < twoL; ++i)
      for (int64_t j = 0; j < k; ++j)
        acc = add(acc, mul(z.select(1, i * k + j), u1.select(0, i).select(0, j).select(0, o).item<double>()));
    acc = mul(acc, 1.0 / double(twoL));
    if (b.defined()) acc = add(acc, b.select(0, o).item<double>());
    outs.push_back(acc);
  }
  return stack(outs, 1);
}

TEST(SKConv2d, MatchesItsDefinition) {
  manual_seed(15);
  Conv2d dense(3, 20, 3, {.stride = 2, .padding = 1, .dilation = 1, .dtype = DType::f64});
  SKConv2d sk(dense, {.num_terms = 2, .low_rank = 2, .seed = 3});
  EXPECT_EQ(sk.s1.shape(), (Shape{8, 3, 3, 3}));
  EXPECT_EQ(sk.u1.shape(), (Shape{4, 2, 20}));
  Tensor x = randn({2, 3, 9, 7}, f64);
  expect_close(sk(x), skconv_reference(x, sk.s1, sk.u1, sk.bias, {.stride = {2, 2}, .padding = {1, 1}}), 1e-10);
  // A (C, H, W) input is a batch of one; dilation as Conv2d.
  SKConv2d dil(3, 24, 3, {.num_terms = 1, .low_rank = 3, .dilation = 2, .bias = false, .seed = 4, .dtype = DType::f64});
  Tensor x3 = randn({3, 8, 8}, f64);
  expect_close(dil(x3), skconv_reference(x3.unsqueeze(0), dil.s1, dil.u1, Tensor(), {.dilation = {2, 2}}).squeeze(0),
               1e-10);
}

TEST(SKConv2d, GradientsMatchFiniteDifferences) {
  manual_seed(16);
  SKConv2d sk(2, 12, 3, {.num_terms = 1, .low_rank = 2, .padding = 1, .seed = 8, .dtype = DType::f64});
  Tensor x = randn({2, 2, 5, 4}, f64).requires_grad_();
  auto r = autograd::gradcheck(
      [&](const std::vector<Tensor>& in) {
        (void)in;
        return sk(in[0]);
      },
      {x});
  EXPECT_TRUE(r.ok) << r.message;
  // The trained kernel and bias: through the module's own tensors (they are the leaves).
  r = autograd::gradcheck([&](const std::vector<Tensor>&) { return sk(x.detach()); }, {sk.s1, sk.bias});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(SKConv2d, FromConv2dIsUnbiasedOverSeeds) {
  manual_seed(17);
  Conv2d dense(2, 12, 3, {.padding = 1, .dtype = DType::f64});
  Tensor x = randn({1, 2, 3, 3}, f64);
  const Tensor exact = dense(x).detach();
  const int S = 2000;
  Tensor sum1 = zeros(exact.sizes(), f64), sum2 = zeros(exact.sizes(), f64);
  for (int s = 0; s < S; ++s) {
    SKConv2d sk(dense, {.num_terms = 1, .low_rank = 2, .seed = uint64_t(5000 + s)});
    NoGradGuard ng;
    Tensor y = sk(x);
    sum1 = add(sum1, y);
    sum2 = add(sum2, mul(y, y));
  }
  expect_unbiased(sum1, sum2, exact, S);
}

TEST(SKConv2d, RefusesSizesThatSaveNothing) {
  std::string m = error_message([] { SKConv2d(8, 16, 3, {.num_terms = 1, .low_rank = 8}); });
  EXPECT_NE(m.find("saves nothing"), std::string::npos) << m;
}

// ---- nn::sketch ----

struct SmallCnn : Module {
  Conv2d conv1{1, 8, 3, {.padding = 1}}, conv2{8, 64, 3, {.padding = 1}};
  Linear fc1{64 * 4, 128}, fc2{128, 10};
  SmallCnn() {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = functional::max_pool2d(relu(conv1(x)), {});
    h = functional::max_pool2d(relu(conv2(h)), {});
    return fc2(relu(fc1(h.flatten(1))));
  }
};

TEST(Sketch, ReplacesLargeLayersInPlaceAndReports) {
  manual_seed(18);
  SmallCnn net;
  Tensor x = randn({2, 1, 8, 8});
  const int64_t before = 0 + [&] { int64_t n = 0; for (auto& p : net.parameters()) n += p.numel(); return n; }();
  SketchReport report = sketch(net, {.num_terms = 1, .low_rank = 8, .conv_low_rank = 4, .min_weight_entries = 1000,
                                     .seed = 7});
  ASSERT_EQ(report.layers.size(), 4u);
  EXPECT_EQ(report.layers[0].name, "conv1");
  EXPECT_EQ(report.layers[0].skipped, "below min_weight_entries");  // 72 entries
  EXPECT_TRUE(report.layers[1].skipped.empty()) << report.layers[1].skipped;  // conv2: 2·4·(72 + 64) < 4608
  EXPECT_TRUE(report.layers[2].skipped.empty()) << report.layers[2].skipped;  // fc1
  EXPECT_NE(report.layers[3].skipped.find("no savings"), std::string::npos) << report.layers[3].skipped;  // fc2
  EXPECT_EQ(report.num_sketched(), 2);
  EXPECT_EQ(report.parameters_before, before);
  EXPECT_LT(report.parameters_after, before);
  ASSERT_NE(net.conv2.sketched(), nullptr);
  ASSERT_NE(net.fc1.sketched(), nullptr);
  EXPECT_FALSE(net.fc1.weight.defined());
  EXPECT_TRUE(lookup(net.state_dict(), "fc1.sketch.s1").defined());
  EXPECT_FALSE(lookup(net.state_dict(), "fc1.weight").defined());
  Tensor y = net(x);
  EXPECT_EQ(y.shape(), (Shape{2, 10}));
  sum(y).backward();
  EXPECT_TRUE(net.fc1.sketched()->s1.grad().defined());
  std::ostringstream os;
  os << report;
  EXPECT_NE(os.str().find("sketched 2 of 4 layers"), std::string::npos) << os.str();
  // Sketching again leaves the sketched layers alone.
  EXPECT_EQ(sketch(net, {.min_weight_entries = 1000}).num_sketched(), 0);
}

TEST(Sketch, LeavesTiedWeightsDense) {
  GPTConfig cfg{.vocab_size = 64, .block_size = 8, .n_layer = 1, .n_head = 2, .n_embd = 32};
  GPT gpt(cfg);
  SketchReport report = sketch(gpt, {.low_rank = 4});
  int64_t mlp = 0;
  for (const auto& l : report.layers) mlp += l.skipped.empty();
  EXPECT_GE(mlp, 2);  // fc and proj of the block's MLP at least
  Tensor idx = randint(0, 64, {2, 8});
  Tensor logits = gpt(idx);
  EXPECT_EQ(logits.shape(), (Shape{2, 8, 64}));
}

}  // namespace
}  // namespace kiln::nn
