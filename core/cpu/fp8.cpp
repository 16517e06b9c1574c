// FP8 scaling and quantization on the CPU: the reference for cuda/fp8.cu, with the same f32 arithmetic
// (the scale and the scaled values in f32, then core/float8.h's encoder), so both give the same codes.
#include <algorithm>
#include <cmath>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/float8.h>
#include <kiln/core/kernels/fp8.h>

namespace kiln::cpu {

namespace {

template <class T>
float abs_max(const Tensor& x) {
  const T* p = static_cast<const T*>(x.raw_data());
  float m = 0.0f;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float v = std::fabs(float(p[i]));
    if (v > m || std::isnan(v)) m = std::isnan(m) ? m : v;
  }
  return m;
}

template <class T, class F>
void quantize(const Tensor& x, float s, const Tensor& codes, const Tensor& codes_t) {
  const T* p = static_cast<const T*>(x.raw_data());
  const int64_t M = x.size(0), K = x.size(1);
  uint8_t* c = codes.defined() ? static_cast<uint8_t*>(codes.raw_data()) : nullptr;
  uint8_t* ct = codes_t.defined() ? static_cast<uint8_t*>(codes_t.raw_data()) : nullptr;
  parallel_for(M, K, [&](int64_t i) {
    for (int64_t j = 0; j < K; ++j) {
      const float x = float(p[i * K + j]);
      // a NaN keeps its sign (the product's NaN sign differs between CPUs and GPUs)
      const uint8_t code = std::isnan(x) ? uint8_t((std::signbit(x) ? 0x80 : 0) | F::nan_code) : fp8::encode_f32<F>(x * s);
      if (c) c[i * K + j] = code;
      if (ct) ct[j * M + i] = code;
    }
  });
}

}  // namespace

void kernels::fp8_amax(const Tensor& x, const Tensor& out) {
  float m = 0.0f;
  switch (x.dtype()) {
    case DType::f32: m = abs_max<float>(x); break;
    case DType::bf16: m = abs_max<BFloat16>(x); break;
    case DType::f16: m = abs_max<Half>(x); break;
    default: KILN_FAIL("fp8_amax: expected f32, bf16 or f16, got ", x.str());
  }
  *static_cast<float*>(out.raw_data()) = m;
}

void kernels::fp8_quantize(const Tensor& x, const Tensor& amax, DType format, const Tensor& codes,
                           const Tensor& codes_t, const Tensor& scale_inv, const Tensor& x_amax) {
  if (x_amax.defined()) kernels::fp8_amax(x, x_amax);
  const float a = *static_cast<const float*>(amax.raw_data());
  const float largest = format == DType::f8e4m3 ? 448.0f : 57344.0f;
  const float s = a == 0.0f ? 1.0f : largest / a;
  *static_cast<float*>(scale_inv.raw_data()) = 1.0f / s;
  auto run = [&](auto t) {
    using T = decltype(t);
    if (format == DType::f8e4m3) quantize<T, fp8::E4M3>(x, s, codes, codes_t);
    else quantize<T, fp8::E5M2>(x, s, codes, codes_t);
  };
  switch (x.dtype()) {
    case DType::f32: return run(float());
    case DType::bf16: return run(BFloat16());
    case DType::f16: return run(Half());
    default: KILN_FAIL("fp8_quantize: expected f32, bf16 or f16, got ", x.str());
  }
}

void kernels::fp8_history_amax(const Tensor& history, int64_t role, int64_t margin, const Tensor& out) {
  const int64_t H = history.size(1);
  const float* h = static_cast<const float*>(history.raw_data()) + role * H;
  float m = 0.0f;
  for (int64_t j = 0; j < H; ++j) m = std::max(m, h[j]);
  *static_cast<float*>(out.raw_data()) = std::ldexp(m, int(margin));
}

void kernels::fp8_history_record(const Tensor& history, int64_t role, const Tensor& position, const Tensor& amax,
                                 const Tensor& used, double largest, const Tensor& overflows,
                                 const Tensor& non_finite) {
  const float a = *static_cast<const float*>(amax.raw_data()), u = *static_cast<const float*>(used.raw_data());
  if (!std::isfinite(a)) {
    static_cast<float*>(non_finite.raw_data())[role] += 1.0f;
    return;
  }
  float& slot = static_cast<float*>(history.raw_data())[role * history.size(1) + *static_cast<const int64_t*>(position.raw_data())];
  slot = std::max(slot, a);
  if (a > (u == 0.0f ? float(largest) : u)) static_cast<float*>(overflows.raw_data())[role] += 1.0f;
}

void kernels::fp8_history_step(const Tensor& history, const Tensor& position) {
  const int64_t roles = history.size(0), H = history.size(1);
  int64_t& p = *static_cast<int64_t*>(position.raw_data());
  p = (p + 1) % H;
  float* h = static_cast<float*>(history.raw_data());
  for (int64_t r = 0; r < roles; ++r) h[r * H + p] = 0.0f;
}

}  // namespace kiln::cpu
