// Random-feature attention on the GPU against the CPU: output and q/k/v gradients, causal (chunked prefix
// sums, a ragged last chunk) and not, softmax and ReLU kernels, f32 and under bf16 and f16 autocast.
#include <cstdio>
#include <string>

#include <kiln/core/autocast.h>
#include <kiln/core/kernels/random_features.h>
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

// autocast: the autocast dtype (bf16 or f16), or f32 for none.
Result run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& proj, const Tensor& g, Device dev,
           bool causal, F::RandomFeatureKernel kind, DType autocast) {
  Tensor ql = q.to(dev).detach().requires_grad_(), kl = k.to(dev).detach().requires_grad_(),
         vl = v.to(dev).detach().requires_grad_();
  Tensor y;
  {
    std::optional<amp::Autocast> ac;
    if (autocast != DType::f32) ac.emplace(dev, autocast);
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
  for (DType autocast : {DType::f32, DType::bf16, DType::f16})
    for (bool causal : {false, true})
      for (auto kind : {F::RandomFeatureKernel::softmax, F::RandomFeatureKernel::relu}) {
        Tensor g = rnd({2, 4, 200, 64});
        Result rc = run(q, k, v, proj, g, Device::cpu(), causal, kind, autocast);
        Result rg = run(q, k, v, proj, g, gpu(), causal, kind, autocast);
        const std::string what =
            std::string(autocast == DType::f32 ? "f32" : std::string(dtype_name(autocast)) + " autocast") +
            (causal ? " causal" : "") + (kind == F::RandomFeatureKernel::relu ? " relu" : " softmax");
        ASSERT_EQ(rg.y.dtype(), autocast) << what;
        const double e[4] = {rel_err(rg.y, rc.y), rel_err(rg.dq, rc.dq), rel_err(rg.dk, rc.dk), rel_err(rg.dv, rc.dv)};
        std::printf("PERFORMER_ERR %-28s y=%.2e dq=%.2e dk=%.2e dv=%.2e\n", what.c_str(), e[0], e[1], e[2], e[3]);
        // f32: the GEMMs' summation order; bf16: the two devices round the features and chunk sums apart
        const double tol = autocast == DType::bf16 ? 3e-2 : autocast == DType::f16 ? 5e-3 : 1e-4;
        for (double x : e) EXPECT_LT(x, tol) << what;
      }
}

// The kernels themselves, GPU against CPU, on rows that move 16 bytes a lane (m 256, D 64, Dv 64 of 72) and
// rows that do not (m 13, D 5, Dv 7 of 9), in f32, bf16, f16 and f64: the row maxima and their first indices
// exactly (ties included: a row of equal values), the causal chunk mask exactly, the rest to the dtype's
// rounding.
TEST(CudaPerformer, KernelsMatchTheCpuOnEveryRowLayout) {
  KILN_REQUIRE_GPU();
  manual_seed(52);
  struct Shape5 {
    int64_t M, m, D, Dp, Dv;
  };
  for (const DType t : {DType::f32, DType::bf16, DType::f16, DType::f64})
    for (const Shape5& s : {Shape5{40, 256, 64, 72, 64}, Shape5{37, 13, 5, 9, 7}}) {
      const std::string what = std::string(dtype_name(t)) + " m " + std::to_string(s.m);
      const double tol = t == DType::bf16 ? 1e-2 : t == DType::f16 ? 2e-3 : t == DType::f32 ? 1e-5 : 1e-12;
      const TensorOptions on{.dtype = t}, c{.dtype = t == DType::f64 ? DType::f64 : DType::f32};
      auto on_gpu = [](TensorOptions o) {
        o.device = gpu();
        return o;
      };
      auto rand_t = [](const Shape& shape, DType dt) { return cast(randn(shape, {.dtype = DType::f64}), dt); };
      Tensor p = rand_t({s.M, s.m}, t), x = rand_t({s.M, s.D}, t);
      p.narrow(0, 3, 1).fill_(0.5);  // a tie across the whole row: index 0
      Tensor mx = empty({s.M}, c), arg = empty({s.M}, {.dtype = DType::i64}), h = empty({s.M}, c);
      Tensor gmx = empty({s.M}, on_gpu(c)), garg = empty({s.M}, {.dtype = DType::i64, .device = gpu()}),
             gh = empty({s.M}, on_gpu(c));
      kernels::feature_row_stats(p, x, 0.3, mx, arg, h);
      kernels::feature_row_stats(p.to(gpu()), x.to(gpu()), 0.3, gmx, garg, gh);
      EXPECT_EQ(gmx.cpu().to_vector<double>(), mx.to_vector<double>()) << what;
      EXPECT_EQ(garg.cpu().to_vector<int64_t>(), arg.to_vector<int64_t>()) << what;
      EXPECT_EQ(arg.to_vector<int64_t>()[3], 0) << what;
      EXPECT_LT(rel_err(gh.cpu(), h), tol) << what;
      // the queries' one-kernel form: the same row indices, features to rounding
      const Tensor yq = empty({s.M, s.m}, on), gyq = empty({s.M, s.m}, on_gpu(on));
      const Tensor aq = empty({s.M}, {.dtype = DType::i64}), gaq = empty({s.M}, {.dtype = DType::i64, .device = gpu()});
      kernels::exp_features_rowmax(p, x, 0.3, 1.7, 1e-3, yq, aq);
      kernels::exp_features_rowmax(p.to(gpu()), x.to(gpu()), 0.3, 1.7, 1e-3, gyq, gaq);
      EXPECT_EQ(gaq.cpu().to_vector<int64_t>(), arg.to_vector<int64_t>()) << what;
      EXPECT_EQ(aq.to_vector<int64_t>(), arg.to_vector<int64_t>()) << what;
      EXPECT_LT(rel_err(gyq.cpu(), yq), tol) << what;
      const Tensor r = mul(rand_t({s.M}, c.dtype), 0.1), y = empty({s.M, s.m}, on), gy = empty({s.M, s.m}, on_gpu(on));
      kernels::exp_features(p, r, 1e-3, y);
      kernels::exp_features(p.to(gpu()), r.to(gpu()), 1e-3, gy);
      EXPECT_LT(rel_err(gy.cpu(), y), tol) << what;
      const Tensor dout = rand_t({s.M, s.m}, t), dp = empty({s.M, s.m}, on), dr = empty({s.M}, c);
      const Tensor gdp = empty({s.M, s.m}, on_gpu(on)), gdr = empty({s.M}, on_gpu(c));
      kernels::exp_features_backward(dout, y, 1e-3, dp, dr);
      kernels::exp_features_backward(dout.to(gpu()), y.to(gpu()), 1e-3, gdp, gdr);
      EXPECT_LT(rel_err(gdp.cpu(), dp), tol) << what;
      EXPECT_LT(rel_err(gdr.cpu(), dr), tol) << what;
      Tensor both = rand_t({s.M, s.Dp}, t);
      both.narrow(1, s.Dv, 1).copy_(add(abs(both.narrow(1, s.Dv, 1)), 1.0));  // denominators away from 0
      const Tensor o = empty({s.M, s.Dv}, on), go = empty({s.M, s.Dv}, on_gpu(on));
      kernels::divide_by_column(both, o);
      kernels::divide_by_column(both.to(gpu()), go);
      EXPECT_LT(rel_err(go.cpu(), o), tol) << what;
      const Tensor g = rand_t({s.M, s.Dv}, t), db = full({s.M, s.Dp}, 7.0, on);
      const Tensor gdb = full({s.M, s.Dp}, 7.0, on_gpu(on));
      kernels::divide_by_column_backward(g, both, o, db);
      kernels::divide_by_column_backward(g.to(gpu()), both.to(gpu()), o.to(gpu()), gdb);
      EXPECT_LT(rel_err(gdb.cpu(), db), tol) << what;
      EXPECT_EQ(sum(abs(db.narrow(1, s.Dv + 1, s.Dp - s.Dv - 1))).item<double>(), 0.0) << what;  // padding: 0
      // the chunks' causal mask in place: the upper triangle zeroed, the rest untouched
      const Tensor sq = rand_t({3, s.m, s.m}, t), zc = sq.clone(), zg = sq.to(gpu());
      kernels::zero_above_diagonal(zc);
      kernels::zero_above_diagonal(zg);
      EXPECT_EQ(rel_err(zg.cpu(), zc), 0.0) << what;
      EXPECT_EQ(rel_err(zc, tril(sq)), 0.0) << what;
    }
}

}  // namespace
