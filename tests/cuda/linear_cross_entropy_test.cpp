// linear_cross_entropy on the GPU (chunked GEMM, the one-pass in-place cross-entropy kernel for bf16, dx per
// chunk and dw accumulated in f32 by the GEMM) against the composition cross_entropy(linear(x, w)) on the
// same GPU: loss and gradients, at a GPT-2-like vocabulary where the rows take two chunks, with ignored
// targets, label smoothing and a scaled upstream gradient.
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>

#include "compare_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

struct Result {
  double loss;
  Tensor dx, dw;
};

Result run(bool fused, const Tensor& x, const Tensor& w, const Tensor& target, DType t,
           const F::CrossEntropyOptions& opt) {
  Tensor xl = cast(x, t).detach().requires_grad_(true);
  Tensor wl = w.detach().requires_grad_(true);  // an f32 master weight, cast inside as under autocast
  Tensor loss = fused ? F::linear_cross_entropy(xl, cast(wl, t), target, opt)
                      : F::cross_entropy(F::linear(xl, cast(wl, t)), target, opt);
  mul(loss, 0.25).backward();
  return {loss.item<double>(), xl.grad(), wl.grad()};
}

}  // namespace

TEST(CudaLinearCrossEntropy, MatchesTheCompositionAcrossChunks) {
  KILN_REQUIRE_GPU();
  manual_seed(71);
  // 12000 rows x 50304 classes in bf16: 1.2 GB of logits, two 1 GiB chunks (three in f32).
  const int64_t N = 12000, C = 50304, K = 64;
  for (DType t : {DType::bf16, DType::f32}) {
    Tensor x = randn({N, K}).to(gpu()), w = mul(randn({C, K}), 0.1).to(gpu());
    std::vector<int64_t> ids(static_cast<size_t>(N));
    Generator gen(5);
    for (int64_t i = 0; i < N; ++i) ids[size_t(i)] = i % 17 == 0 ? -100 : int64_t(gen.next_u32() % uint32_t(C));
    Tensor target = from_vector(ids, {N}).to(gpu());
    for (double smoothing : {0.0, 0.1}) {
      const F::CrossEntropyOptions opt{.label_smoothing = smoothing};
      Result f = run(true, x, w, target, t, opt), c = run(false, x, w, target, t, opt);
      const std::string what = std::string("linear_cross_entropy ") + dtype_name(t) + " smoothing " +
                               std::to_string(smoothing);
      EXPECT_NEAR(f.loss, c.loss, 1e-4 * std::abs(c.loss)) << what;
      ASSERT_EQ(f.dw.dtype(), DType::f32) << what;
      EXPECT_LT(rel_err(f.dx, c.dx), 2 * tol_for(t)) << what << " dx";
      EXPECT_LT(rel_err(f.dw, c.dw), 2 * tol_for(t)) << what << " dw";
    }
  }
}
