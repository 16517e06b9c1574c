// CUDA softmax / log_softmax, forward and backward, against the CPU reference.
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "cuda_compare.h"
#include "cuda_test_util.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

// Forward and input gradient of softmax or log_softmax along `dim`, CPU vs CUDA.
void check_softmax(const Tensor& x_cpu, int64_t dim, bool log, const std::string& what) {
  Tensor g_cpu = rand_cpu(x_cpu.sizes(), x_cpu.dtype());
  Tensor xc = x_cpu.detach(), xg = x_cpu.to(gpu()).detach();
  xc.requires_grad_(true);
  xg.requires_grad_(true);
  Tensor yc = log ? log_softmax(xc, dim) : softmax(xc, dim);
  Tensor yg = log ? log_softmax(xg, dim) : softmax(xg, dim);
  expect_close(yc.detach().contiguous(), yg.detach().contiguous(), (log ? "log_softmax " : "softmax ") + what);
  yc.backward(g_cpu);
  yg.backward(g_cpu.to(gpu()));
  // the gradient is a difference of near-equal terms: compare against the scale of the tensor
  expect_close(xc.grad().contiguous(), xg.grad().contiguous(), (log ? "log_softmax grad " : "softmax grad ") + what,
               -1, 1.0);
}

const DType kFloat[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

}  // namespace

TEST(CudaSoftmax, RowsThatFitInRegisters) {
  KILN_REQUIRE_GPU();
  manual_seed(11);
  for (DType t : kFloat)
    for (Shape shape : std::vector<Shape>{{37, 64}, {33, 768}, {5, 4096}, {3, 16384}})
      for (bool log : {false, true}) check_softmax(rand_cpu(shape, t, 3.0), 1, log, name(t) + " " + shape_str(shape));
}

TEST(CudaSoftmax, OddAndVeryLongRowsStream) {
  KILN_REQUIRE_GPU();
  manual_seed(12);
  for (DType t : kFloat)
    for (Shape shape : std::vector<Shape>{{7, 10}, {9, 1001}, {3, 50304}, {2, 70001}})
      for (bool log : {false, true}) check_softmax(rand_cpu(shape, t, 3.0), 1, log, name(t) + " " + shape_str(shape));
}

TEST(CudaSoftmax, LargeInnerDimsAndViews) {
  KILN_REQUIRE_GPU();
  manual_seed(13);
  for (DType t : {DType::f32, DType::bf16}) {
    check_softmax(rand_cpu({300, 4096}, t, 2.0), 1, false, name(t) + " 300x4096 (> 1M elements)");
    check_softmax(rand_cpu({4, 1000, 13}, t), 1, true, name(t) + " dim 1 of a 3-D tensor");
    check_softmax(rand_cpu({64, 48}, t).t(), 0, false, name(t) + " transposed view");
    check_softmax(rand_cpu({1, 33}, t).expand({40, 33}), 1, true, name(t) + " broadcast view");
  }
}

TEST(CudaSoftmax, RowsSumToOneAndExtremeValues) {
  KILN_REQUIRE_GPU();
  manual_seed(14);
  Tensor x = mul(randn({64, 2000}), 40.0);  // large logits: the max subtraction must keep exp in range
  Tensor y = softmax(x.to(gpu()), 1);
  std::vector<double> s = sum(y, {1}).cpu().to_vector<double>();
  for (double v : s) EXPECT_NEAR(v, 1.0, 1e-5);
  expect_close(softmax(x, 1), y, "softmax of large logits");
}
