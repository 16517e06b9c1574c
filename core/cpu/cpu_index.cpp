// Indexing kernels on the CPU: index_select / index_add along one dim, gather / scatter_add.
#include <cstring>

#include <kiln/core/cpu/cpu_backend.h>
#include <kiln/core/cpu/strided.h>

namespace kiln::cpu {

namespace {

// (outer, D, inner) decomposition of a contiguous tensor around `dim`.
struct Split3 {
  int64_t outer = 1, d = 1, inner = 1;
};
Split3 split_at(const Shape& s, int64_t dim) {
  Split3 r;
  for (int64_t i = 0; i < dim; ++i) r.outer *= s[size_t(i)];
  r.d = s.empty() ? 1 : s[size_t(dim)];
  for (size_t i = size_t(dim) + 1; i < s.size(); ++i) r.inner *= s[i];
  return r;
}

template <class T>
void index_add_typed(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) {
  Split3 sd = split_at(dst.sizes(), dim);
  int64_t n = index.numel();
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  T* d = static_cast<T*>(dst.raw_data());
  const T* s = static_cast<const T*>(src.raw_data());
  // Parallel over (outer, inner) columns only: rows with repeated indices are summed in index order.
  parallel_for(sd.outer, n * sd.inner, [&](int64_t o) {
    for (int64_t j = 0; j < n; ++j) {
      T* drow = d + (o * sd.d + idx[j]) * sd.inner;
      const T* srow = s + (o * n + j) * sd.inner;
      for (int64_t i = 0; i < sd.inner; ++i) drow[i] = T(double(drow[i]) + double(srow[i]));
    }
  });
}

template <class T>
void scatter_add_typed(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) {
  Split3 sd = split_at(dst.sizes(), dim), si = split_at(index.sizes(), dim);
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  T* d = static_cast<T*>(dst.raw_data());
  const T* s = static_cast<const T*>(src.raw_data());
  parallel_for(si.outer, si.d * si.inner, [&](int64_t o) {
    for (int64_t j = 0; j < si.d; ++j)
      for (int64_t i = 0; i < si.inner; ++i) {
        int64_t k = (o * si.d + j) * si.inner + i;
        T& target = d[(o * sd.d + idx[k]) * sd.inner + i];
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

void CpuBackend::index_select(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) const {
  Split3 s = split_at(src.sizes(), dim);
  check_indices(index, s.d, "index_select");
  int64_t n = index.numel();
  size_t row_bytes = size_t(s.inner) * src.element_size();
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  const char* sp = static_cast<const char*>(src.raw_data());
  char* op = static_cast<char*>(out.raw_data());
  parallel_for(s.outer * n, s.inner, [&](int64_t k) {
    int64_t o = k / n, j = k % n;
    std::memcpy(op + size_t(k) * row_bytes, sp + size_t(o * s.d + idx[j]) * row_bytes, row_bytes);
  });
}

void CpuBackend::index_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) const {
  check_indices(index, split_at(dst.sizes(), dim).d, "index_add");
  KILN_DISPATCH_ALL(dst.dtype(), "index_add", index_add_typed<scalar_t>(dst, dim, index, src));
}

void CpuBackend::gather(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) const {
  Split3 ss = split_at(src.sizes(), dim), si = split_at(index.sizes(), dim);
  check_indices(index, ss.d, "gather");
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  size_t es = src.element_size();
  const char* sp = static_cast<const char*>(src.raw_data());
  char* op = static_cast<char*>(out.raw_data());
  parallel_for(si.outer, si.d * si.inner, [&](int64_t o) {
    for (int64_t j = 0; j < si.d; ++j)
      for (int64_t i = 0; i < si.inner; ++i) {
        int64_t k = (o * si.d + j) * si.inner + i;
        std::memcpy(op + size_t(k) * es, sp + size_t((o * ss.d + idx[k]) * ss.inner + i) * es, es);
      }
  });
}

void CpuBackend::scatter_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) const {
  check_indices(index, split_at(dst.sizes(), dim).d, "scatter_add");
  KILN_DISPATCH_ALL(dst.dtype(), "scatter_add", scatter_add_typed<scalar_t>(dst, dim, index, src));
}

}  // namespace kiln::cpu
