// Batched GEMM on the CPU through Eigen (which threads large products with OpenMP). f16/bf16 operands
// are widened to f32 first: the CPU is the reference, not the fast path for half types.
#include <Eigen/Core>

#include <kiln/core/cpu/cpu_backend.h>

namespace kiln::cpu {

namespace {

template <class T, int Order>
using MatMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>, 0, Eigen::OuterStride<>>;
template <class T>
using OutMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

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

template <class T, int OA, int OB>
void gemm_batches(const Tensor& a, const Tensor& b, const Tensor& out, int64_t a_outer, int64_t b_outer) {
  int64_t B = out.size(0), M = out.size(1), N = out.size(2), K = a.size(2);
  const T* pa = static_cast<const T*>(a.raw_data());
  const T* pb = static_cast<const T*>(b.raw_data());
  T* pc = static_cast<T*>(out.raw_data());
  for (int64_t i = 0; i < B; ++i) {
    MatMap<T, OA> A(pa + i * a.stride(0), M, K, Eigen::OuterStride<>(a_outer));
    MatMap<T, OB> Bm(pb + i * b.stride(0), K, N, Eigen::OuterStride<>(b_outer));
    OutMap<T> C(pc + i * M * N, M, N);
    C.noalias() = A * Bm;
  }
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

void CpuBackend::bmm(const Tensor& a, const Tensor& b, const Tensor& out) const {
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

}  // namespace kiln::cpu
