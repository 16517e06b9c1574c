// Per-sample gradients (nn/per_sample_grad.h) equal B separate backward passes, each of sample i's share of
// the mean loss, for Linear on 2-D and 3-D inputs, Conv2d and Embedding, with and without biases; their
// sum is the batch gradient; the norm-only mode gives the same norms without materialising them.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/conv2d.h>
#include <kiln/nn/embedding.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/layer_norm.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/per_sample_grad.h>

#include "../core/core_test_util.h"

namespace kiln::nn {
namespace {

namespace F = functional;
const TensorOptions kF64{.dtype = DType::f64};
double max_abs(const Tensor& t) { return amax(abs(t)).item<double>(); }

// tokens (n, T) -> embedding -> linear over a sequence -> layer norm -> linear, loss averaged over the batch
struct SeqNet : Module {
  Embedding emb{11, 4, {.dtype = DType::f64}};
  Linear mix{4, 5, {.dtype = DType::f64}};
  LayerNorm norm{5, {.dtype = DType::f64}};
  Linear head{5, 3, {.bias = false, .dtype = DType::f64}};
  SeqNet() {
    register_module("emb", emb);
    register_module("mix", mix);
    register_module("norm", norm);
    register_module("head", head);
  }
  Tensor forward(const Tensor& tokens) override { return head(norm(tanh(mix(emb(tokens))))); }
};

struct ConvNet : Module {
  Conv2d conv{2, 3, {3, 3}, {.stride = 2, .padding = 1, .dtype = DType::f64}};
  Linear fc{3 * 3 * 3, 2, {.dtype = DType::f64}};
  ConvNet() {
    register_module("conv", conv);
    register_module("fc", fc);
  }
  Tensor forward(const Tensor& x) override { return fc(tanh(conv(x)).flatten(1)); }
};

// sample i's share of the mean loss, alone: its gradient is what grad_sample holds at i
template <class Net, class Loss>
void expect_matches_separate_passes(Net& net, const Tensor& inputs, const Loss& loss, int64_t n,
                                    const std::vector<std::string>& uncovered) {
  PerSampleGradients psg(net);
  PerSampleGradients ghost(net, {.mode = PerSampleMode::norms});
  net.zero_grad();
  loss(net(inputs), 0, n).backward();
  std::vector<std::pair<std::string, Tensor>> params;
  for (const auto& [name, p] : net.named_parameters()) params.emplace_back(name, p);
  std::vector<Tensor> samples;
  for (const auto& [name, p] : params) {
    if (name.rfind("norm.", 0) == 0) continue;  // not a hooked layer
    samples.push_back(psg.grad_sample(p));
    ASSERT_EQ(samples.back().size(0), n) << name;
    // the per-sample gradients add up to the batch gradient
    EXPECT_LT(max_abs(sub(sum(samples.back(), {0}), p.grad())), 1e-12) << name;
  }
  const Tensor norms = psg.norms(), ghost_norms = ghost.norms();
  EXPECT_LT(max_abs(sub(norms, ghost_norms)), 1e-12 * max_abs(norms));
  EXPECT_EQ(psg.uncovered(), uncovered);
  for (int64_t i = 0; i < n; ++i) {
    net.zero_grad();
    loss(net(inputs.narrow(0, i, 1)), i, n).backward();
    double sq = 0;
    size_t k = 0;
    for (const auto& [name, p] : params) {
      if (name.rfind("norm.", 0) == 0) continue;
      const Tensor mine = samples[k++].select(0, i);
      EXPECT_LT(max_abs(sub(mine, p.grad())), 1e-12) << name << " sample " << i;
      sq += sum(mul(p.grad(), p.grad())).template item<double>();
    }
    EXPECT_NEAR(norms.select(0, i).template item<double>(), std::sqrt(sq), 1e-12 * std::sqrt(sq)) << "sample " << i;
  }
}

TEST(PerSampleGradients, SequenceModelEqualsSeparatePasses) {
  manual_seed(91);
  SeqNet net;
  const int64_t n = 4;
  const Tensor tokens = randint(0, 11, {n, 6});
  tokens.narrow(1, 3, 1).copy_(tokens.narrow(1, 0, 1));  // a repeated token within each sample
  const Tensor targets = randint(0, 3, {n, 6});
  auto loss = [&](const Tensor& logits, int64_t first, int64_t total) {
    const int64_t rows = logits.size(0);
    // the batch's mean over samples (each sample's mean over its positions), restricted to `rows` samples
    return div(mul(F::cross_entropy(logits.reshape({-1, 3}), targets.narrow(0, rows == total ? 0 : first, rows).reshape({-1})),
                   double(rows)),
               double(total));
  };
  expect_matches_separate_passes(net, tokens, loss, n, {"norm"});
}

TEST(PerSampleGradients, ConvolutionEqualsSeparatePasses) {
  manual_seed(92);
  ConvNet net;
  const int64_t n = 3;
  const Tensor x = randn({n, 2, 5, 6}, kF64), y = randn({n, 2}, kF64);
  auto loss = [&](const Tensor& out, int64_t first, int64_t total) {
    const int64_t rows = out.size(0);
    return div(mul(F::mse_loss(out, y.narrow(0, rows == total ? 0 : first, rows)), double(rows)), double(total));
  };
  expect_matches_separate_passes(net, x, loss, n, {});
}

TEST(PerSampleGradients, MisuseIsAnError) {
  ConvNet net;
  PerSampleGradients ghost(net, {.mode = PerSampleMode::norms});
  EXPECT_KILN_ERROR(ghost.grad_sample(net.fc.weight), "grad_sample", "norms");
  PerSampleGradients psg(net);
  EXPECT_KILN_ERROR(psg.grad_sample(net.fc.weight), "grad_sample", "fc", "no forward");
  EXPECT_KILN_ERROR(psg.grad_sample(ones({2})), "grad_sample", "not a parameter");
  EXPECT_KILN_ERROR(psg.norms(), "norms", "no hooked layer");
}

}  // namespace
}  // namespace kiln::nn
