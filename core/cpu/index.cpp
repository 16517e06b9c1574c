// Indexing kernels on the CPU: index_select / index_add along one dim, gather / scatter_add.
#include <cstring>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/index.h>
#include <kiln/core/shape.h>

namespace kiln::cpu {

namespace {

// (outer, D, inner) decomposition of a contiguous tensor around `dim`.
template <class T>
void index_add_typed(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) {
  DimSplit sd = split_at(dst.sizes(), dim);
  int64_t n = index.numel();
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  T* d = static_cast<T*>(dst.raw_data());
  const T* s = static_cast<const T*>(src.raw_data());
  // Parallel over (outer, inner) columns only: rows with repeated indices are summed in index order.
  parallel_for(sd.outer, n * sd.inner, [&](int64_t o) {
    for (int64_t j = 0; j < n; ++j) {
      T* drow = d + (o * sd.size + idx[j]) * sd.inner;
      const T* srow = s + (o * n + j) * sd.inner;
      for (int64_t i = 0; i < sd.inner; ++i) drow[i] = T(double(drow[i]) + double(srow[i]));
    }
  });
}

template <class T>
void scatter_add_typed(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) {
  DimSplit sd = split_at(dst.sizes(), dim), si = split_at(index.sizes(), dim);
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  T* d = static_cast<T*>(dst.raw_data());
  const T* s = static_cast<const T*>(src.raw_data());
  parallel_for(si.outer, si.size * si.inner, [&](int64_t o) {
    for (int64_t j = 0; j < si.size; ++j)
      for (int64_t i = 0; i < si.inner; ++i) {
        int64_t k = (o * si.size + j) * si.inner + i;
        T& target = d[(o * sd.size + idx[k]) * sd.inner + i];
        target = T(double(target) + double(s[k]));
      }
  });
}

void check_indices(const Tensor& index, int64_t bound, const char* op) {
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  for (int64_t i = 0; i < index.numel(); ++i)
    KILN_CHECK(idx[i] >= 0 && idx[i] < bound, op, ": index ", idx[i], " out of range [0, ", bound, ")");
}

}  // namespace

void kernels::index_select(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) {
  DimSplit s = split_at(src.sizes(), dim);
  check_indices(index, s.size, "index_select");
  int64_t n = index.numel();
  size_t row_bytes = size_t(s.inner) * src.element_size();
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  const char* sp = static_cast<const char*>(src.raw_data());
  char* op = static_cast<char*>(out.raw_data());
  parallel_for(s.outer * n, s.inner, [&](int64_t k) {
    int64_t o = k / n, j = k % n;
    std::memcpy(op + size_t(k) * row_bytes, sp + size_t(o * s.size + idx[j]) * row_bytes, row_bytes);
  });
}

void kernels::index_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) {
  check_indices(index, split_at(dst.sizes(), dim).size, "index_add");
  KILN_DISPATCH_ALL(dst.dtype(), "index_add", index_add_typed<scalar_t>(dst, dim, index, src));
}

void kernels::gather(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) {
  DimSplit ss = split_at(src.sizes(), dim), si = split_at(index.sizes(), dim);
  check_indices(index, ss.size, "gather");
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  size_t es = src.element_size();
  const char* sp = static_cast<const char*>(src.raw_data());
  char* op = static_cast<char*>(out.raw_data());
  parallel_for(si.outer, si.size * si.inner, [&](int64_t o) {
    for (int64_t j = 0; j < si.size; ++j)
      for (int64_t i = 0; i < si.inner; ++i) {
        int64_t k = (o * si.size + j) * si.inner + i;
        std::memcpy(op + size_t(k) * es, sp + size_t((o * ss.size + idx[k]) * ss.inner + i) * es, es);
      }
  });
}

void kernels::scatter_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) {
  check_indices(index, split_at(dst.sizes(), dim).size, "scatter_add");
  KILN_DISPATCH_ALL(dst.dtype(), "scatter_add", scatter_add_typed<scalar_t>(dst, dim, index, src));
}

}  // namespace kiln::cpu
