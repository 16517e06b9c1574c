// Elementwise CPU kernels: copy/cast, fill, unary, binary, where, random. Each walks the output in
// chunks, converts operands to double, applies the op, and rounds once into the output dtype.
#include <cmath>
#include <cstring>

#include <kiln/core/cpu/cpu_backend.h>
#include <kiln/core/cpu/strided.h>

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

// The value v takes once stored in dtype t.
double rounded(DType t, double v) {
  switch (t) {
    case DType::f32: return double(float(v));
    case DType::f16: return double(float(Half(float(v))));
    case DType::bf16: return double(float(BFloat16(float(v))));
    default: return v;
  }
}

}  // namespace

void CpuBackend::copy(const Tensor& src, const Tensor& dst) const {
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

void CpuBackend::fill(const Tensor& dst, double value) const {
  parallel_chunks(dst.numel(), kChunk, [&](int64_t start, int64_t n) {
    double buf[kChunk];
    for (int64_t i = 0; i < n; ++i) buf[i] = value;
    store(dst, start, n, buf);
  });
}

void CpuBackend::unary(UnaryOp op, const Tensor& in, const Tensor& out, double p0, double p1) const {
  parallel_chunks(out.numel(), kChunk, [&](int64_t start, int64_t n) {
    double buf[kChunk];
    load(in, start, n, buf);
    apply_unary(op, buf, n, p0, p1);
    store(out, start, n, buf);
  });
}

void CpuBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) const {
  parallel_chunks(out.numel(), kChunk, [&](int64_t start, int64_t n) {
    double x[kChunk], y[kChunk];
    load(a, start, n, x);
    load(b, start, n, y);
    apply_binary(op, x, y, n);
    store(out, start, n, x);
  });
}

void CpuBackend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) const {
  parallel_chunks(out.numel(), kChunk, [&](int64_t start, int64_t n) {
    double c[kChunk], x[kChunk], y[kChunk];
    load(cond, start, n, c);
    load(a, start, n, x);
    load(b, start, n, y);
    for (int64_t i = 0; i < n; ++i) x[i] = c[i] != 0.0 ? x[i] : y[i];
    store(out, start, n, x);
  });
}

void CpuBackend::random(const Tensor& out, Distribution dist, double a, double b, uint64_t seed, uint64_t offset) const {
  const DType dt = out.dtype();
  const double top = dist == Distribution::uniform && b > a ? largest_below(dt, b) : b;
  parallel_chunks(out.numel(), kChunk, [&](int64_t start, int64_t n) {
    double buf[kChunk];
    for (int64_t i = 0; i < n; ++i) {
      uint64_t e = uint64_t(start + i);
      if (dist == Distribution::uniform) {
        uint32_t w = philox4x32(offset + e / 4, seed)[e % 4];
        buf[i] = a + (b - a) * double(uint_to_unit_float(w));
        // u < 1, but rounding into a narrow dtype (bf16 keeps 8 bits) can still give b
        if (b > a && rounded(dt, buf[i]) >= b) buf[i] = top;
      } else {
        // Box-Muller on two words: u1 in (0, 1] so the log is finite.
        auto w = philox4x32(offset + e / 2, seed);
        uint32_t w1 = w[2 * (e % 2)], w2 = w[2 * (e % 2) + 1];
        double u1 = (double(w1 >> 8) + 1.0) * (1.0 / 16777216.0);
        double u2 = double(w2 >> 8) * (1.0 / 16777216.0);
        buf[i] = a + b * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
      }
    }
    store(out, start, n, buf);
  });
}

Backend& cpu_backend() {
  static CpuBackend instance;
  return instance;
}

}  // namespace kiln::cpu
