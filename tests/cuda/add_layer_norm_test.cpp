// CUDA add_layer_norm (residual add + layer norm, one kernel each way under autocast) against the CPU's
// composition of add, the f32 layer norm and the autocast cast: h, y and every gradient (x, delta, w, b,
// and the folded branch bias beta), with and without delta, affine parameters and a gradient on h.
#include <kiln/autograd/node.h>
#include <kiln/core/autocast.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>

#include "cuda_compare.h"
#include "cuda_test_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

struct Inputs {
  Tensor x, delta, w, b, gh, gy, beta;
};
struct Result {
  Tensor h, y, dx, ddelta, dw, db, dbeta;
};

Result run(const Inputs& in, DType low, Device dev) {
  auto leaf = [&](const Tensor& t) {
    if (!t.defined()) return Tensor();
    Tensor l = t.to(dev).detach();
    l.requires_grad_(true);
    return l;
  };
  Tensor x = leaf(in.x), delta = leaf(in.delta), w = leaf(in.w), b = leaf(in.b), beta = leaf(in.beta);
  Tensor h, y;
  {
    amp::Autocast autocast(dev, low);
    std::tie(h, y) = F::add_layer_norm(x, delta, w, b, 1e-5, beta);
  }
  if (in.gh.defined() && delta.defined())
    autograd::run_backward({h, y}, {in.gh.to(dev), in.gy.to(dev)}, false);
  else
    autograd::run_backward({y}, {in.gy.to(dev)}, false);
  auto grad = [](const Tensor& t) { return t.defined() ? t.grad() : Tensor(); };
  return {h.detach(), y.detach(), grad(x), grad(delta), grad(w), grad(b), grad(beta)};
}

void check(int64_t M, int64_t C, DType low, bool with_delta, bool affine, bool with_gh, const std::string& what,
           bool with_beta = false) {
  Inputs in;
  in.x = add(rand_cpu({M, C}, DType::f32, 2.0), 0.5);  // a nonzero mean
  in.delta = with_delta ? rand_cpu({M, C}, low) : Tensor();
  in.w = affine ? add(rand_cpu({C}, DType::f32, 0.5), 1.0) : Tensor();
  in.b = affine ? rand_cpu({C}, DType::f32) : Tensor();
  in.gh = with_gh ? rand_cpu({M, C}, DType::f32) : Tensor();
  in.gy = rand_cpu({M, C}, low);
  in.beta = with_beta ? rand_cpu({C}, DType::f32) : Tensor();
  Result rc = run(in, low, Device::cpu()), rg = run(in, low, gpu());
  ASSERT_EQ(rg.y.dtype(), low) << what;
  ASSERT_EQ(rg.h.dtype(), DType::f32) << what;
  expect_close(rc.h, rg.h, "h " + what);
  expect_close(rc.y, rg.y, "y " + what);
  expect_close(rc.dx, rg.dx, "dx " + what, -1, 1.0);
  if (with_delta) expect_close(rc.ddelta, rg.ddelta, "ddelta " + what, -1, 1.0);
  if (affine) {
    expect_close(rc.dw, rg.dw, "dw " + what, -1, 1.0);
    expect_close(rc.db, rg.db, "db " + what, -1, 1.0);
  }
  if (with_beta) {
    ASSERT_TRUE(rg.dbeta.defined()) << what;
    expect_close(rc.dbeta, rg.dbeta, "dbeta " + what, -1, 1.0);
  }
}

}  // namespace

// The bias of the linear layer that produced delta, folded in (nn::GPT's out_proj and mlp.proj): h = x +
// (delta + beta), and beta's gradient, Σ_rows dh, from the backward kernel's own pass.
TEST(CudaAddLayerNorm, FoldedBranchBiasMatchesTheCpuComposition) {
  KILN_REQUIRE_GPU();
  manual_seed(43);
  for (DType low : {DType::bf16, DType::f16})
    for (int64_t C : {768, 4096}) {
      const std::string what = name(low) + " C=" + std::to_string(C) + " beta";
      check(301, C, low, true, true, true, what + ", affine, gh", true);
      check(37, C, low, true, false, false, what + ", no affine, no gh", true);
    }
}

TEST(CudaAddLayerNorm, TransformerWidthsMatchTheCpuComposition) {
  KILN_REQUIRE_GPU();
  manual_seed(41);
  for (DType low : {DType::bf16, DType::f16})
    for (int64_t C : {384, 768, 1024, 1536, 4096}) {
      const std::string what = name(low) + " C=" + std::to_string(C);
      check(37, C, low, true, true, true, what + " delta, affine, gh");
      check(37, C, low, true, true, false, what + " delta, affine, no gh");
      check(37, C, low, false, true, false, what + " no delta");
    }
}

TEST(CudaAddLayerNorm, PartialRowsAndNoAffineParameters) {
  KILN_REQUIRE_GPU();
  manual_seed(42);
  // C = 8 and 200: fewer chunks than lanes; 1000: a ragged last chunk column of the group; no w and b.
  for (int64_t C : {8, 200, 1000}) check(5, C, DType::bf16, true, false, true, "bf16 C=" + std::to_string(C));
  check(3000, 768, DType::bf16, true, true, true, "bf16 3000x768 (many rows per group)");
}

TEST(CudaAddLayerNorm, ShapesWithoutAKernelTakeTheComposition) {
  KILN_REQUIRE_GPU();
  manual_seed(43);
  // C = 13 is not a multiple of 8 and C = 8192 is wider than the kernel's rows: the composed ops serve.
  check(7, 13, DType::bf16, true, true, true, "bf16 C=13");
  check(3, 8192, DType::bf16, true, true, true, "bf16 C=8192");
}

TEST(CudaAddLayerNorm, ParameterGradientsAreDeterministic) {
  KILN_REQUIRE_GPU();
  manual_seed(44);
  Inputs in{add(rand_cpu({4000, 768}, DType::f32), 0.5), rand_cpu({4000, 768}, DType::bf16),
            rand_cpu({768}, DType::f32), rand_cpu({768}, DType::f32), rand_cpu({4000, 768}, DType::f32),
            rand_cpu({4000, 768}, DType::bf16), Tensor()};
  Result a = run(in, DType::bf16, gpu()), c = run(in, DType::bf16, gpu());
  EXPECT_EQ(a.dw.cpu().to_vector<float>(), c.dw.cpu().to_vector<float>());
  EXPECT_EQ(a.db.cpu().to_vector<float>(), c.db.cpu().to_vector<float>());
}

// Without delta h is x itself: x's gradient is its later readers' (here r = 3·x, recorded after the norm,
// so it reaches x first) plus the norm's, which the GPU adds into the former in place. Against the CPU's
// composition, with x a non-leaf (its gradient buffer the engine's) and a leaf.
TEST(CudaAddLayerNorm, WithoutDeltaTheNormsGradientJoinsTheReadersGradient) {
  KILN_REQUIRE_GPU();
  manual_seed(44);
  const int64_t M = 301, C = 768;
  const Tensor x = add(rand_cpu({M, C}, DType::f32, 2.0), 0.5), w = add(rand_cpu({C}, DType::f32, 0.5), 1.0),
               b = rand_cpu({C}, DType::f32), gy = rand_cpu({M, C}, DType::bf16), gr = rand_cpu({M, C}, DType::f32);
  for (bool through_mul : {true, false}) {
    auto grads = [&](Device dev) {
      Tensor xl = x.to(dev).detach().requires_grad_(true), wl = w.to(dev).detach().requires_grad_(true),
             bl = b.to(dev).detach().requires_grad_(true);
      const Tensor x2 = through_mul ? mul(xl, 1.0) : xl;
      Tensor y;
      {
        amp::Autocast autocast(dev, DType::bf16);
        y = F::add_layer_norm(x2, Tensor(), wl, bl, 1e-5).second;
      }
      const Tensor r = mul(x2, 3.0);
      autograd::run_backward({y, r}, {gy.to(dev), gr.to(dev)}, false);
      return std::vector<Tensor>{xl.grad(), wl.grad(), bl.grad()};
    };
    const std::vector<Tensor> c = grads(Device::cpu()), g = grads(gpu());
    const std::string what = through_mul ? " (x a non-leaf)" : " (x a leaf)";
    expect_close(c[0], g[0], "dx" + what, -1, 1.0);
    expect_close(c[1], g[1], "dw" + what, -1, 1.0);
    expect_close(c[2], g[2], "db" + what, -1, 1.0);
  }
}

// The parameters' gradients (w, b and the folded branch bias beta) written straight into pinned gradients
// (optim::FlatParameters, DDP's buckets) by the backward kernel: the same values as into new tensors, the
// whole of each view written over stale contents, the views still the gradients, and a second backward
// without zero_grad adding to them.
TEST(CudaAddLayerNorm, ParameterGradientsLandInPinnedGradients) {
  KILN_REQUIRE_GPU();
  manual_seed(45);
  const int64_t M = 301, C = 768;
  Inputs in{add(rand_cpu({M, C}, DType::f32, 2.0), 0.5), rand_cpu({M, C}, DType::bf16),
            add(rand_cpu({C}, DType::f32, 0.5), 1.0), rand_cpu({C}, DType::f32), Tensor(),
            rand_cpu({M, C}, DType::bf16), rand_cpu({C}, DType::f32)};
  const Result fresh = run(in, DType::bf16, gpu());

  Tensor flat = full({3 * C + 64}, 3.0, {.device = gpu()});  // stale values: a destination is written whole
  auto pinned_leaf = [&](const Tensor& values, int64_t offset) {
    Tensor p = values.to(gpu()).detach().clone().requires_grad_(true);
    p.set_pinned_grad(flat.narrow(0, offset, C));
    return p;
  };
  Tensor x = in.x.to(gpu()).detach().requires_grad_(true), delta = in.delta.to(gpu()).detach().requires_grad_(true);
  Tensor w = pinned_leaf(in.w, 0), b = pinned_leaf(in.b, C + 32), beta = pinned_leaf(in.beta, 2 * C + 64);
  for (int pass = 1; pass <= 2; ++pass) {
    if (pass == 1)
      for (const Tensor& p : {w, b, beta}) p.zero_pinned_grad();
    Tensor y;
    {
      amp::Autocast autocast(gpu(), DType::bf16);
      y = F::add_layer_norm(x, delta, w, b, 1e-5, beta).second;
    }
    autograd::run_backward({y}, {in.gy.to(gpu())}, false);
    const std::string what = "pass " + std::to_string(pass);
    EXPECT_EQ(w.grad().raw_data(), flat.raw_data()) << what;
    EXPECT_EQ(beta.grad().raw_data(), flat.narrow(0, 2 * C + 64, C).raw_data()) << what;
    expect_close(mul(fresh.dw, double(pass)), w.grad(), "dw " + what, -1, 1.0);
    expect_close(mul(fresh.db, double(pass)), b.grad(), "db " + what, -1, 1.0);
    expect_close(mul(fresh.dbeta, double(pass)), beta.grad(), "dbeta " + what, -1, 1.0);
    // nothing written past a view's end: the gaps between them keep their stale values
    for (int64_t gap : {C, 2 * C + 32})
      EXPECT_EQ(amax(abs(add(flat.narrow(0, gap, 32), -3.0))).item<double>(), 0.0) << what << ", gap at " << gap;
  }
}
