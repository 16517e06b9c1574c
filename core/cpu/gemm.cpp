// Batched GEMM on the CPU through Eigen, threaded over fixed tiles of the output so that results never
// depend on the thread count. f16/bf16 operands are widened to f32 first: the CPU is the reference, not
// the fast path for half types.
#include <algorithm>
#include <type_traits>

// Eigen never threads a product itself: the tiles below are the only parallelism (this is the one file
// that includes Eigen, so the setting is the same for every instantiation).
#define EIGEN_DONT_PARALLELIZE
#include <Eigen/Core>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/gemm.h>

namespace kiln::cpu {

namespace {

template <class T, int Order>
using MatMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>, 0, Eigen::OuterStride<>>;

// A matrix view with unit stride along rows (row-major) or columns (column-major).
struct MatLayout {
  bool row_major;
  int64_t outer;  // stride between rows (row-major) or columns (column-major)
};

MatLayout layout_of(const Tensor& t) {
  int64_t rows = t.size(1), cols = t.size(2);
  if (t.stride(2) == 1 || cols == 1) return {true, std::max<int64_t>(t.stride(1), cols == 1 ? 1 : cols)};
  (void)rows;
  return {false, std::max<int64_t>(t.stride(2), 1)};
}

// C = A B over fixed tiles of C (kTileRows x kTileCols, per batch), each one single-threaded Eigen product
// over the whole K. Eigen's own threading picks its blocking (and so the summation order along K) from the
// thread count, so a result would change with OMP_NUM_THREADS and a resume on another machine would not be
// bit-exact; the tiles depend only on the shapes. Inside the parallel loop Eigen runs single-threaded.
constexpr int64_t kTileRows = 64, kTileCols = 256;

template <class T, int OA, int OB>
void gemm_batches(const Tensor& a, const Tensor& b, const Tensor& out, int64_t a_outer, int64_t b_outer) {
  const int64_t B = out.size(0), M = out.size(1), N = out.size(2), K = a.size(2);
  const int64_t row_tiles = (M + kTileRows - 1) / kTileRows, col_tiles = (N + kTileCols - 1) / kTileCols;
  const int64_t tiles = B * row_tiles * col_tiles;
  const T* pa = static_cast<const T*>(a.raw_data());
  const T* pb = static_cast<const T*>(b.raw_data());
  T* pc = static_cast<T*>(out.raw_data());
  // Offset of element (r, c) in a row-major or column-major matrix with this outer stride.
  auto at = [](int order, int64_t outer, int64_t r, int64_t c) {
    return order == Eigen::RowMajor ? r * outer + c : c * outer + r;
  };
  parallel_for(tiles, kTileRows * kTileCols * K, [&](int64_t t) {
    const int64_t i = t / (row_tiles * col_tiles);
    const int64_t r0 = (t / col_tiles) % row_tiles * kTileRows, c0 = t % col_tiles * kTileCols;
    const int64_t m = std::min(kTileRows, M - r0), n = std::min(kTileCols, N - c0);
    MatMap<T, OA> A(pa + i * a.stride(0) + at(OA, a_outer, r0, 0), m, K, Eigen::OuterStride<>(a_outer));
    MatMap<T, OB> Bm(pb + i * b.stride(0) + at(OB, b_outer, 0, c0), K, n, Eigen::OuterStride<>(b_outer));
    Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0, Eigen::OuterStride<>> C(
        pc + i * M * N + r0 * N + c0, m, n, Eigen::OuterStride<>(N));
    C.noalias() = A * Bm;
  });
}

template <class T>
void gemm_typed(const Tensor& a, const Tensor& b, const Tensor& out) {
  MatLayout la = layout_of(a), lb = layout_of(b);
  constexpr int R = Eigen::RowMajor, C = Eigen::ColMajor;
  if (la.row_major && lb.row_major) gemm_batches<T, R, R>(a, b, out, la.outer, lb.outer);
  else if (la.row_major) gemm_batches<T, R, C>(a, b, out, la.outer, lb.outer);
  else if (lb.row_major) gemm_batches<T, C, R>(a, b, out, la.outer, lb.outer);
  else gemm_batches<T, C, C>(a, b, out, la.outer, lb.outer);
}

}  // namespace

void kernels::bmm(const Tensor& a, const Tensor& b, const Tensor& out) {
  if (out.numel() == 0) return;
  if (a.size(2) == 0) {
    fill(out, 0.0);
    return;
  }
  switch (out.dtype()) {
    case DType::f32: return gemm_typed<float>(a, b, out);
    case DType::f64: return gemm_typed<double>(a, b, out);
    case DType::f16:
    case DType::bf16: {
      Tensor a32 = empty(a.sizes(), {.dtype = DType::f32}), b32 = empty(b.sizes(), {.dtype = DType::f32});
      Tensor c32 = empty(out.sizes(), {.dtype = DType::f32});
      copy(a, a32);
      copy(b, b32);
      gemm_typed<float>(a32, b32, c32);
      copy(c32, out);
      return;
    }
    default: KILN_FAIL("matmul: unsupported dtype ", dtype_name(out.dtype()));
  }
}

// The product in the compute dtype (f64, else f32), added to out's values there and rounded once.
void kernels::bmm_add(const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta) {
  check_bmm_add(a, b, out);
  if (out.numel() == 0) return;
  const DType ct = out.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor prod = empty(out.sizes(), {.dtype = ct});
  if (a.dtype() == ct) {
    kernels::bmm(a, b, prod);
  } else {  // bf16/f16 operands: their values, exactly, in f32
    Tensor a32 = empty(a.sizes(), {.dtype = ct}), b32 = empty(b.sizes(), {.dtype = ct});
    copy(a, a32);
    copy(b, b32);
    kernels::bmm(a32, b32, prod);
  }
  KILN_DISPATCH_FLOATING(out.dtype(), "bmm_add", {
    using C = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    scalar_t* o = static_cast<scalar_t*>(out.raw_data());
    const C* p = static_cast<const C*>(prod.raw_data());
    const C al = C(alpha), be = C(beta);
    // beta = 0: out is not read (a NaN in it does not survive), as cuBLASLt does
    for (int64_t i = 0; i < out.numel(); ++i) o[i] = scalar_t(beta == 0.0 ? al * p[i] : be * C(o[i]) + al * p[i]);
  });
}

void kernels::gemm(const Tensor& a, const Tensor& b, double alpha, const Tensor& bias, const Tensor& out) {
  KILN_CHECK(is_floating(a.dtype()) && b.dtype() == a.dtype() &&
                 (out.dtype() == a.dtype() || out.dtype() == DType::f32) && (!bias.defined() || bias.dtype() == out.dtype()),
             "gemm: expected a, b of one floating dtype and out (and bias) of theirs or f32, got ", a.str(), ", ",
             b.str(), " -> ", out.str());
  // In the compute dtype (f64, else f32), rounded once into out.
  const DType ct = out.dtype() == DType::f64 ? DType::f64 : DType::f32;
  auto widen = [&](const Tensor& t) {
    if (t.dtype() == ct) return t;
    Tensor w = empty(t.sizes(), {.dtype = ct});
    copy(t, w);
    return w;
  };
  Tensor acc = out.dtype() == ct ? out : empty(out.sizes(), {.dtype = ct});
  bmm(widen(a).unsqueeze(0), widen(b).unsqueeze(0), acc.unsqueeze(0));
  if (alpha != 1.0) unary(UnaryOp::mul_scalar, acc, acc, alpha, 0.0);
  if (bias.defined()) binary(BinaryOp::add, acc, widen(bias).unsqueeze(0).expand(acc.sizes()), acc);
  if (acc.raw_data() != out.raw_data()) copy(acc, out);
}

// The reference: the FP8 codes decoded to double (exact), the product in double, scaled, the bias added,
// rounded once into out.
void kernels::scaled_gemm(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
                          const Tensor& bias, const Tensor& out, bool /*fast_accum: a GPU mode*/,
                          const Tensor& pre_gelu) {
  auto wide = [](const Tensor& t) {
    Tensor w = empty(t.sizes(), {.dtype = DType::f64});
    copy(t, w);
    return w;
  };
  Tensor acc = empty(out.sizes(), {.dtype = DType::f64});
  bmm(wide(a).unsqueeze(0), wide(b).unsqueeze(0), acc.unsqueeze(0));
  const double scale = wide(scale_a).item<double>() * wide(scale_b).item<double>();  // f32 · f32: exact in double
  unary(UnaryOp::mul_scalar, acc, acc, scale, 0.0);
  if (bias.defined()) binary(BinaryOp::add, acc, wide(bias).unsqueeze(0).expand(acc.sizes()), acc);
  if (pre_gelu.defined()) {  // the epilogue: the product kept, its GELU (in double, before rounding) the output
    copy(acc, pre_gelu);
    unary(UnaryOp::gelu_tanh, acc, acc, 0.0, 0.0);
  }
  copy(acc, out);
}

}  // namespace kiln::cpu
