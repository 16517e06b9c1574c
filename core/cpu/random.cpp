// Random numbers on the CPU from the same Philox stream as the GPU (core/random.h).
#include <cmath>
#include <cstring>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/random.h>

namespace kiln::cpu {

namespace {

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

void kernels::random(const Tensor& out, Distribution dist, double a, double b, const PhiloxDraw& draw) {
  KILN_CHECK(!draw.replay_base, "random: a CUDA graph's draw given to the CPU kernel (", out.str(), ")");
  const uint64_t seed = draw.seed, offset = draw.offset;
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

}  // namespace kiln::cpu
