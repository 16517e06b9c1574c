// argsort / sort / topk on the GPU against the CPU: every dtype, ties, NaN, a GPT-2-sized row.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "cuda_test_util.h"

using namespace kiln;

namespace {

const Device kGpu = Device::cuda(0);

TEST(CudaSort, ArgsortMatchesTheCpuInEveryDtype) {
  KILN_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64}) {
    // rounding to a few values gives many ties, which the stable order must keep
    Tensor x = cast(mul(randn({7, 300}, {.dtype = DType::f64}), 4.0), DType::i64);
    Tensor a = cast(x, t);
    for (bool descending : {false, true})
      for (int64_t dim : {0, 1})
        EXPECT_EQ(argsort(a.to(kGpu), dim, descending).cpu().to_vector<int64_t>(),
                  argsort(a, dim, descending).to_vector<int64_t>())
            << dtype_name(t) << " dim " << dim << (descending ? " descending" : "");
  }
  Tensor with_nan = from_vector(std::vector<float>{2, NAN, -1, NAN, 5, -INFINITY}, {6});
  for (bool descending : {false, true})
    EXPECT_EQ(argsort(with_nan.to(kGpu), -1, descending).cpu().to_vector<int64_t>(),
              argsort(with_nan, -1, descending).to_vector<int64_t>());
}

TEST(CudaSort, TopKOverAVocabularyRow) {
  KILN_REQUIRE_GPU();
  Tensor logits = randn({4, 50257});
  auto [v_gpu, i_gpu] = topk(logits.to(kGpu), 200);
  auto [v_cpu, i_cpu] = topk(logits, 200);
  EXPECT_EQ(i_gpu.cpu().to_vector<int64_t>(), i_cpu.to_vector<int64_t>());
  EXPECT_EQ(v_gpu.cpu().to_vector<float>(), v_cpu.to_vector<float>());
}

}  // namespace
