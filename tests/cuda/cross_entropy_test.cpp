// CUDA fused cross-entropy (label smoothing, ignore_index), forward and backward, against the CPU.
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>

#include <kiln/cuda/runtime.h>

#include "cuda_compare.h"
#include "cuda_test_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

// Targets in [0, C) with about one in eight set to ignore_index.
Tensor targets(const Shape& shape, int64_t C, int64_t ignore_index) {
  Tensor t = randint(0, C, shape);
  int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); i += 8) p[i] = ignore_index;
  return t;
}

void check_ce(const Shape& shape, DType dt, double smoothing, const std::string& what, double scale = 3.0) {
  int64_t C = shape[1];
  Shape tshape = shape;
  tshape.erase(tshape.begin() + 1);
  Tensor logits = rand_cpu(shape, dt, scale);
  Tensor target = targets(tshape, C, -100);
  Tensor g = rand_cpu(tshape, dt == DType::f64 ? DType::f64 : DType::f32);  // the per-row loss dtype
  F::CrossEntropyOptions opt{.ignore_index = -100, .label_smoothing = smoothing, .reduction = F::Reduction::none};
  Tensor lc = logits.detach(), lg = logits.to(gpu()).detach();
  lc.requires_grad_(true);
  lg.requires_grad_(true);
  Tensor loss_c = F::cross_entropy(lc, target, opt), loss_g = F::cross_entropy(lg, target.to(gpu()), opt);
  // per-row loss is in the stat dtype: f32 math on both sides for f16/bf16 inputs
  double rtol = dt == DType::f64 ? 1e-12 : 1e-5;
  expect_close(loss_c.detach(), loss_g.detach(), "cross_entropy loss " + what, rtol, 1.0);
  loss_c.backward(g);
  loss_g.backward(g.to(gpu()));
  expect_close(lc.grad().contiguous(), lg.grad().contiguous(), "cross_entropy grad " + what, -1, 1.0);
  // ignored rows: zero loss and zero gradient
  std::vector<double> lv = loss_g.cpu().reshape({-1}).to_vector<double>();
  for (size_t i = 0; i < lv.size(); i += 8) EXPECT_EQ(lv[i], 0.0) << what;
}

const DType kFloat[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

}  // namespace

TEST(CudaCrossEntropy, SmallAndVocabularySizedRows) {
  KILN_REQUIRE_GPU();
  manual_seed(31);
  for (DType t : kFloat)
    for (Shape shape : std::vector<Shape>{{64, 10}, {33, 1001}, {8, 50304}, {5, 50257}})
      for (double eps : {0.0, 0.1})
        check_ce(shape, t, eps, name(t) + " " + shape_str(shape) + " eps=" + std::to_string(eps));
}

TEST(CudaCrossEntropy, LargeBatchAndSpatialTargets) {
  KILN_REQUIRE_GPU();
  manual_seed(32);
  for (DType t : {DType::f32, DType::bf16}) {
    check_ce({300, 5000}, t, 0.0, name(t) + " 300x5000 (> 1M elements)");
    check_ce({4, 7, 5, 3}, t, 0.2, name(t) + " (N, C, d1, d2)");
    check_ce({16, 32000}, t, 0.0, name(t) + " large logits", 30.0);
  }
}

TEST(CudaCrossEntropy, ReductionsMatch) {
  KILN_REQUIRE_GPU();
  manual_seed(33);
  Tensor logits = randn({50, 300}), target = targets({50}, 300, -100);
  F::CrossEntropyOptions opt{.reduction = F::Reduction::sum};
  Tensor a = F::cross_entropy(logits, target, opt), b = F::cross_entropy(logits.to(gpu()), target.to(gpu()), opt);
  EXPECT_NEAR(a.item<double>(), b.cpu().item<double>(), 1e-5 * std::abs(a.item<double>()));
}

TEST(CudaCrossEntropy, OutOfRangeTargetIsAnError) {
  KILN_REQUIRE_GPU();
  Tensor logits = randn({6, 11}).to(gpu());
  for (int64_t bad : {11, -1, 1000}) {
    Tensor target = from_vector<int64_t>({0, 1, 2, bad, 4, -100}, {6}).to(gpu());
    F::CrossEntropyOptions opt{.reduction = F::Reduction::none};
    // reported at the next synchronization (here the copy to the host), not at the launch
    EXPECT_THROW(F::cross_entropy(logits, target, opt).cpu(), Error) << bad;
  }
  // the device is still usable afterwards
  Tensor ok = F::cross_entropy(logits, from_vector<int64_t>({0, 1, 2, 3, 4, -100}, {6}).to(gpu()),
                               {.reduction = F::Reduction::none});
  EXPECT_EQ(ok.cpu().to_vector<float>().size(), 6u);
}

TEST(CudaCrossEntropy, OutOfRangeTargetOnTheVocabularyPath) {
  KILN_REQUIRE_GPU();
  // C = 16384: the ring-fed kernel; the bad target is reported by cuda::synchronize() and then cleared
  Tensor logits = randn({4, 16384}).to(gpu());
  Tensor target = from_vector<int64_t>({0, 16384, 2, 3}, {4}).to(gpu());
  Tensor loss = F::cross_entropy(logits, target, {.reduction = F::Reduction::none});
  try {
    cuda::synchronize();
    ADD_FAILURE() << "expected a deferred error";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("cross_entropy"), std::string::npos) << what;
    EXPECT_NE(what.find("16384"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(cuda::synchronize());
}

// Logits masked with -inf (not the target's): without smoothing the loss is finite, as on the CPU and in
// PyTorch (a 0 * (-inf) in the smoothing term made the CPU loss NaN, and the small-row kernel summed
// e^(-inf - (-inf)) = NaN in threads that saw only masked logits); with smoothing it is +inf on both
// sides, as in PyTorch. Small rows and vocabulary-sized rows (different kernels), f32 and bf16.
TEST(CudaCrossEntropy, MinusInfinityMaskedLogitsGiveFiniteLosses) {
  KILN_REQUIRE_GPU();
  for (double smoothing : {0.0, 0.1})
  for (int64_t C : {3, 50304})
    for (DType dt : {DType::f32, DType::bf16}) {
      const int64_t N = 16;
      Tensor logits = rand_cpu({N, C}, DType::f32, 3.0);
      Tensor target = randint(0, C, {N});
      float* x = logits.data_ptr<float>();
      const int64_t* t = target.data_ptr<int64_t>();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = n % 3; c < C; c += 3)
          if (c != t[n]) x[n * C + c] = -INFINITY;
      Tensor lc = logits.to(dt), lg = lc.to(gpu());
      F::CrossEntropyOptions opt{.label_smoothing = smoothing, .reduction = F::Reduction::none};
      Tensor loss_c = F::cross_entropy(lc, target, opt), loss_g = F::cross_entropy(lg, target.to(gpu()), opt);
      const std::string what = "masked cross_entropy C=" + std::to_string(C) + " smoothing " + std::to_string(smoothing);
      if (smoothing == 0) {
        EXPECT_TRUE(all_true(isfinite(loss_c))) << "CPU " << what;
        EXPECT_TRUE(all_true(isfinite(loss_g.cpu()))) << "GPU " << what;
      }
      expect_close(loss_c, loss_g, what, 1e-5, 1.0);
    }
}
