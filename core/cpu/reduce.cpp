// Row reductions on the CPU: sum/max/min/argmax over the last dim of a contiguous (M, R) tensor,
// accumulating in double. Rows run in parallel; a single long row is split into fixed blocks whose partial
// sums are added in order, so results never depend on the number of threads.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/reduce.h>
#include <kiln/core/shape.h>

namespace kiln::cpu {

namespace {

constexpr int64_t kBlock = 16384;

// Reduces row `row` of in (M, R) into a double (and an index for argmax).
struct RowResult {
  double value;
  int64_t index;
};

RowResult reduce_range(ReduceOp op, const Tensor& in, int64_t start, int64_t n) {
  double acc = op == ReduceOp::sum ? 0.0 : (op == ReduceOp::min ? INFINITY : -INFINITY);
  int64_t best = -1;
  double buf[kChunk];
  for (int64_t done = 0; done < n; done += kChunk) {
    int64_t m = std::min(kChunk, n - done);
    load(in, start + done, m, buf);
    for (int64_t i = 0; i < m; ++i) {
      double v = buf[i];
      switch (op) {
        case ReduceOp::sum: acc += v; break;
        case ReduceOp::max: case ReduceOp::argmax:
          // NaN wins and stays (as in PyTorch); otherwise the first maximum
          if (best < 0 || (!std::isnan(acc) && (v > acc || std::isnan(v)))) { acc = v; best = done + i; }
          break;
        case ReduceOp::min:
          if (best < 0 || (!std::isnan(acc) && (v < acc || std::isnan(v)))) { acc = v; best = done + i; }
          break;
      }
    }
  }
  return {acc, best};
}

RowResult combine(ReduceOp op, RowResult a, RowResult b, int64_t b_base) {
  if (op == ReduceOp::sum) return {a.value + b.value, 0};
  if (b.index < 0) return a;
  b.index += b_base;
  if (a.index < 0 || std::isnan(a.value)) return a.index < 0 ? b : a;
  bool better = op == ReduceOp::min ? (b.value < a.value || std::isnan(b.value))
                                    : (b.value > a.value || std::isnan(b.value));
  return better ? b : a;
}

}  // namespace

namespace {
template <class T>
void matrix_sum_squares_as(const std::vector<Tensor>& mats, const Tensor& out) {
  T* o = static_cast<T*>(out.raw_data());
  for (size_t i = 0; i < mats.size(); ++i) {
    const Tensor& m = mats[i];
    const T* x = static_cast<const T*>(m.raw_data());
    double acc = 0;
    for (int64_t r = 0; r < m.size(0); ++r)
      for (int64_t c = 0; c < m.size(1); ++c) {
        const double v = double(x[r * m.stride(0) + c]);
        acc += v * v;
      }
    o[i] = T(acc);
  }
}
}  // namespace

void kernels::matrix_sum_squares(const std::vector<Tensor>& mats, const Tensor& out) {
  KILN_CHECK(out.dim() == 1 && out.numel() == int64_t(mats.size()) && out.is_contiguous() &&
                 (out.dtype() == DType::f32 || out.dtype() == DType::f64),
             "matrix_sum_squares: ", mats.size(), " matrices into ", out.str(), ": expected one f32 or f64 output each");
  for (const Tensor& m : mats)
    KILN_CHECK(m.device().is_cpu() && out.device().is_cpu(), "matrix_sum_squares: ", m.str(), " into ", out.str(),
               ": expected every tensor on one device");
  for (const Tensor& m : mats)
    KILN_CHECK(m.dim() == 2 && m.dtype() == out.dtype() && (m.stride(1) == 1 || m.size(1) == 1), "matrix_sum_squares: ",
               m.str(), ": expected a 2-D matrix of the output's dtype, rows contiguous");
  if (out.dtype() == DType::f32) matrix_sum_squares_as<float>(mats, out);
  else matrix_sum_squares_as<double>(mats, out);
}

void kernels::reduce(ReduceOp op, const Tensor& in, const Tensor& out) {
  int64_t M = out.numel();
  int64_t R = M ? in.numel() / M : 0;
  std::vector<double> res(static_cast<size_t>(M));
  std::vector<int64_t> idx(static_cast<size_t>(M));
  if (M < 4 && R > 2 * kBlock) {
    for (int64_t r = 0; r < M; ++r) {
      int64_t nb = (R + kBlock - 1) / kBlock;
      std::vector<RowResult> parts(static_cast<size_t>(nb));
      parallel_for(nb, kBlock, [&](int64_t b) {
        parts[size_t(b)] = reduce_range(op, in, r * R + b * kBlock, std::min(kBlock, R - b * kBlock));
      });
      RowResult acc = parts[0];
      for (int64_t b = 1; b < nb; ++b) acc = combine(op, acc, parts[size_t(b)], b * kBlock);
      res[size_t(r)] = acc.value;
      idx[size_t(r)] = acc.index;
    }
  } else {
    parallel_for(M, R, [&](int64_t r) {
      RowResult rr = reduce_range(op, in, r * R, R);
      res[size_t(r)] = rr.value;
      idx[size_t(r)] = rr.index;
    });
  }
  if (op == ReduceOp::argmax) {
    std::vector<double> as_double(idx.begin(), idx.end());
    store(out, 0, M, as_double.data());
  } else {
    store(out, 0, M, res.data());
  }
}

// cumsum: each (outer, inner) column summed down `size` (up it when reversed) in double (int64 for i64),
// rounded once per element, an exclusive sum before its own element; the outer blocks run in parallel, so
// results do not depend on the number of threads.
namespace kernels {  // declared next to its op, core/ops_reduce.cpp
void cumsum(const Tensor& in, int64_t dim, bool exclusive, bool reverse, const Tensor& out) {
  const DimSplit s = split_at(in.sizes(), dim);
  KILN_DISPATCH_ALL(in.dtype(), "cumsum", {
    using A = std::conditional_t<std::is_integral_v<scalar_t>, int64_t, double>;
    const scalar_t* x = static_cast<const scalar_t*>(in.raw_data());
    scalar_t* y = static_cast<scalar_t*>(out.raw_data());
    parallel_for(s.outer, s.size * s.inner, [&](int64_t o) {
      std::vector<A> acc(size_t(s.inner), A(0));
      for (int64_t i = 0; i < s.size; ++i) {
        const int64_t row = (o * s.size + (reverse ? s.size - 1 - i : i)) * s.inner;
        for (int64_t k = 0; k < s.inner; ++k) {
          const A v = A(x[row + k]);
          if (exclusive) y[row + k] = scalar_t(acc[size_t(k)]);
          acc[size_t(k)] += v;
          if (!exclusive) y[row + k] = scalar_t(acc[size_t(k)]);
        }
      }
    });
  });
}
}  // namespace kernels

namespace kernels {  // declared next to its op, core/ops_sort.cpp
// argsort_rows: each row's indices stably sorted by value, NaN last ascending (first descending), as
// PyTorch orders NaN as the largest value; rows in parallel.
void argsort_rows(const Tensor& in, const Tensor& out, bool descending) {
  const int64_t M = in.size(0), C = in.size(1);
  int64_t* idx = static_cast<int64_t*>(out.raw_data());
  KILN_DISPATCH_ALL(in.dtype(), "argsort", {
    const scalar_t* x = static_cast<const scalar_t*>(in.raw_data());
    parallel_for(M, C * 16, [&](int64_t m) {
      const scalar_t* row = x + m * C;
      int64_t* order = idx + m * C;
      for (int64_t c = 0; c < C; ++c) order[c] = c;
      // NaN compares as the largest value; ties keep their order (stable). Integers compare exactly.
      auto less = [&](int64_t i, int64_t j) {
        if constexpr (std::is_integral_v<scalar_t>) {
          return row[i] < row[j];
        } else {
          const double a = double(row[i]), b = double(row[j]);
          if (std::isnan(a)) return false;
          if (std::isnan(b)) return true;
          return a < b;
        }
      };
      if (descending)
        std::stable_sort(order, order + C, [&](int64_t i, int64_t j) { return less(j, i); });
      else
        std::stable_sort(order, order + C, less);
    });
  });
}
}  // namespace kernels

}  // namespace kiln::cpu
