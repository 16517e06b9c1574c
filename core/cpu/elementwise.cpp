// Elementwise CPU kernels: fill, unary, binary, where. Each walks the output in chunks, converts operands
// to double, applies the op, and rounds once into the output dtype.
#include <cmath>
#include <cstring>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/elementwise.h>

namespace kiln::cpu {

namespace {

constexpr double kSqrt2 = 1.4142135623730951;
constexpr double kInvSqrt2Pi = 0.3989422804014327;  // 1/sqrt(2π)
constexpr double kGeluTanhK = 0.7978845608028654;   // sqrt(2/π)
constexpr double kGeluTanhC = 0.044715;

double gelu_tanh_inner(double x) { return kGeluTanhK * (x + kGeluTanhC * x * x * x); }

void apply_unary(UnaryOp op, double* x, int64_t n, double p0, double p1) {
  switch (op) {
    case UnaryOp::neg: for (int64_t i = 0; i < n; ++i) x[i] = -x[i]; break;
    case UnaryOp::exp: for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]); break;
    case UnaryOp::log: for (int64_t i = 0; i < n; ++i) x[i] = std::log(x[i]); break;
    case UnaryOp::sqrt: for (int64_t i = 0; i < n; ++i) x[i] = std::sqrt(x[i]); break;
    case UnaryOp::rsqrt: for (int64_t i = 0; i < n; ++i) x[i] = 1.0 / std::sqrt(x[i]); break;
    case UnaryOp::tanh: for (int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i]); break;
    case UnaryOp::sigmoid: for (int64_t i = 0; i < n; ++i) x[i] = 1.0 / (1.0 + std::exp(-x[i])); break;
    case UnaryOp::relu: for (int64_t i = 0; i < n; ++i) x[i] = x[i] <= 0 ? 0.0 : x[i]; break;  // NaN stays NaN
    // gelu(x) = x Φ(x) = x/2 (1 + erf(x/√2))
    case UnaryOp::gelu: for (int64_t i = 0; i < n; ++i) x[i] = 0.5 * x[i] * (1.0 + std::erf(x[i] / kSqrt2)); break;
    // tanh approximation: x/2 (1 + tanh(√(2/π) (x + 0.044715 x³)))
    case UnaryOp::gelu_tanh:
      for (int64_t i = 0; i < n; ++i) x[i] = 0.5 * x[i] * (1.0 + std::tanh(gelu_tanh_inner(x[i])));
      break;
    case UnaryOp::abs: for (int64_t i = 0; i < n; ++i) x[i] = std::fabs(x[i]); break;
    case UnaryOp::sign: for (int64_t i = 0; i < n; ++i) x[i] = double((x[i] > 0) - (x[i] < 0)); break;
    case UnaryOp::square: for (int64_t i = 0; i < n; ++i) x[i] = x[i] * x[i]; break;
    case UnaryOp::isfinite: for (int64_t i = 0; i < n; ++i) x[i] = std::isfinite(x[i]) ? 1.0 : 0.0; break;
    case UnaryOp::sin: for (int64_t i = 0; i < n; ++i) x[i] = std::sin(x[i]); break;
    case UnaryOp::cos: for (int64_t i = 0; i < n; ++i) x[i] = std::cos(x[i]); break;
    case UnaryOp::pow_scalar:
      if (p0 == 2.0) for (int64_t i = 0; i < n; ++i) x[i] = x[i] * x[i];
      else for (int64_t i = 0; i < n; ++i) x[i] = std::pow(x[i], p0);
      break;
    case UnaryOp::clamp:
      for (int64_t i = 0; i < n; ++i) x[i] = std::isnan(x[i]) ? x[i] : std::min(std::max(x[i], p0), p1);
      break;
    case UnaryOp::add_scalar: for (int64_t i = 0; i < n; ++i) x[i] += p0; break;
    case UnaryOp::mul_scalar: for (int64_t i = 0; i < n; ++i) x[i] *= p0; break;
    case UnaryOp::div_scalar: for (int64_t i = 0; i < n; ++i) x[i] /= p0; break;
    case UnaryOp::rsub_scalar: for (int64_t i = 0; i < n; ++i) x[i] = p0 - x[i]; break;
    case UnaryOp::rdiv_scalar: for (int64_t i = 0; i < n; ++i) x[i] = p0 / x[i]; break;
  }
}

// a := op(a, b)
void apply_binary(BinaryOp op, double* a, const double* b, int64_t n) {
  switch (op) {
    case BinaryOp::add: for (int64_t i = 0; i < n; ++i) a[i] += b[i]; break;
    case BinaryOp::sub: for (int64_t i = 0; i < n; ++i) a[i] -= b[i]; break;
    case BinaryOp::mul: for (int64_t i = 0; i < n; ++i) a[i] *= b[i]; break;
    case BinaryOp::div: for (int64_t i = 0; i < n; ++i) a[i] /= b[i]; break;
    case BinaryOp::pow: for (int64_t i = 0; i < n; ++i) a[i] = std::pow(a[i], b[i]); break;
    case BinaryOp::maximum:
      for (int64_t i = 0; i < n; ++i) a[i] = (std::isnan(a[i]) || a[i] >= b[i]) ? a[i] : b[i];
      break;
    case BinaryOp::minimum:
      for (int64_t i = 0; i < n; ++i) a[i] = (std::isnan(a[i]) || a[i] <= b[i]) ? a[i] : b[i];
      break;
    case BinaryOp::eq: for (int64_t i = 0; i < n; ++i) a[i] = a[i] == b[i]; break;
    case BinaryOp::ne: for (int64_t i = 0; i < n; ++i) a[i] = a[i] != b[i]; break;
    case BinaryOp::lt: for (int64_t i = 0; i < n; ++i) a[i] = a[i] < b[i]; break;
    case BinaryOp::le: for (int64_t i = 0; i < n; ++i) a[i] = a[i] <= b[i]; break;
    case BinaryOp::gt: for (int64_t i = 0; i < n; ++i) a[i] = a[i] > b[i]; break;
    case BinaryOp::ge: for (int64_t i = 0; i < n; ++i) a[i] = a[i] >= b[i]; break;
    case BinaryOp::relu_backward: for (int64_t i = 0; i < n; ++i) a[i] = b[i] > 0 ? a[i] : 0.0; break;
    // d/dx x Φ(x) = Φ(x) + x φ(x)
    case BinaryOp::gelu_backward:
      for (int64_t i = 0; i < n; ++i) {
        double x = b[i];
        a[i] *= 0.5 * (1.0 + std::erf(x / kSqrt2)) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
      }
      break;
    // d/dx x/2 (1 + tanh u), u = k (x + c x³): (1 + t)/2 + x/2 (1 - t²) k (1 + 3 c x²)
    case BinaryOp::gelu_tanh_backward:
      for (int64_t i = 0; i < n; ++i) {
        double x = b[i], t = std::tanh(gelu_tanh_inner(x));
        a[i] *= 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kGeluTanhK * (1.0 + 3.0 * kGeluTanhC * x * x);
      }
      break;
    case BinaryOp::tanh_backward: for (int64_t i = 0; i < n; ++i) a[i] *= 1.0 - b[i] * b[i]; break;
    case BinaryOp::sigmoid_backward: for (int64_t i = 0; i < n; ++i) a[i] *= b[i] * (1.0 - b[i]); break;
  }
}

}  // namespace

void kernels::fill(const Tensor& dst, double value) {
  parallel_chunks(dst.numel(), kChunk, [&](int64_t start, int64_t n) {
    double buf[kChunk];
    for (int64_t i = 0; i < n; ++i) buf[i] = value;
    store(dst, start, n, buf);
  });
}

void kernels::unary(UnaryOp op, const Tensor& in, const Tensor& out, double p0, double p1) {
  parallel_chunks(out.numel(), kChunk, [&](int64_t start, int64_t n) {
    double buf[kChunk];
    load(in, start, n, buf);
    apply_unary(op, buf, n, p0, p1);
    store(out, start, n, buf);
  });
}

void kernels::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  parallel_chunks(out.numel(), kChunk, [&](int64_t start, int64_t n) {
    double x[kChunk], y[kChunk];
    load(a, start, n, x);
    load(b, start, n, y);
    apply_binary(op, x, y, n);
    store(out, start, n, x);
  });
}

void kernels::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  parallel_chunks(out.numel(), kChunk, [&](int64_t start, int64_t n) {
    double c[kChunk], x[kChunk], y[kChunk];
    load(cond, start, n, c);
    load(a, start, n, x);
    load(b, start, n, y);
    for (int64_t i = 0; i < n; ++i) x[i] = c[i] != 0.0 ? x[i] : y[i];
    store(out, start, n, x);
  });
}

}  // namespace kiln::cpu
