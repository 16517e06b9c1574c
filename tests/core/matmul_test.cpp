// matmul against a naive triple loop: 2-D, batched with broadcasting, vector cases, strided and
// broadcast (stride 0) operands, and every float dtype.
#include <gtest/gtest.h>

#include <kiln/core/kernels/gemm.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "core_test_util.h"

using namespace kiln;
using kiln::test::AllClose;

namespace {

// Naive batched matmul of row-major data: a (B, M, K), b (B, K, N); batch index bi maps to
// (ai, bj) through the given functions.
std::vector<double> naive_bmm(const std::vector<double>& a, const std::vector<double>& b, int64_t B, int64_t M, int64_t K,
                              int64_t N, const std::function<int64_t(int64_t)>& a_batch,
                              const std::function<int64_t(int64_t)>& b_batch) {
  std::vector<double> out(size_t(B * M * N), 0.0);
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k)
          s += a[size_t(a_batch(bi) * M * K + i * K + k)] * b[size_t(b_batch(bi) * K * N + k * N + j)];
        out[size_t(bi * M * N + i * N + j)] = s;
      }
  return out;
}

std::function<int64_t(int64_t)> same() { return [](int64_t b) { return b; }; }
std::function<int64_t(int64_t)> zero() { return [](int64_t) { return int64_t(0); }; }

Tensor rnd(const Shape& s, uint64_t seed, DType t = DType::f64) {
  Generator g(seed);
  return randn(s, {.dtype = DType::f64}, &g).to(t);
}

double mm_tol(DType t, int64_t K) {
  switch (t) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-5 * double(K);
    case DType::f16: return 2e-3 * double(K);
    default: return 1.5e-2 * double(K);
  }
}

}  // namespace

TEST(Matmul, TwoDimensionalAllDtypes) {
  for (DType t : {DType::f64, DType::f32, DType::f16, DType::bf16}) {
    Tensor a = rnd({5, 7}, 1, t), b = rnd({7, 3}, 2, t);
    Tensor c = matmul(a, b);
    EXPECT_EQ(c.dtype(), t);
    EXPECT_EQ(c.sizes(), (Shape{5, 3}));
    auto want = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 1, 5, 7, 3, same(), same());
    EXPECT_TRUE(AllClose(c.to_vector<double>(), want, mm_tol(t, 7), mm_tol(t, 1))) << dtype_name(t);
  }
}

TEST(Matmul, SmallKnownProduct) {
  Tensor a = tensor({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = tensor({7, 8, 9, 10, 11, 12}, {3, 2});
  EXPECT_EQ(matmul(a, b).to_vector<float>(), (std::vector<float>{58, 64, 139, 154}));
  EXPECT_EQ(a.matmul(a.t()).to_vector<float>(), (std::vector<float>{14, 32, 32, 77}));
}

TEST(Matmul, TransposedAndStridedOperands) {
  Tensor a0 = rnd({7, 5}, 3), b0 = rnd({3, 7}, 4);
  Tensor a = a0.t(), b = b0.t();  // column-major views
  auto want = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 1, 5, 7, 3, same(), same());
  EXPECT_TRUE(AllClose(matmul(a, b).to_vector<double>(), want, 1e-12));
  EXPECT_TRUE(AllClose(matmul(a, b.contiguous()).to_vector<double>(), want, 1e-12));
  EXPECT_TRUE(AllClose(matmul(a.contiguous(), b).to_vector<double>(), want, 1e-12));
  // every other row and column: neither dim has unit stride
  Tensor s = rnd({10, 14}, 5).slice(0, 0, 10, 2).slice(1, 0, 14, 2);  // (5, 7)
  Tensor s2 = rnd({7, 6}, 6).slice(1, 0, 6, 2);                        // (7, 3), row stride 6
  auto want2 = naive_bmm(s.to_vector<double>(), s2.to_vector<double>(), 1, 5, 7, 3, same(), same());
  EXPECT_TRUE(AllClose(matmul(s, s2).to_vector<double>(), want2, 1e-12));
  // a narrowed (offset) view with unit inner stride
  Tensor n = rnd({5, 9}, 7).narrow(1, 2, 7);
  auto want3 = naive_bmm(n.to_vector<double>(), b.to_vector<double>(), 1, 5, 7, 3, same(), same());
  EXPECT_TRUE(AllClose(matmul(n, b).to_vector<double>(), want3, 1e-12));
}

TEST(Matmul, BroadcastRowsAndColumns) {
  // operands whose rows (or columns) are all the same memory: stride 0 inside the matrix
  Tensor row = rnd({4}, 8);
  Tensor a = row.expand({3, 4});          // (3, 4) strides (0, 1)
  Tensor b = rnd({4, 1}, 9).expand({4, 5});  // (4, 5) strides (1, 0)
  auto want = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 1, 3, 4, 5, same(), same());
  EXPECT_TRUE(AllClose(matmul(a, b).to_vector<double>(), want, 1e-12));
  Tensor c = rnd({4, 5}, 10);
  auto want2 = naive_bmm(a.to_vector<double>(), c.to_vector<double>(), 1, 3, 4, 5, same(), same());
  EXPECT_TRUE(AllClose(matmul(a, c).to_vector<double>(), want2, 1e-12));
  Tensor d = rnd({3, 4}, 11);
  auto want3 = naive_bmm(d.to_vector<double>(), b.to_vector<double>(), 1, 3, 4, 5, same(), same());
  EXPECT_TRUE(AllClose(matmul(d, b).to_vector<double>(), want3, 1e-12));
  // batched with a broadcast row inside each matrix
  Tensor e = rnd({2, 1, 4}, 12).expand({2, 3, 4});
  Tensor f = rnd({2, 4, 5}, 13);
  auto want4 = naive_bmm(e.to_vector<double>(), f.to_vector<double>(), 2, 3, 4, 5, same(), same());
  EXPECT_TRUE(AllClose(matmul(e, f).to_vector<double>(), want4, 1e-12));
}

TEST(Matmul, BatchedWithBroadcasting) {
  // (2, 1, 3, 4) x (5, 4, 2) -> (2, 5, 3, 2)
  Tensor a = rnd({2, 1, 3, 4}, 14), b = rnd({5, 4, 2}, 15);
  Tensor c = matmul(a, b);
  EXPECT_EQ(c.sizes(), (Shape{2, 5, 3, 2}));
  auto want = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 10, 3, 4, 2,
                        [](int64_t bi) { return bi / 5; }, [](int64_t bi) { return bi % 5; });
  EXPECT_TRUE(AllClose(c.to_vector<double>(), want, 1e-12));
  // (3, 2, 4) x (4, 5): shared weight
  Tensor x = rnd({3, 2, 4}, 16), w = rnd({4, 5}, 17);
  Tensor y = matmul(x, w);
  EXPECT_EQ(y.sizes(), (Shape{3, 2, 5}));
  EXPECT_TRUE(AllClose(y.to_vector<double>(),
                       naive_bmm(x.to_vector<double>(), w.to_vector<double>(), 3, 2, 4, 5, same(), zero()), 1e-12));
  // (4, 5) x (3, 5, 2): left operand broadcast over the batch
  Tensor l = rnd({4, 5}, 18), r = rnd({3, 5, 2}, 19);
  Tensor z = matmul(l, r);
  EXPECT_EQ(z.sizes(), (Shape{3, 4, 2}));
  EXPECT_TRUE(AllClose(z.to_vector<double>(),
                       naive_bmm(l.to_vector<double>(), r.to_vector<double>(), 3, 4, 5, 2, zero(), same()), 1e-12));
  // non-contiguous batched operands (transposed batch and matrix dims)
  Tensor p = rnd({3, 4, 2}, 20).permute({2, 0, 1});  // (2, 3, 4)
  Tensor q = rnd({2, 5, 4}, 21).transpose(1, 2);     // (2, 4, 5)
  EXPECT_TRUE(AllClose(matmul(p, q).to_vector<double>(),
                       naive_bmm(p.to_vector<double>(), q.to_vector<double>(), 2, 3, 4, 5, same(), same()), 1e-12));
  // f32 batched
  Tensor pf = p.to(DType::f32), qf = q.to(DType::f32);
  EXPECT_TRUE(AllClose(matmul(pf, qf).to_vector<double>(),
                       naive_bmm(pf.to_vector<double>(), qf.to_vector<double>(), 2, 3, 4, 5, same(), same()), 1e-5, 1e-5));
}

TEST(Matmul, VectorCases) {
  Tensor v = rnd({4}, 22), w = rnd({4}, 23), m = rnd({4, 3}, 24), m2 = rnd({3, 4}, 25), bt = rnd({2, 4, 3}, 26);
  auto vv = v.to_vector<double>(), wv = w.to_vector<double>();
  // vector . vector -> scalar
  Tensor d = matmul(v, w);
  EXPECT_EQ(d.dim(), 0);
  double dot = 0;
  for (size_t i = 0; i < 4; ++i) dot += vv[i] * wv[i];
  EXPECT_NEAR(d.item<double>(), dot, 1e-12);
  // vector x matrix -> (3)
  Tensor vm = matmul(v, m);
  EXPECT_EQ(vm.sizes(), (Shape{3}));
  EXPECT_TRUE(AllClose(vm.to_vector<double>(), naive_bmm(vv, m.to_vector<double>(), 1, 1, 4, 3, same(), same()), 1e-12));
  // matrix x vector -> (3)
  Tensor mv = matmul(m2, v);
  EXPECT_EQ(mv.sizes(), (Shape{3}));
  EXPECT_TRUE(AllClose(mv.to_vector<double>(), naive_bmm(m2.to_vector<double>(), vv, 1, 3, 4, 1, same(), same()), 1e-12));
  // vector x batched -> (2, 3)
  Tensor vb = matmul(v, bt);
  EXPECT_EQ(vb.sizes(), (Shape{2, 3}));
  EXPECT_TRUE(AllClose(vb.to_vector<double>(), naive_bmm(vv, bt.to_vector<double>(), 2, 1, 4, 3, zero(), same()), 1e-12));
  // batched x vector -> (2, 4) using bt^T
  Tensor btt = bt.transpose(1, 2);  // (2, 3, 4)
  Tensor u = rnd({4}, 27);
  Tensor bv = matmul(btt, u);
  EXPECT_EQ(bv.sizes(), (Shape{2, 3}));
  EXPECT_TRUE(AllClose(bv.to_vector<double>(),
                       naive_bmm(btt.to_vector<double>(), u.to_vector<double>(), 2, 3, 4, 1, same(), zero()), 1e-12));
  // strided vector
  Tensor sv = rnd({8}, 28).slice(0, 0, 8, 2);
  EXPECT_TRUE(AllClose(matmul(sv, m).to_vector<double>(),
                       naive_bmm(sv.to_vector<double>(), m.to_vector<double>(), 1, 1, 4, 3, same(), same()), 1e-12));
}

TEST(Matmul, MixedDtypesPromote) {
  Tensor a = rnd({2, 3}, 29, DType::f32), b = rnd({3, 2}, 30, DType::f64);
  Tensor c = matmul(a, b);
  EXPECT_EQ(c.dtype(), DType::f64);
  EXPECT_TRUE(AllClose(c.to_vector<double>(),
                       naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 1, 2, 3, 2, same(), same()), 1e-12));
  EXPECT_EQ(matmul(rnd({2, 3}, 1, DType::f16), rnd({3, 2}, 2, DType::bf16)).dtype(), DType::f32);
}

// kernels::bmm_add: bf16/f16 operands into an f32 out are their exact values' product in f32 (no rounding to 16
// bits), scaled and added; mismatched dtypes and shapes are errors naming the operands.
TEST(Matmul, BmmAddOfHalfOperandsIntoF32AndItsErrors) {
  manual_seed(5);
  for (DType t : {DType::bf16, DType::f16}) {
    const Tensor a = cast(randn({2, 5, 7}), t), b = cast(randn({2, 7, 3}), t);
    const Tensor old = randn({2, 5, 3});
    Tensor out = old.clone();
    kernels::bmm_add(a, b, out, 2.0, 0.5);
    const Tensor want = add(mul(cast(old, DType::f64), 0.5), mul(matmul(cast(a, DType::f64), cast(b, DType::f64)), 2.0));
    EXPECT_LT(amax(abs(sub(cast(out, DType::f64), want))).item<double>(), 1e-5) << dtype_name(t);
  }
  const Tensor a16 = zeros({2, 5, 7}, {.dtype = DType::bf16}), b32 = zeros({2, 7, 3});
  EXPECT_KILN_ERROR(kernels::bmm_add(a16, b32, zeros({2, 5, 3}), 1.0, 0.0), "bmm_add", "bf16[2, 5, 7]");
  EXPECT_KILN_ERROR(kernels::bmm_add(a16, zeros({2, 7, 3}, {.dtype = DType::bf16}), zeros({2, 5, 3}, {.dtype = DType::f64}),
                                     1.0, 0.0), "bmm_add", "f64");
  EXPECT_KILN_ERROR(kernels::bmm_add(zeros({2, 5, 7}), zeros({2, 6, 3}), zeros({2, 5, 3}), 1.0, 0.0), "bmm_add",
                    "[2, 6, 3]");
}

TEST(Matmul, EmptyInnerDimGivesZeros) {
  Tensor c = matmul(zeros({2, 0}), zeros({0, 3}));
  EXPECT_EQ(c.sizes(), (Shape{2, 3}));
  EXPECT_EQ(c.to_vector<float>(), std::vector<float>(6, 0.0f));
}

// The gradient of a matrix used transposed comes out in the matrix's own (contiguous) layout: the backward's
// GEMM writes the transpose rather than leaving a strided view for every later add or copy to read. (Seen on
// a non-leaf, by a hook: a leaf's accumulated gradient is contiguous either way.)
TEST(Matmul, GradientsOfTransposedOperandsKeepTheirLayout) {
  for (const bool first : {true, false}) {
    SCOPED_TRACE(first ? "k as the first operand, transposed (φ(K)ᵀV)" : "k as the second, transposed (Q Kᵀ)");
    const Tensor leaf = rnd({3, 6, 4}, 1).requires_grad_();
    const Tensor v = rnd({3, 6, 5}, 2), q = rnd({3, 5, 4}, 3);
    const Tensor k = mul(leaf, 1.0);  // a non-leaf whose incoming gradient the hook sees as it is
    Tensor seen;
    k.register_hook([&](const Tensor& g) {
      seen = g;
      return g;
    });
    const Tensor out = first ? matmul(k.transpose(-2, -1), v)   // (3, 4, 5)
                             : matmul(q, k.transpose(-2, -1));  // (3, 5, 6)
    sum(out).backward();
    ASSERT_TRUE(seen.defined());
    EXPECT_TRUE(seen.is_contiguous()) << "strides " << shape_str(seen.strides());
    // d sum(kᵀv)/dk[t, i] = Σ_j v[t, j]; d sum(q kᵀ)/dk[t, i] = Σ_s q[s, i]
    const Tensor want = first ? sum(v, {2}, true).expand({3, 6, 4}) : sum(q, {1}, true).expand({3, 6, 4});
    EXPECT_TRUE(AllClose(seen.contiguous().to_vector<double>(), want.contiguous().to_vector<double>(), 1e-12));
  }
}
