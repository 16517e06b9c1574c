// functional::gelu_mlp on the GPU (GELU_AUX_BIAS and BIAS epilogues forward; backward the DGELU_BGRAD
// GEMM for the hidden gradient and b1's gradient) against the CPU, which composes the same node from
// plain GEMMs and the elementwise GELU derivative: the output and all five gradients, for f32/bf16/f16,
// GPT-2's 768 -> 3072 -> 768 with an odd M, a 3-D input without biases, and a hidden width the aux
// matrix cannot take (not a multiple of 8: the unfused path on the GPU too).
#include <cmath>
#include <cstdio>
#include <string>

#include <kiln/core/ops.h>
#include <kiln/core/shape.h>
#include <kiln/nn/functional.h>

#include "compare_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

struct MlpResult {
  Tensor y, dx, dw1, db1, dw2, db2;
};

MlpResult run_mlp(const std::vector<Tensor>& in, const Tensor& g, Device dev) {
  std::vector<Tensor> l;
  for (const Tensor& t : in) {
    Tensor v = t.defined() ? t.to(dev).detach() : Tensor();
    if (v.defined()) v.requires_grad_(true);
    l.push_back(v);
  }
  Tensor y = F::gelu_mlp(l[0], l[1], l[2], l[3], l[4]);
  y.backward(g.to(dev));
  auto grad = [](const Tensor& t) { return t.defined() ? t.grad() : Tensor(); };
  return {y.detach(), grad(l[0]), grad(l[1]), grad(l[2]), grad(l[3]), grad(l[4])};
}

void check_mlp(const Shape& xshape, int64_t H, int64_t N, DType t, bool bias) {
  const int64_t K = xshape.back();
  std::vector<Tensor> in = {rnd(xshape, t), cast(mul(randn({H, K}), 1.0 / std::sqrt(double(K))), t),
                            bias ? rnd({H}, t) : Tensor(), cast(mul(randn({N, H}), 1.0 / std::sqrt(double(H))), t),
                            bias ? rnd({N}, t) : Tensor()};
  Shape yshape = xshape;
  yshape.back() = N;
  Tensor g = rnd(yshape, t);
  const std::string what = std::string("gelu_mlp ") + dtype_name(t) + " x" + shape_str(xshape) + " H=" +
                           std::to_string(H) + " N=" + std::to_string(N) + (bias ? " bias" : " no-bias");
  MlpResult rc = run_mlp(in, g, Device::cpu()), rg = run_mlp(in, g, gpu());
  ASSERT_EQ(rg.y.sizes(), yshape) << what;
  ASSERT_EQ(rg.y.dtype(), t) << what;
  const double tol = 2 * tol_for(t);
  const double ey = rel_err(rg.y, rc.y), ex = rel_err(rg.dx, rc.dx), ew1 = rel_err(rg.dw1, rc.dw1),
               ew2 = rel_err(rg.dw2, rc.dw2);
  const double eb1 = bias ? rel_err(rg.db1, rc.db1) : 0.0, eb2 = bias ? rel_err(rg.db2, rc.db2) : 0.0;
  std::printf("GELU_MLP_ERR %-56s y=%.2e dx=%.2e dw1=%.2e db1=%.2e dw2=%.2e db2=%.2e\n", what.c_str(), ey, ex, ew1,
              eb1, ew2, eb2);
  EXPECT_LT(ey, tol) << what << " y";
  EXPECT_LT(ex, tol) << what << " dx";
  EXPECT_LT(ew1, tol) << what << " dw1";
  EXPECT_LT(ew2, tol) << what << " dw2";
  EXPECT_LT(eb1, tol) << what << " db1";
  EXPECT_LT(eb2, tol) << what << " db2";
}

}  // namespace

TEST(CudaGeluMlp, MatchesTheCpuComposition) {
  KILN_REQUIRE_GPU();
  manual_seed(51);
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    check_mlp({411, 768}, 3072, 768, t, true);
    check_mlp({3, 13, 24}, 64, 40, t, false);
    check_mlp({37, 16}, 30, 12, t, true);  // H = 30: no aux matrix, the unfused GELU path
  }
}
