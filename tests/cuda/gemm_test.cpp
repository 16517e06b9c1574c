// matmul on the GPU (cuBLASLt) against an f64 CPU reference computed from the same rounded inputs.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <kiln/core/kernels/gemm.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>
#include <kiln/nn/functional.h>

#include "compare_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

const DType kFloatTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

Tensor ref_matmul(const Tensor& a, const Tensor& b) { return matmul(a.cpu().to(DType::f64), b.cpu().to(DType::f64)); }

// An (R, C) operand: row-major, or column-major (the transpose of a contiguous (C, R)).
Tensor operand(int64_t r, int64_t c, bool col_major, DType t) { return col_major ? rnd({c, r}, t).t() : rnd({r, c}, t); }

// Restores the TF32 switch however a test ends.
struct Tf32Scope {
  bool prev = cuda::allow_tf32();
  explicit Tf32Scope(bool on) { cuda::set_allow_tf32(on); }
  ~Tf32Scope() { cuda::set_allow_tf32(prev); }
};

}  // namespace

TEST(CudaGemm, EveryDtypeAndLayoutOddSizes) {
  KILN_REQUIRE_GPU();
  manual_seed(1);
  const int64_t M = 127, K = 65, N = 33;
  for (DType t : kFloatTypes)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        Tensor a = operand(M, K, ta, t), b = operand(K, N, tb, t);
        Tensor got = matmul(a.to(gpu()), b.to(gpu()));
        ASSERT_TRUE(got.device().is_cuda());
        ASSERT_EQ(got.dtype(), t);
        EXPECT_LT(rel_err(got, ref_matmul(a, b)), tol_for(t)) << dtype_name(t) << " ta=" << ta << " tb=" << tb;
      }
}

TEST(CudaGemm, BatchedTransposedViews) {
  KILN_REQUIRE_GPU();
  manual_seed(2);
  for (DType t : kFloatTypes) {
    // a (4, 31, 17) column-major per batch, b (4, 17, 45) row-major
    Tensor a = rnd({4, 17, 31}, t).transpose(1, 2), b = rnd({4, 17, 45}, t);
    EXPECT_LT(rel_err(matmul(a.to(gpu()), b.to(gpu())), ref_matmul(a, b)), tol_for(t)) << dtype_name(t);
    Tensor bt = rnd({4, 45, 17}, t).transpose(1, 2);  // both column-major
    EXPECT_LT(rel_err(matmul(a.to(gpu()), bt.to(gpu())), ref_matmul(a, bt)), tol_for(t)) << dtype_name(t);
  }
}

// bmm_add: out += a·b on the GPU (cuBLASLt's beta = 1) equals the f64 sum of the old values and the product,
// for every dtype and both layouts of each operand, and the CPU's kernel agrees; and scaled by alpha and beta.
TEST(CudaGemm, BmmAddAccumulatesIntoTheOutput) {
  KILN_REQUIRE_GPU();
  manual_seed(3);
  for (DType t : kFloatTypes)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        Tensor a = ta ? rnd({3, 17, 31}, t).transpose(1, 2) : rnd({3, 31, 17}, t);
        Tensor b = tb ? rnd({3, 45, 17}, t).transpose(1, 2) : rnd({3, 17, 45}, t);
        const Tensor old = rnd({3, 31, 45}, t);
        const Tensor want = add(old.to(DType::f64), ref_matmul(a, b));
        Tensor got = old.to(gpu()).clone(), cpu = old.clone();
        kernels::bmm_add(a.to(gpu()), b.to(gpu()), got, 1.0, 1.0);
        kernels::bmm_add(a.contiguous(), b.contiguous(), cpu, 1.0, 1.0);
        EXPECT_LT(rel_err(got, want), tol_for(t)) << dtype_name(t) << " ta=" << ta << " tb=" << tb;
        EXPECT_LT(rel_err(cpu, want), tol_for(t)) << dtype_name(t) << " (CPU)";
        // scaled: out = β·out + α·a·b (Shampoo's factor average, β2 and 1 − β2)
        const Tensor scaled_want = add(mul(old.to(DType::f64), 0.75), mul(ref_matmul(a, b), 0.25));
        Tensor scaled = old.to(gpu()).clone(), scaled_cpu = old.clone();
        kernels::bmm_add(a.to(gpu()), b.to(gpu()), scaled, 0.25, 0.75);
        kernels::bmm_add(a.contiguous(), b.contiguous(), scaled_cpu, 0.25, 0.75);
        EXPECT_LT(rel_err(scaled, scaled_want), tol_for(t)) << dtype_name(t) << " ta=" << ta << " tb=" << tb;
        EXPECT_LT(rel_err(scaled_cpu, scaled_want), tol_for(t)) << dtype_name(t) << " (CPU)";
        // beta = 0: out's old values are not read (a NaN there does not survive), on both devices
        Tensor poisoned = full({3, 31, 45}, NAN, {.dtype = t, .device = gpu()}), poisoned_cpu = full({3, 31, 45}, NAN, {.dtype = t});
        kernels::bmm_add(a.to(gpu()), b.to(gpu()), poisoned, 0.25, 0.0);
        kernels::bmm_add(a.contiguous(), b.contiguous(), poisoned_cpu, 0.25, 0.0);
        EXPECT_LT(rel_err(poisoned, mul(ref_matmul(a, b), 0.25)), tol_for(t)) << dtype_name(t) << " beta 0";
        EXPECT_LT(rel_err(poisoned_cpu, mul(ref_matmul(a, b), 0.25)), tol_for(t)) << dtype_name(t) << " beta 0 (CPU)";
      }
}

// bmm_add with bf16/f16 operands into an f32 out (Shampoo's bf16 statistics): the product of the 16-bit values
// accumulated in f32 and added to out without rounding to 16 bits; the CPU's kernel agrees
TEST(CudaGemm, BmmAddOfHalfOperandsIntoF32) {
  KILN_REQUIRE_GPU();
  manual_seed(4);
  for (DType t : {DType::bf16, DType::f16})
    for (bool tb : {false, true}) {
      const Tensor a = rnd({2, 33, 130}, t);
      const Tensor b = tb ? rnd({2, 70, 130}, t).transpose(1, 2) : rnd({2, 130, 70}, t);
      const Tensor old = rnd({2, 33, 70}, DType::f32);
      const Tensor want = add(mul(old.to(DType::f64), 0.5), mul(ref_matmul(a, b), 2.0));
      Tensor got = old.to(gpu()).clone(), cpu = old.clone();
      kernels::bmm_add(a.to(gpu()), b.to(gpu()), got, 2.0, 0.5);
      kernels::bmm_add(a, b.contiguous(), cpu, 2.0, 0.5);
      EXPECT_EQ(got.dtype(), DType::f32);
      // f32 accumulation of exact 16-bit products: f32's tolerance, not the 16-bit dtype's
      EXPECT_LT(rel_err(got, want), 1e-5) << dtype_name(t) << " tb=" << tb;
      EXPECT_LT(rel_err(cpu, want), 1e-6) << dtype_name(t) << " (CPU)";
    }
}

TEST(CudaGemm, BroadcastBatches) {
  KILN_REQUIRE_GPU();
  manual_seed(3);
  for (DType t : kFloatTypes) {
    // (2, 1, M, K) · (3, K, N) -> (2, 3, M, N)
    Tensor a = rnd({2, 1, 19, 23}, t), b = rnd({3, 23, 11}, t);
    Tensor got = matmul(a.to(gpu()), b.to(gpu()));
    EXPECT_EQ(got.sizes(), (Shape{2, 3, 19, 11}));
    EXPECT_LT(rel_err(got, ref_matmul(a, b)), tol_for(t)) << dtype_name(t);
    // a 2-D operand shared by every batch reaches the kernel with batch stride 0 (also transposed)
    Tensor w = rnd({19, 23}, t);
    EXPECT_LT(rel_err(matmul(w.to(gpu()), b.to(gpu())), ref_matmul(w, b)), tol_for(t)) << dtype_name(t);
    Tensor wt = rnd({23, 19}, t).t();
    EXPECT_LT(rel_err(matmul(wt.to(gpu()), b.to(gpu())), ref_matmul(wt, b)), tol_for(t)) << dtype_name(t);
    // batch stride 0 on the right: (3, M, K) · (K, N) expanded
    Tensor x = rnd({3, 19, 23}, t), v = rnd({23, 11}, t);
    Tensor vb = v.to(gpu()).unsqueeze(0).expand({3, 23, 11});
    EXPECT_LT(rel_err(matmul(x.to(gpu()), vb), ref_matmul(x, v.unsqueeze(0).expand({3, 23, 11}))), tol_for(t));
  }
}

TEST(CudaGemm, StridedMisalignedAndDegenerateShapes) {
  KILN_REQUIRE_GPU();
  manual_seed(4);
  for (DType t : kFloatTypes) {
    // row stride larger than the row (a column slice) and a data pointer one element past an aligned one
    Tensor big = rnd({40, 70}, t);
    Tensor a = big.slice(1, 1, 34), b = rnd({33, 21}, t).slice(0, 0, 33);
    Tensor big_d = big.to(gpu());
    EXPECT_LT(rel_err(matmul(big_d.slice(1, 1, 34), b.to(gpu())), ref_matmul(a, b)), tol_for(t)) << dtype_name(t);
    // vector · matrix, matrix · vector, vector · vector
    Tensor v = rnd({33}, t), m = rnd({33, 7}, t), u = rnd({40, 33}, t);
    EXPECT_LT(rel_err(matmul(v.to(gpu()), m.to(gpu())), ref_matmul(v, m)), tol_for(t));
    EXPECT_LT(rel_err(matmul(u.to(gpu()), v.to(gpu())), ref_matmul(u, v)), tol_for(t));
    EXPECT_LT(rel_err(matmul(v.to(gpu()), v.to(gpu())), ref_matmul(v, v)), tol_for(t));
    // K = 0: zeros, even into memory that held other values
    Tensor z = matmul(empty({5, 0}, {.dtype = t, .device = gpu()}), empty({0, 6}, {.dtype = t, .device = gpu()}));
    EXPECT_TRUE(same_values(z, zeros({5, 6}, {.dtype = t})));
    // M = 0
    EXPECT_EQ(matmul(empty({0, 4}, {.dtype = t, .device = gpu()}), rnd({4, 3}, t).to(gpu())).sizes(), (Shape{0, 3}));
  }
}

TEST(CudaGemm, RepeatedShapesReuseThePlanAndAgreeBitwise) {
  KILN_REQUIRE_GPU();
  manual_seed(5);
  Tensor a = rnd({64, 96}, DType::bf16).to(gpu()), b = rnd({96, 80}, DType::bf16).to(gpu());
  Tensor first = matmul(a, b);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_values(matmul(a, b), first));
}

TEST(CudaGemm, Large1024CubedBf16AgainstCpuF32) {
  KILN_REQUIRE_GPU();
  manual_seed(6);
  Tensor a = rnd({1024, 1024}, DType::bf16), b = rnd({1024, 1024}, DType::bf16);
  Tensor want = matmul(a.to(DType::f32), b.to(DType::f32));  // CPU f32 on exactly the bf16 inputs
  Tensor got = matmul(a.to(gpu()), b.to(gpu()));
  double e = rel_err(got, want);
  EXPECT_LT(e, 5e-3);  // one bf16 rounding of the output: ~2^-9 / sqrt(3) relative
  EXPECT_GT(e, 0.0);   // and the output really is bf16
}

TEST(CudaGemm, Tf32OffIsF32AccurateAndOnIsNot) {
  KILN_REQUIRE_GPU();
  manual_seed(7);
  Tensor a = rnd({512, 512}), b = rnd({512, 512});
  Tensor want = ref_matmul(a, b);
  {
    Tf32Scope off(false);
    EXPECT_FALSE(cuda::allow_tf32());
    EXPECT_LT(rel_err(matmul(a.to(gpu()), b.to(gpu())), want), 1e-5);
  }
  {
    Tf32Scope on(true);
    EXPECT_TRUE(cuda::allow_tf32());
    double e = rel_err(matmul(a.to(gpu()), b.to(gpu())), want);
    EXPECT_LT(e, 5e-3);  // TF32: 10-bit mantissa products
    EXPECT_GT(e, 1e-5);  // the switch took effect
  }
}

// A carve-out plans the matmul for fewer SMs (a different cuBLASLt plan); the product is the same within the
// dtype's tolerance, and the switch goes back to 0.
TEST(CudaGemm, SmCarveoutKeepsTheProductAndRestores) {
  KILN_REQUIRE_GPU();
  manual_seed(8);
  EXPECT_EQ(cuda::sm_carveout(), 0);
  Tensor a = rnd({768, 1024}, DType::bf16), b = rnd({1024, 3072}, DType::bf16);
  Tensor want = matmul(a.to(DType::f32), b.to(DType::f32));
  const int sms = cuda::properties(0).multiprocessors;
  for (int carve : {1, 16, sms - 1, sms + 5}) {  // past the SM count: planned for one SM
    cuda::set_sm_carveout(carve);
    EXPECT_EQ(cuda::sm_carveout(), carve);
    EXPECT_LT(rel_err(matmul(a.to(gpu()), b.to(gpu())), want), 5e-3) << "carve-out " << carve;
  }
  cuda::set_sm_carveout(0);
  EXPECT_EQ(cuda::sm_carveout(), 0);
  EXPECT_THROW(cuda::set_sm_carveout(-1), Error);
}

// set_matmul_benchmark: a new plan of >= 2^30 FLOPs times the heuristic's candidates on the call's own
// operands. The product stays right, an accumulating call's old output is restored before the real launch
// (else the timing launches would have added into it), the fused GELU epilogue and its aux output stay right,
// and a plan first made inside a graph capture keeps the heuristic's choice without synchronizing.
TEST(CudaGemm, MatmulBenchmarkKeepsTheProductAndAccumulation) {
  KILN_REQUIRE_GPU();
  manual_seed(9);
  struct Scope {
    bool prev = cuda::matmul_benchmark();
    ~Scope() { cuda::set_matmul_benchmark(prev); }
  } scope;
  cuda::set_matmul_benchmark(true);
  EXPECT_TRUE(cuda::matmul_benchmark());
  // shapes no other test uses, so that each call makes a new plan; 2·M·N·K >= 2^30
  for (DType t : {DType::bf16, DType::f32}) {
    const int64_t M = t == DType::bf16 ? 1040 : 1048, K = 520, N = 1032;
    Tensor a = rnd({M, K}, t), b = rnd({K, N}, t);
    const size_t before = cuda::matmul_plans_benchmarked();
    EXPECT_LT(rel_err(matmul(a.to(gpu()), b.to(gpu())), ref_matmul(a, b)), tol_for(t)) << dtype_name(t);
    EXPECT_EQ(cuda::matmul_plans_benchmarked(), before + 1) << dtype_name(t);
    // accumulating: out = old + a·b, once (a new plan: another N)
    Tensor b2 = rnd({1, K, N + 8}, t), a2 = a.unsqueeze(0);
    const Tensor old = rnd({1, M, N + 8}, t);
    Tensor got = old.to(gpu()).clone();
    kernels::bmm_add(a2.to(gpu()), b2.to(gpu()), got, 1.0, 1.0);
    EXPECT_LT(rel_err(got, add(old.to(DType::f64), ref_matmul(a2, b2))), tol_for(t)) << dtype_name(t) << " bmm_add";
    EXPECT_EQ(cuda::matmul_plans_benchmarked(), before + 2) << dtype_name(t);
    // the same shape again: the plan is reused, not timed again
    Tensor again = old.to(gpu()).clone();
    kernels::bmm_add(a2.to(gpu()), b2.to(gpu()), again, 1.0, 1.0);
    EXPECT_EQ(rel_err(again, got), 0.0) << dtype_name(t);
    EXPECT_EQ(cuda::matmul_plans_benchmarked(), before + 2) << dtype_name(t);
  }
  // linear + GELU (the GELU_AUX_BIAS epilogue, whose aux output backward reads) and f32 linear with a bias
  // gradient (BGRADB on the dw product: an output of its own), forward and backward against the CPU's f64,
  // each product a new plan that is timed
  for (bool gelu : {true, false}) {
    const DType t = gelu ? DType::bf16 : DType::f32;
    const int64_t M = gelu ? 2056 : 2064, N = gelu ? 3072 : 1536, K = 768;
    Tensor x = rnd({M, K}, t), w = rnd({N, K}, t), bias = rnd({N}, t), dy = rnd({M, N}, t);
    auto run = [&](const Device& d, DType as) {
      Tensor xv = x.to(as).to(d).requires_grad_(true), wv = w.to(as).to(d).requires_grad_(true),
             bv = bias.to(as).to(d).requires_grad_(true);
      Tensor y = gelu ? F::linear_gelu(xv, wv, bv) : F::linear(xv, wv, bv);
      y.backward(dy.to(as).to(d));
      return std::vector<Tensor>{y.detach(), xv.grad(), wv.grad(), bv.grad()};
    };
    const size_t before = cuda::matmul_plans_benchmarked();
    const std::vector<Tensor> got = run(gpu(), t), want = run(Device::cpu(), DType::f64);
    EXPECT_EQ(cuda::matmul_plans_benchmarked(), before + 3) << "forward, dx, dw (gelu " << gelu << ")";
    const char* names[] = {"y", "dx", "dw", "db"};
    for (size_t i = 0; i < 4; ++i)
      EXPECT_LT(rel_err(got[i], want[i]), gelu ? 2e-2 : 1e-5) << names[i] << " (gelu " << gelu << ")";
  }
  // inside a capture: no timing (it would synchronize), the heuristic's algorithm, the right product
  {
    Tensor a = rnd({1064, 520}, DType::bf16).to(gpu()), b = rnd({520, 1032}, DType::bf16).to(gpu());
    const size_t before = cuda::matmul_plans_benchmarked();
    Tensor out;
    cuda::Graph graph = cuda::capture([&] { out = matmul(a, b); }, /*warmup=*/0);
    graph.replay();
    EXPECT_LT(rel_err(out, ref_matmul(a, b)), tol_for(DType::bf16));
    EXPECT_EQ(cuda::matmul_plans_benchmarked(), before);
  }
}

TEST(CudaGemm, GradientsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(8);
  for (DType t : kFloatTypes) {
    for (bool batched : {false, true}) {
      Shape sa = batched ? Shape{3, 21, 13} : Shape{21, 13}, sb = batched ? Shape{3, 13, 9} : Shape{13, 9};
      Shape so = batched ? Shape{3, 21, 9} : Shape{21, 9};
      Tensor a = rnd(sa, t), b = rnd(sb, t), g = rnd(so, t);
      Tensor ac = a.detach().requires_grad_(), bc = b.detach().requires_grad_();
      Tensor ad = a.to(gpu()).requires_grad_(), bd = b.to(gpu()).requires_grad_();
      matmul(ac, bc).backward(g);
      Tensor yd = matmul(ad, bd);
      yd.backward(g.to(gpu()));
      ASSERT_TRUE(ad.grad().defined() && bd.grad().defined());
      EXPECT_TRUE(ad.grad().device().is_cuda());
      EXPECT_LT(rel_err(ad.grad(), ac.grad()), 2 * tol_for(t)) << dtype_name(t) << " batched=" << batched;
      EXPECT_LT(rel_err(bd.grad(), bc.grad()), 2 * tol_for(t)) << dtype_name(t) << " batched=" << batched;
    }
  }
}

// kernels::gemm: alpha · a · b + bias in one cuBLASLt call, against the CPU kernel: each dtype, an f32
// result from bf16/f16 operands, transposed (column-major) operands, with and without a bias, odd sizes.
TEST(CudaGemm, ScaledWithBiasMatchesTheCpuKernel) {
  KILN_REQUIRE_GPU();
  manual_seed(41);
  struct Types {
    DType in, out;
  };
  for (Types ty : {Types{DType::f32, DType::f32}, Types{DType::bf16, DType::bf16}, Types{DType::f16, DType::f16},
                   Types{DType::bf16, DType::f32}, Types{DType::f64, DType::f64}})
    for (bool transposed : {false, true})
      for (bool with_bias : {false, true}) {
        const int64_t M = 37, K = 130, N = 72;
        Tensor a = rnd({M, K}, ty.in), b = transposed ? rnd({N, K}, ty.in).t() : rnd({K, N}, ty.in);
        Tensor bias = with_bias ? rnd({N}, ty.out) : Tensor();
        Tensor want = empty({M, N}, {.dtype = ty.out}), got = empty({M, N}, {.dtype = ty.out, .device = gpu()});
        kernels::gemm(a, b, 0.375, bias, want);
        kernels::gemm(a.to(gpu()), b.to(gpu()), 0.375, with_bias ? bias.to(gpu()) : Tensor(), got);
        const double e = rel_err(got, want);
        EXPECT_LT(e, 2 * tol_for(ty.in)) << dtype_name(ty.in) << " -> " << dtype_name(ty.out)
                                         << (transposed ? " b^T" : "") << (with_bias ? " bias" : "");
      }
}

TEST(CudaGemm, BadInputsAreErrors) {
  KILN_REQUIRE_GPU();
  Tensor a = rnd({4, 5}).to(gpu());
  EXPECT_THROW(matmul(a, rnd({6, 3}).to(gpu())), Error);  // inner dims differ
  EXPECT_THROW(matmul(a, rnd({5, 3})), Error);             // CPU and CUDA operands
  Tensor i = empty({4, 5}, {.dtype = DType::i32, .device = gpu()});
  EXPECT_THROW(matmul(i, i.t()), Error);  // integer matmul is not supported
}

// Timing, not a check: run with --gtest_also_run_disabled_tests --gtest_filter=*CudaGemmPerf*. Median of
// 10 calls after 3 warm-ups, each synchronized (host clock; the per-call sync adds microseconds to a
// milliseconds-long product), and the mean of 10 back-to-back calls.
TEST(CudaGemmPerf, DISABLED_Bf16) {
  KILN_REQUIRE_GPU();
  manual_seed(0);
  struct Shape3 {
    const char* name;
    int64_t m, k, n;
    bool linear;  // b given as the transpose of an (n, k) weight, as nn::Linear does
  };
  for (Shape3 s : {Shape3{"bf16_8192^3", 8192, 8192, 8192, false}, Shape3{"bf16_8192x768->3072", 8192, 768, 3072, true}}) {
    Tensor a = rnd({s.m, s.k}, DType::bf16).to(gpu());
    Tensor b = s.linear ? rnd({s.n, s.k}, DType::bf16).to(gpu()).t() : rnd({s.k, s.n}, DType::bf16).to(gpu());
    double flops = 2.0 * double(s.m) * double(s.k) * double(s.n);
    for (int i = 0; i < 3; ++i) matmul(a, b);
    cuda::synchronize();
    std::vector<double> ms;
    for (int i = 0; i < 10; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      matmul(a, b);
      cuda::synchronize();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) matmul(a, b);
    cuda::synchronize();
    double mean = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 10;
    std::printf("KILN %s host_sync_median_ms=%.4f (%.1f TFLOP/s) back_to_back_mean_ms=%.4f (%.1f TFLOP/s)\n", s.name,
                ms[5], flops / ms[5] / 1e9, mean, flops / mean / 1e9);
  }
}
