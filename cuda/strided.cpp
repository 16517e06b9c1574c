#include <kiln/cuda/strided.cuh>

namespace kiln::cuda {

StridedArg strided_arg(const Tensor& t) {
  StridedArg a{};
  int64_t sizes[64], strides[64];
  int n = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    sizes[n] = t.size(d);
    strides[n] = t.stride(d);
    // merge with the previous dim when that one steps over exactly this one
    if (n > 0 && strides[n - 1] == sizes[n] * strides[n]) {
      sizes[n - 1] *= sizes[n];
      strides[n - 1] = strides[n];
      continue;
    }
    ++n;
  }
  KILN_CHECK(n <= kMaxDims, "cuda: tensor ", t.str(), " has more than ", kMaxDims, " non-mergeable dims");
  a.ndim = n;
  for (int d = 0; d < n; ++d) {
    a.sizes[d] = sizes[d];
    a.strides[d] = strides[d];
  }
  return a;
}

}  // namespace kiln::cuda
