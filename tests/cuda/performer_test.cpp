// Random-feature attention on the GPU against the CPU: output and q/k/v gradients, causal (chunked prefix
// sums, a ragged last chunk) and not, softmax and ReLU kernels, f32 and under bf16 autocast.
#include <cstdio>
#include <string>

#include <kiln/core/autocast.h>
#include <kiln/core/ops.h>
#include <kiln/nn/functional.h>

#include "compare_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

struct Result {
  Tensor y, dq, dk, dv;
};

Result run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& proj, const Tensor& g, Device dev,
           bool causal, F::RandomFeatureKernel kind, bool autocast) {
  Tensor ql = q.to(dev).detach().requires_grad_(), kl = k.to(dev).detach().requires_grad_(),
         vl = v.to(dev).detach().requires_grad_();
  Tensor y;
  {
    std::optional<amp::Autocast> ac;
    if (autocast) ac.emplace(dev, DType::bf16);
    y = F::performer_attention(ql, kl, vl, proj.to(dev), causal, kind, 64);
  }
  y.backward(cast(g, y.dtype()).to(dev));
  return {y.detach(), ql.grad(), kl.grad(), vl.grad()};
}

TEST(CudaPerformer, MatchesCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(51);
  Tensor q = rnd({2, 4, 200, 64}), k = rnd({2, 4, 200, 64}), v = rnd({2, 4, 200, 64});  // 200: a ragged chunk
  Tensor proj = F::orthogonal_random_projection(256, 64);
  for (bool autocast : {false, true})
    for (bool causal : {false, true})
      for (auto kind : {F::RandomFeatureKernel::softmax, F::RandomFeatureKernel::relu}) {
        Tensor g = rnd({2, 4, 200, 64});
        Result rc = run(q, k, v, proj, g, Device::cpu(), causal, kind, autocast);
        Result rg = run(q, k, v, proj, g, gpu(), causal, kind, autocast);
        const std::string what = std::string(autocast ? "bf16 autocast" : "f32") + (causal ? " causal" : "") +
                                 (kind == F::RandomFeatureKernel::relu ? " relu" : " softmax");
        ASSERT_EQ(rg.y.dtype(), autocast ? DType::bf16 : DType::f32) << what;
        const double e[4] = {rel_err(rg.y, rc.y), rel_err(rg.dq, rc.dq), rel_err(rg.dk, rc.dk), rel_err(rg.dv, rc.dv)};
        std::printf("PERFORMER_ERR %-28s y=%.2e dq=%.2e dk=%.2e dv=%.2e\n", what.c_str(), e[0], e[1], e[2], e[3]);
        // f32: the GEMMs' summation order; bf16: the two devices round the features and chunk sums apart
        const double tol = autocast ? 3e-2 : 1e-4;
        for (double x : e) EXPECT_LT(x, tol) << what;
      }
}

}  // namespace
