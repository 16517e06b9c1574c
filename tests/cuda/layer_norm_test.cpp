// CUDA layer norm, forward and backward (dx, dw, db), against the CPU reference.
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>

#include "cuda_compare.h"
#include "cuda_test_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

struct LnResult {
  Tensor y, dx, dw, db;
};

LnResult run_ln(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& g, Device dev) {
  auto leaf = [&](const Tensor& t) {
    if (!t.defined()) return Tensor();
    Tensor l = t.to(dev).detach();
    l.requires_grad_(true);
    return l;
  };
  Tensor xl = leaf(x), wl = leaf(w), bl = leaf(b);
  Shape ns = {x.size(-1)};
  Tensor y = F::layer_norm(xl, ns, wl, bl, 1e-5);
  y.backward(g.to(dev));
  return {y.detach(), xl.grad(), w.defined() ? wl.grad() : Tensor(), b.defined() ? bl.grad() : Tensor()};
}

void check_ln(const Shape& shape, DType t, bool affine, bool bias, const std::string& what) {
  int64_t C = shape.back();
  Tensor x = add(rand_cpu(shape, t, 2.0), 0.5);  // a nonzero mean
  Tensor w = affine ? add(rand_cpu({C}, t, 0.5), 1.0) : Tensor();
  Tensor b = bias ? rand_cpu({C}, t) : Tensor();
  Tensor g = rand_cpu(shape, t);
  LnResult rc = run_ln(x, w, b, g, Device::cpu()), rg = run_ln(x, w, b, g, gpu());
  expect_close(rc.y, rg.y, "layer_norm y " + what);
  expect_close(rc.dx, rg.dx, "layer_norm dx " + what, -1, 1.0);
  if (affine) expect_close(rc.dw, rg.dw, "layer_norm dw " + what, -1, 1.0);
  if (bias) expect_close(rc.db, rg.db, "layer_norm db " + what, -1, 1.0);
}

const DType kFloat[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

}  // namespace

TEST(CudaLayerNorm, TransformerWidths) {
  KILN_REQUIRE_GPU();
  manual_seed(21);
  for (DType t : kFloat)
    for (int64_t C : {768, 4096, 8192})
      check_ln({37, C}, t, true, true, name(t) + " C=" + std::to_string(C));
}

TEST(CudaLayerNorm, OddAndWideRowsAndOptionalParams) {
  KILN_REQUIRE_GPU();
  manual_seed(22);
  for (DType t : kFloat) {
    check_ln({65, 13}, t, true, true, name(t) + " C=13");
    check_ln({9, 1001}, t, true, false, name(t) + " C=1001 no bias");
    check_ln({5, 20000}, t, false, false, name(t) + " C=20000 no params");
    check_ln({3, 7, 96}, t, false, true, name(t) + " 3-D, bias only");
  }
}

TEST(CudaLayerNorm, LargeBatchIsDeterministic) {
  KILN_REQUIRE_GPU();
  manual_seed(23);
  for (DType t : {DType::f32, DType::bf16}) check_ln({300, 4096}, t, true, true, name(t) + " 300x4096 (> 1M elements)");
  // the dw/db column sums use no atomics: two runs agree bit for bit
  Tensor x = rand_cpu({2000, 1024}, DType::f32), w = rand_cpu({1024}, DType::f32), b = rand_cpu({1024}, DType::f32);
  Tensor g = rand_cpu({2000, 1024}, DType::f32);
  LnResult a = run_ln(x, w, b, g, gpu()), c = run_ln(x, w, b, g, gpu());
  EXPECT_EQ(a.dw.cpu().to_vector<float>(), c.dw.cpu().to_vector<float>());
  EXPECT_EQ(a.db.cpu().to_vector<float>(), c.db.cpu().to_vector<float>());
}

TEST(CudaLayerNorm, NonContiguousInput) {
  KILN_REQUIRE_GPU();
  manual_seed(24);
  Tensor base = rand_cpu({96, 40}, DType::f32);
  Tensor x = base.t();  // (40, 96) view
  Tensor w = rand_cpu({96}, DType::f32);
  Tensor yc = F::layer_norm(x, {96}, w, Tensor(), 1e-5);
  Tensor yg = F::layer_norm(x.to(gpu()).detach().t().contiguous().t(), {96}, w.to(gpu()), Tensor(), 1e-5);
  expect_close(yc, yg.contiguous(), "layer_norm of a transposed view");
}
