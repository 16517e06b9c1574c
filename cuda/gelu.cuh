#pragma once
// GELU with the tanh approximation (GPT-2's) and its derivative on the device, shared by the elementwise
// kernels (cuda/elementwise.cu) and the linear layer's fused bias gradient (cuda/linear_bias.cu):
//   gelu_tanh(x) = x/2 (1 + tanh(k (x + c x³))),  k = sqrt(2/π), c = 0.044715.
namespace kiln::cuda {

constexpr double kGeluTanhK = 0.7978845608028654;  // sqrt(2/π)
constexpr double kGeluTanhC = 0.044715;
constexpr double kGeluLog2e = 1.4426950408889634;

// The tanh approximation of gelu, u = k (x + c x³), in terms of s = σ(2u) = (1 + tanh u) / 2:
// gelu_tanh(x) = x s and gelu_tanh'(x) = s + 2 x s (1 - s) k (1 + 3 c x²). In f32, s and 1 - s come
// from e = exp(-2|u|) (s = 1/(1+e) or e/(1+e) by the sign of u), so neither 1 + tanh nor 1 - tanh² cancels
// in the tails; f64 keeps the CPU's tanh form.
__device__ __forceinline__ void gelu_tanh_parts(float x, float& s, float& one_minus_s) {
  const float u = float(kGeluTanhK) * fmaf(float(kGeluTanhC) * x, x * x, x);
  const float e = exp2f(float(-2.0 * kGeluLog2e) * fabsf(u));
  const float r = __fdividef(1.0f, 1.0f + e), er = e * r;
  s = u >= 0.0f ? r : er;
  one_minus_s = u >= 0.0f ? er : r;
}
__device__ __forceinline__ float gelu_tanh(float x) {
  float s, sc;
  gelu_tanh_parts(x, s, sc);
  return x * s;
}
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  float s, sc;
  gelu_tanh_parts(x, s, sc);
  return fmaf(2.0f * x * s * sc * float(kGeluTanhK), fmaf(float(3.0 * kGeluTanhC) * x, x, 1.0f), s);
}
__device__ __forceinline__ double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + tanh(kGeluTanhK * (x + kGeluTanhC * x * x * x)));
}
__device__ __forceinline__ double gelu_tanh_grad(double x) {
  const double t = tanh(kGeluTanhK * (x + kGeluTanhC * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kGeluTanhK * (1.0 + 3.0 * kGeluTanhC * x * x);
}

}  // namespace kiln::cuda
