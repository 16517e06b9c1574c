// Dropout with the mask drawn in the kernel on the CPU: the reference for cuda/dropout.cu (the math is in
// core/kernels/dropout.h).
#include <kiln/core/kernels/dropout.h>
#include <kiln/core/cpu/strided.h>
#include <kiln/core/half.h>

namespace kiln::cpu {

namespace {

template <class T, class C>
void dropout_typed(const Tensor& x, const Tensor& out, double p, uint64_t seed, uint64_t offset) {
  const T* in = static_cast<const T*>(x.raw_data());
  T* o = static_cast<T*>(out.raw_data());
  const float keep = float(1.0 - p);
  const C scale = C(1.0 / (1.0 - p));
  const int64_t blocks = (x.numel() + 3) / 4, n = x.numel();
  parallel_for(blocks, 64, [&](int64_t j) {
    const auto w = philox4x32(offset + uint64_t(j), seed);
    for (int k = 0; k < 4 && 4 * j + k < n; ++k) {
      const int64_t e = 4 * j + k;
      o[e] = uint_to_unit_float(w[size_t(k)]) < keep ? T(C(in[e]) * scale) : T(0.0f);
    }
  });
}

}  // namespace

void kernels::dropout_masked(const Tensor& x, const Tensor& out, double p, const PhiloxDraw& draw) {
  KILN_CHECK(!draw.replay_base, "dropout: a CUDA graph's draw given to the CPU kernel (", x.str(), ")");
  switch (x.dtype()) {
    case DType::f64: return dropout_typed<double, double>(x, out, p, draw.seed, draw.offset);
    case DType::f32: return dropout_typed<float, float>(x, out, p, draw.seed, draw.offset);
    case DType::f16: return dropout_typed<Half, float>(x, out, p, draw.seed, draw.offset);
    case DType::bf16: return dropout_typed<BFloat16, float>(x, out, p, draw.seed, draw.offset);
    default: KILN_FAIL("dropout: expected a floating-point tensor, got ", x.str());
  }
}

}  // namespace kiln::cpu
