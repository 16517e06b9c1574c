#pragma once
// Helpers for CPU kernels: walking strided views in row-major order, converting chunks of any dtype to
// and from double, and splitting work over OpenMP threads in a thread-count-independent way (so results
// do not depend on how many threads ran them).
#include <cstdint>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::cpu {

constexpr int64_t kChunk = 1024;

// Offsets (in elements, from t.raw_data()) of t's elements [start, start + n) in row-major order.
void element_offsets(const Tensor& t, int64_t start, int64_t n, int64_t* out);
// Elements [start, start + n) of t (any dtype and strides) as doubles.
void load(const Tensor& t, int64_t start, int64_t n, double* buf);
// Writes buf into elements [start, start + n) of t, rounding to t's dtype.
void store(const Tensor& t, int64_t start, int64_t n, const double* buf);

// Calls fn(start, count) for consecutive chunks of [0, total), in parallel when total is large.
template <class Fn>
void parallel_chunks(int64_t total, int64_t chunk, Fn&& fn) {
  int64_t nchunks = (total + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (nchunks > 4 && total > 32768)
  for (int64_t c = 0; c < nchunks; ++c) {
    int64_t s = c * chunk;
    fn(s, std::min(chunk, total - s));
  }
}

// Calls fn(i) for i in [0, n) in parallel when the work (n * cost_per_item) is large.
template <class Fn>
void parallel_for(int64_t n, int64_t cost_per_item, Fn&& fn) {
#pragma omp parallel for schedule(static) if (n > 1 && n * cost_per_item > 32768)
  for (int64_t i = 0; i < n; ++i) fn(i);
}

}  // namespace kiln::cpu
