// Device copies and casts against the CPU: the 16-byte-vector paths (contiguous f32 <-> bf16/f16 casts,
// strided copies whose innermost runs are contiguous) and the generic kernels they fall back to, on
// lengths that are and are not multiples of the vector, aligned and misaligned views.
#include <cstring>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/reduce.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "compare_util.h"
#include "cuda_test_util.h"

using namespace kiln;
using kiln::testing::gpu;
using kiln::testing::same_values;

namespace {

const Device kGpu = Device::cuda(0);

// Equal element by element, NaN where the CPU has NaN.
void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  std::vector<double> g = got.cpu().to_vector<double>(), w = want.to_vector<double>();
  for (size_t i = 0; i < w.size(); ++i) {
    if (std::isnan(w[i])) EXPECT_TRUE(std::isnan(g[i])) << what << " at " << i;
    else ASSERT_EQ(g[i], w[i]) << what << " at " << i;
  }
}

// n values in dtype t: wide-ranging normals plus the values rounding must get right.
Tensor values(int64_t n, DType t, uint64_t seed) {
  Generator gen(seed);
  std::vector<double> v = mul(randn({n}, {.dtype = DType::f64}, &gen), 300.0).to_vector<double>();
  const double specials[] = {0.0, -0.0, 1e-40, -3e-39, 65504.0, 70000.0, -1e39, 1.00390625, 1.01171875,
                             std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                             std::numeric_limits<double>::quiet_NaN()};
  for (size_t i = 0; i < std::size(specials) && i < v.size(); ++i) v[size_t(n) - 1 - i] = specials[i];
  return cast(from_vector(v, {n}), t);
}

}  // namespace

TEST(CudaCopy, CastsBetweenFloatTypesMatchTheCpu) {
  KILN_REQUIRE_GPU();
  const std::pair<DType, DType> pairs[] = {{DType::f32, DType::bf16}, {DType::bf16, DType::f32},
                                           {DType::f32, DType::f16},  {DType::f16, DType::f32},
                                           {DType::f64, DType::bf16}, {DType::bf16, DType::f16}};
  for (auto [from, to] : pairs)
    for (int64_t n : {1, 7, 8, 9, 64, 1000003}) {
      const std::string what = std::string(dtype_name(from)) + " -> " + dtype_name(to) + " n=" + std::to_string(n);
      Tensor cpu = values(n, from, uint64_t(n));
      expect_same(cast(cpu.to(kGpu), to), cast(cpu, to), what);
      // a view one element in: not 16-byte aligned, so the element-wise kernel
      if (n > 1) {
        Tensor view = cpu.narrow(0, 1, n - 1);
        expect_same(cast(cpu.to(kGpu).narrow(0, 1, n - 1), to), cast(view, to), what + " misaligned");
      }
    }
}

TEST(CudaCopy, PermutedCopiesMatchTheCpu) {
  KILN_REQUIRE_GPU();
  for (DType t : {DType::bf16, DType::f32, DType::f64, DType::i64, DType::boolean})
    for (int64_t d : {64, 8, 16, 7}) {
      const std::string what = std::string(dtype_name(t)) + " D=" + std::to_string(d);
      Tensor cpu = cast(mul(randn({2, 5, 3, d}), 10.0), t), gpu = cpu.to(kGpu);
      // heads to the front, innermost run contiguous: the vector path where D fills whole vectors
      expect_same(gpu.permute({0, 2, 1, 3}).contiguous(), cpu.permute({0, 2, 1, 3}).contiguous(), what + " 0213");
      // innermost dim transposed: element-wise
      expect_same(gpu.transpose(2, 3).contiguous(), cpu.transpose(2, 3).contiguous(), what + " transpose");
      // a view shifted by one element: misaligned rows
      expect_same(gpu.narrow(3, 1, d - 1).contiguous(), cpu.narrow(3, 1, d - 1).contiguous(), what + " narrow");
      // copy into a strided destination
      Tensor dst = zeros({2, 3, 5, d}, {.dtype = t, .device = kGpu}).permute({0, 2, 1, 3});
      dst.copy_(gpu);
      expect_same(dst.contiguous(), cpu, what + " into a permuted view");
    }
}

// kernels::copy_matrices: many 2-D matrices at once (each its own shape, row strides, alignment: the 16-, 4-
// and 1-byte paths), more than one launch's worth, each destination equal to its source and nothing else
// written.
TEST(CudaCopy, CopyMatricesCopiesEveryPairAndNothingElse) {
  KILN_REQUIRE_GPU();
  manual_seed(31);
  std::vector<Tensor> src, dst, big;
  for (int i = 0; i < 700; ++i) {  // 700 > one launch's 512
    const DType t = i % 3 == 0 ? DType::f32 : i % 3 == 1 ? DType::bf16 : DType::f8e4m3;
    const int64_t rows = 1 + i % 7, cols = 1 + (i * 5) % 33;
    // the source a block of a wider matrix (a row stride of its own), the destination a block of another
    const Tensor a = randn({rows + 2, cols + 3}).to(t).to(gpu());
    Tensor b = zeros({rows + 1, cols + 5}, {.dtype = t, .device = gpu()});
    src.push_back(a.narrow(0, 1, rows).narrow(1, i % 3, cols));
    dst.push_back(b.narrow(0, 1, rows).narrow(1, 1 + i % 4, cols));
    big.push_back(b);
  }
  kernels::copy_matrices(src, dst);
  for (size_t i = 0; i < src.size(); ++i) {
    ASSERT_TRUE(same_values(dst[i].cpu().to(DType::f32), src[i].cpu().to(DType::f32))) << i;
    // everything around the destination block stays zero
    const Tensor around = big[i].cpu().to(DType::f32);
    EXPECT_EQ(sum(abs(around)).item<double>(), sum(abs(dst[i].cpu().to(DType::f32))).item<double>()) << i;
  }
  EXPECT_THROW(kernels::copy_matrices({src[0]}, {dst[1]}), Error);  // shapes differ
}

// copy_matrices' converting form (Shampoo::bf16's gathers): f32 blocks into bf16 blocks, the pairs path (even
// widths, aligned starts) and the element path (odd widths, offset starts), more than one launch's worth:
// bit for bit the CPU's cast (round to nearest even), nothing around a destination written; a launch that
// mixes the forms is an error.
TEST(CudaCopy, CopyMatricesIntoBf16IsTheCpusCast) {
  KILN_REQUIRE_GPU();
  manual_seed(32);
  std::vector<Tensor> src, dst, big, want;
  for (int i = 0; i < 600; ++i) {
    const int64_t rows = 1 + i % 5, cols = 2 + (i * 3) % 40;
    const Tensor a = mul(randn({rows + 2, cols + 4}), 1000.0);
    Tensor b = zeros({rows + 1, cols + 6}, {.dtype = DType::bf16, .device = gpu()});
    // the source's start 0 or 4 bytes past an 8-byte boundary (the pairs path needs 0), the destination's
    // 0 or 2 past a 4-byte one; with even widths and row strides the rest take the pairs path
    const int64_t at = i % 2;
    src.push_back(a.to(gpu()).narrow(0, 1, rows).narrow(1, at, cols));
    dst.push_back(b.narrow(0, 1, rows).narrow(1, i % 3 == 0 ? 2 : 1, cols));
    big.push_back(b);
    want.push_back(cast(a.narrow(0, 1, rows).narrow(1, at, cols), DType::bf16));
  }
  kernels::copy_matrices(src, dst);
  for (size_t i = 0; i < src.size(); ++i) {
    const Tensor got = dst[i].cpu();
    ASSERT_TRUE(same_values(got.to(DType::f32), want[i].to(DType::f32))) << i;
    EXPECT_EQ(sum(abs(big[i].cpu().to(DType::f32))).item<double>(), sum(abs(got.to(DType::f32))).item<double>()) << i;
  }
  // the CPU's converting copy_matrices too
  std::vector<Tensor> cpu_src, cpu_dst;
  for (size_t i = 0; i < 5; ++i) {
    cpu_src.push_back(src[i].cpu());
    cpu_dst.push_back(empty(src[i].sizes(), {.dtype = DType::bf16}));
  }
  kernels::copy_matrices(cpu_src, cpu_dst);
  for (size_t i = 0; i < 5; ++i) EXPECT_TRUE(same_values(cpu_dst[i].to(DType::f32), want[i].to(DType::f32))) << i;
  const Tensor f32_dst = zeros(src[1].sizes(), {.device = gpu()});
  EXPECT_THROW(kernels::copy_matrices({src[0], src[1]}, {dst[0], f32_dst}), Error);  // forms mixed
  // rounding, on both paths: ties to even (down and up), the largest f32 to inf, one below a tie, a
  // subnormal, -0, values exact in bf16
  const std::vector<uint32_t> bits{0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x7f7f7fffu,
                                   0x00000001u, 0x80000000u, 0x3f800000u, 0xc0400000u};
  std::vector<float> values(bits.size());
  std::memcpy(values.data(), bits.data(), bits.size() * 4);
  const Tensor row = from_vector(values, {1, int64_t(values.size())});
  const Tensor wide = zeros({1, int64_t(values.size()) + 1});
  wide.narrow(1, 1, int64_t(values.size())).copy_(row);
  for (const Tensor& from : {row.to(gpu()), wide.to(gpu()).narrow(1, 1, int64_t(values.size()))}) {
    Tensor to = empty({1, int64_t(values.size())}, {.dtype = DType::bf16, .device = gpu()});
    kernels::copy_matrices({from}, {to});
    const std::vector<float> got = to.cpu().to(DType::f32).to_vector<float>(),
                             expect = cast(row, DType::bf16).to(DType::f32).to_vector<float>();
    ASSERT_EQ(got.size(), expect.size());
    for (size_t j = 0; j < got.size(); ++j) {
      EXPECT_EQ(got[j], expect[j]) << "value " << j;
      EXPECT_EQ(std::signbit(got[j]), std::signbit(expect[j])) << "value " << j;
    }
    EXPECT_EQ(got[0], 1.0f);
    EXPECT_EQ(got[1], 1.015625f);
    EXPECT_TRUE(std::isinf(got[2]));
  }
}

// kernels::scale_matrices and kernels::matrix_sum_squares (Shampoo's grafting): f32 and f64 blocks of wider
// matrices (row strides, the 16-byte and element paths, empty ones), more than one launch's worth, against
// the CPU kernels; nothing around a destination written; each sum of squares against its definition in f64.
TEST(CudaCopy, ScaleMatricesAndMatrixSumSquaresMatchTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(32);
  for (DType t : {DType::f32, DType::f64}) {
    std::vector<Tensor> src, dst, big, src_cpu, dst_cpu;
    for (int i = 0; i < 600; ++i) {  // 600 > one launch's 512
      const int64_t rows = i == 5 ? 0 : 1 + (i * 13) % 70, cols = 1 + (i * 7) % 300;
      const Tensor a = randn({rows + 2, cols + 4}, {.dtype = t});
      const Tensor b = zeros({rows + 1, cols + 5}, {.dtype = t});
      src_cpu.push_back(a.narrow(0, 1, rows).narrow(1, i % 4, cols));
      dst_cpu.push_back(b.narrow(0, 1, rows).narrow(1, i % 5, cols));
      const Tensor ag = a.to(gpu());
      big.push_back(b.to(gpu()));
      src.push_back(ag.narrow(0, 1, rows).narrow(1, i % 4, cols));
      dst.push_back(big.back().narrow(0, 1, rows).narrow(1, i % 5, cols));
    }
    const Tensor scale = randn({600}, {.dtype = t});
    kernels::scale_matrices(src_cpu, dst_cpu, scale);
    kernels::scale_matrices(src, dst, scale.to(gpu()));
    Tensor sums_cpu = empty({600}, {.dtype = t}), sums = empty({600}, {.dtype = t, .device = gpu()});
    kernels::matrix_sum_squares(src_cpu, sums_cpu);
    kernels::matrix_sum_squares(src, sums);
    const std::vector<double> want = cast(sums_cpu, DType::f64).to_vector<double>(),
                              got = cast(sums.cpu(), DType::f64).to_vector<double>();
    for (size_t i = 0; i < src.size(); ++i) {
      if (dst[i].numel() > 0) {
        EXPECT_LT(amax(abs(sub(cast(dst[i].cpu(), DType::f64), cast(dst_cpu[i], DType::f64)))).item<double>(), 1e-6) << i;
      }
      EXPECT_EQ(sum(abs(big[i].cpu())).item<double>(), sum(abs(dst[i].cpu())).item<double>()) << i;  // around: 0
      const double definition = sum(square(cast(src_cpu[i], DType::f64))).item<double>();
      EXPECT_NEAR(got[i], definition, 1e-6 * definition + 1e-30) << i;
      EXPECT_NEAR(want[i], definition, 1e-6 * definition + 1e-30) << i;
    }
    EXPECT_THROW(kernels::scale_matrices({src[0]}, {dst[0]}, empty({2}, {.dtype = t, .device = gpu()})), Error);
  }
}

// kernels::matrix_sum_squares over matrices many blocks share (Shampoo's 1024 x 384 blocks; rows longer than a
// block's chunk; one column of many rows; an empty one between): each against its definition in f64, and
// the same bits on a second call (the partial sums are added in a fixed order).
TEST(CudaCopy, MatrixSumSquaresOfLargeMatricesAddsEveryChunkInAFixedOrder) {
  KILN_REQUIRE_GPU();
  manual_seed(33);
  for (DType t : {DType::f32, DType::f64}) {
    const Tensor wide = randn({1030, 400}, {.dtype = t}), long_rows = randn({3, 70001}, {.dtype = t}),
                 column = randn({70003, 1}, {.dtype = t}), none = randn({0, 7}, {.dtype = t});
    const std::vector<Tensor> cpu = {wide.narrow(0, 3, 1024).narrow(1, 8, 384), long_rows, column, none,
                                     wide.narrow(1, 1, 383)};
    std::vector<Tensor> gpu_mats;
    for (const Tensor& m : cpu) gpu_mats.push_back(m.to(gpu()));
    gpu_mats[0] = wide.to(gpu()).narrow(0, 3, 1024).narrow(1, 8, 384);  // a strided view on the GPU too
    gpu_mats[4] = wide.to(gpu()).narrow(1, 1, 383);                     // unaligned rows: the element path
    Tensor sums = empty({5}, {.dtype = t, .device = gpu()}), again = empty({5}, {.dtype = t, .device = gpu()});
    kernels::matrix_sum_squares(gpu_mats, sums);
    kernels::matrix_sum_squares(gpu_mats, again);
    const std::vector<double> got = cast(sums.cpu(), DType::f64).to_vector<double>(),
                              got_again = cast(again.cpu(), DType::f64).to_vector<double>();
    for (size_t i = 0; i < cpu.size(); ++i) {
      const double definition = sum(square(cast(cpu[i], DType::f64))).item<double>();
      EXPECT_NEAR(got[i], definition, 1e-6 * definition) << i;
      EXPECT_EQ(got[i], got_again[i]) << i;
    }
    EXPECT_EQ(got[3], 0.0);
  }
}
