#include <kiln/core/cpu/strided.h>

namespace kiln::cpu {

void element_offsets(const Tensor& t, int64_t start, int64_t n, int64_t* out) {
  const Shape& shape = t.sizes();
  const Shape& strides = t.strides();
  int64_t nd = int64_t(shape.size());
  if (nd == 0) {
    for (int64_t i = 0; i < n; ++i) out[i] = 0;
    return;
  }
  int64_t idx[64];
  int64_t rem = start, cur = 0;
  for (int64_t d = nd - 1; d >= 0; --d) {
    idx[d] = rem % shape[d];
    rem /= shape[d];
    cur += idx[d] * strides[d];
  }
  const int64_t last = nd - 1, last_size = shape[last], last_stride = strides[last];
  for (int64_t i = 0; i < n; ++i) {
    out[i] = cur;
    // odometer increment, innermost dim first
    cur += last_stride;
    if (++idx[last] < last_size) continue;
    cur -= last_stride * last_size;
    idx[last] = 0;
    for (int64_t d = last - 1; d >= 0; --d) {
      cur += strides[d];
      if (++idx[d] < shape[d]) break;
      cur -= strides[d] * shape[d];
      idx[d] = 0;
    }
  }
}

namespace {
template <class T>
void load_typed(const Tensor& t, int64_t start, int64_t n, double* buf) {
  const T* p = static_cast<const T*>(t.raw_data());
  if (t.is_contiguous()) {
    for (int64_t i = 0; i < n; ++i) buf[i] = double(static_cast<float>(p[start + i]));
    return;
  }
  int64_t off[kChunk];
  for (int64_t done = 0; done < n; done += kChunk) {
    int64_t m = std::min(kChunk, n - done);
    element_offsets(t, start + done, m, off);
    for (int64_t i = 0; i < m; ++i) buf[done + i] = double(static_cast<float>(p[off[i]]));
  }
}
// double/int types convert directly (no detour through float)
template <class T>
void load_exact(const Tensor& t, int64_t start, int64_t n, double* buf) {
  const T* p = static_cast<const T*>(t.raw_data());
  if (t.is_contiguous()) {
    for (int64_t i = 0; i < n; ++i) buf[i] = double(p[start + i]);
    return;
  }
  int64_t off[kChunk];
  for (int64_t done = 0; done < n; done += kChunk) {
    int64_t m = std::min(kChunk, n - done);
    element_offsets(t, start + done, m, off);
    for (int64_t i = 0; i < m; ++i) buf[done + i] = double(p[off[i]]);
  }
}

template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) return T(float(v));
  else if constexpr (std::is_same_v<T, Float8E4M3> || std::is_same_v<T, Float8E5M2>) return T(v);  // one rounding
  else if constexpr (std::is_same_v<T, bool>) return v != 0.0;
  else return static_cast<T>(v);
}

template <class T>
void store_typed(const Tensor& t, int64_t start, int64_t n, const double* buf) {
  T* p = static_cast<T*>(t.raw_data());
  if (t.is_contiguous()) {
    for (int64_t i = 0; i < n; ++i) p[start + i] = from_double<T>(buf[i]);
    return;
  }
  int64_t off[kChunk];
  for (int64_t done = 0; done < n; done += kChunk) {
    int64_t m = std::min(kChunk, n - done);
    element_offsets(t, start + done, m, off);
    for (int64_t i = 0; i < m; ++i) p[off[i]] = from_double<T>(buf[done + i]);
  }
}
}  // namespace

void load(const Tensor& t, int64_t start, int64_t n, double* buf) {
  switch (t.dtype()) {
    case DType::f32: return load_exact<float>(t, start, n, buf);
    case DType::f64: return load_exact<double>(t, start, n, buf);
    case DType::f16: return load_typed<Half>(t, start, n, buf);
    case DType::bf16: return load_typed<BFloat16>(t, start, n, buf);
    case DType::i32: return load_exact<int32_t>(t, start, n, buf);
    case DType::i64: return load_exact<int64_t>(t, start, n, buf);
    case DType::boolean: return load_exact<bool>(t, start, n, buf);
    case DType::f8e4m3: return load_typed<Float8E4M3>(t, start, n, buf);
    case DType::f8e5m2: return load_typed<Float8E5M2>(t, start, n, buf);
  }
}

void store(const Tensor& t, int64_t start, int64_t n, const double* buf) {
  if (t.dtype() == DType::f8e4m3) return store_typed<Float8E4M3>(t, start, n, buf);
  if (t.dtype() == DType::f8e5m2) return store_typed<Float8E5M2>(t, start, n, buf);
  KILN_DISPATCH_ALL(t.dtype(), "store", store_typed<scalar_t>(t, start, n, buf));
}

}  // namespace kiln::cpu
