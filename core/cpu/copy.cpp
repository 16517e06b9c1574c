// Copy and cast on the CPU: same-dtype copies move whole words (exact for every dtype, i64 beyond 2^53
// included); casts go through double and round once.
#include <cmath>
#include <cstring>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/copy.h>

namespace kiln::cpu {

namespace {

// Same-dtype strided copy by element size: exact for every dtype, including i64 beyond 2^53.
template <class W>
void copy_words(const Tensor& src, const Tensor& dst) {
  const W* s = static_cast<const W*>(src.raw_data());
  W* d = static_cast<W*>(dst.raw_data());
  bool sc = src.is_contiguous(), dc = dst.is_contiguous();
  parallel_chunks(dst.numel(), kChunk, [&](int64_t start, int64_t n) {
    int64_t so[kChunk], dof[kChunk];
    if (!sc) element_offsets(src, start, n, so);
    if (!dc) element_offsets(dst, start, n, dof);
    for (int64_t i = 0; i < n; ++i) d[dc ? start + i : dof[i]] = s[sc ? start + i : so[i]];
  });
}

}  // namespace

void kernels::copy(const Tensor& src, const Tensor& dst) {
  if (dst.numel() == 0) return;
  if (src.dtype() == dst.dtype()) {
    if (src.is_contiguous() && dst.is_contiguous()) {
      std::memcpy(dst.raw_data(), src.raw_data(), size_t(dst.numel()) * dst.element_size());
      return;
    }
    switch (dst.element_size()) {
      case 1: return copy_words<uint8_t>(src, dst);
      case 2: return copy_words<uint16_t>(src, dst);
      case 4: return copy_words<uint32_t>(src, dst);
      case 8: return copy_words<uint64_t>(src, dst);
    }
  }
  parallel_chunks(dst.numel(), kChunk, [&](int64_t start, int64_t n) {
    double buf[kChunk];
    load(src, start, n, buf);
    store(dst, start, n, buf);
  });
}

namespace {
template <class T>
void scale_matrices_as(const std::vector<Tensor>& src, const std::vector<Tensor>& dst, const Tensor& scale) {
  const T* k = static_cast<const T*>(scale.raw_data());
  for (size_t i = 0; i < src.size(); ++i) {
    const Tensor &s = src[i], &d = dst[i];
    const T* sp = static_cast<const T*>(s.raw_data());
    T* dp = static_cast<T*>(d.raw_data());
    for (int64_t r = 0; r < s.size(0); ++r)
      for (int64_t c = 0; c < s.size(1); ++c) dp[r * d.stride(0) + c] = k[i] * sp[r * s.stride(0) + c];
  }
}
}  // namespace

void kernels::scale_matrices(const std::vector<Tensor>& src, const std::vector<Tensor>& dst, const Tensor& scale) {
  KILN_CHECK(src.size() == dst.size() && scale.dim() == 1 && scale.numel() == int64_t(src.size()) &&
                 scale.is_contiguous() && (scale.dtype() == DType::f32 || scale.dtype() == DType::f64),
             "scale_matrices: ", src.size(), " sources, ", dst.size(), " destinations and scale ", scale.str(),
             ": expected one f32 or f64 scale per pair");
  for (size_t i = 0; i < src.size(); ++i) {
    const Tensor &s = src[i], &d = dst[i];
    KILN_CHECK(scale.device().is_cpu() && s.device().is_cpu() && d.device().is_cpu(), "scale_matrices: ", s.str(),
               " -> ", d.str(), " with scale ", scale.str(), ": expected every tensor on one device");
    KILN_CHECK(s.dim() == 2 && s.sizes() == d.sizes() && s.dtype() == scale.dtype() && d.dtype() == scale.dtype() &&
                   (s.stride(1) == 1 || s.size(1) == 1) && (d.stride(1) == 1 || d.size(1) == 1),
               "scale_matrices: ", s.str(), " -> ", d.str(), ": expected 2-D matrices of the scale's dtype, rows contiguous");
  }
  if (scale.dtype() == DType::f32) scale_matrices_as<float>(src, dst, scale);
  else scale_matrices_as<double>(src, dst, scale);
}

void kernels::copy_matrices(const std::vector<Tensor>& src, const std::vector<Tensor>& dst) {
  KILN_CHECK(src.size() == dst.size(), "copy_matrices: ", src.size(), " sources and ", dst.size(), " destinations");
  for (size_t i = 0; i < src.size(); ++i) {
    const bool to_bf16 = src[0].dtype() != dst[0].dtype();  // the converting form, f32 -> bf16, for every pair
    const bool dtypes = to_bf16 ? src[i].dtype() == DType::f32 && dst[i].dtype() == DType::bf16
                                : src[i].dtype() == dst[i].dtype();
    KILN_CHECK(src[i].sizes() == dst[i].sizes() && dtypes && src[i].dim() == 2, "copy_matrices: ", src[i].str(), " -> ",
               dst[i].str(), ": expected 2-D matrices of one shape, and ",
               to_bf16 ? "every pair f32 -> bf16 (as the first)" : "one dtype");
    // the GPU's layout rule, held here too so that the CPU's tests find a caller that breaks it
    KILN_CHECK((src[i].stride(1) == 1 || src[i].size(1) == 1) && (dst[i].stride(1) == 1 || dst[i].size(1) == 1),
               "copy_matrices: ", src[i].str(), " -> ", dst[i].str(), ": rows must be contiguous");
    copy(src[i], dst[i]);
  }
}

}  // namespace kiln::cpu
