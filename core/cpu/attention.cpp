// Scaled-dot-product attention on the CPU: the reference the GPU's flash-attention kernels are tested
// against (the math, the layouts and the dropout mask are stated at kernels::attention_forward (core/kernels/attention.h)). Every
// product and sum is in double; one query row (forward) or one (b, h) head (backward) per task, so results
// never depend on the number of threads. Backward recomputes the probabilities from the saved lse.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/attention.h>
#include <kiln/core/random.h>

namespace kiln::cpu {

namespace {

template <class T>
using stat_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Rows of a (B, H, T, D) view with unit stride on D.
template <class T>
struct Rows {
  T* base;
  int64_t sb, sh, st, H;
  Rows(const Tensor& t) // NOLINT(google-explicit-constructor)
      : base(static_cast<T*>(t.raw_data())), sb(t.stride(0)), sh(t.stride(1)), st(t.stride(2)), H(t.size(1)) {}
  T* row(int64_t bh, int64_t i) const { return base + (bh / H) * sb + (bh % H) * sh + i * st; }
};

// The dropout mask of kernels::attention_forward (core/kernels/attention.h): 1/(1-p) where kept, 0 where dropped, 1 without dropout.
struct DropoutMask {
  double p;
  uint64_t seed, offset;
  int64_t Tq, Tk;
  float keep_below;
  DropoutMask(double p_, uint64_t s, uint64_t o, int64_t tq, int64_t tk)
      : p(p_), seed(s), offset(o), Tq(tq), Tk(tk), keep_below(float(1.0 - p_)) {}
  double operator()(int64_t bh, int64_t i, int64_t j) const {
    if (p <= 0.0) return 1.0;
    uint64_t block = offset + uint64_t((bh * Tq + i) * ((Tk + 3) / 4) + j / 4);
    uint32_t w = philox4x32(block, seed)[size_t(j % 4)];
    return uint_to_unit_float(w) < keep_below ? 1.0 / (1.0 - p) : 0.0;
  }
};

// The additive score bias of kernels::attention_forward: 0 without one.
template <class S>
struct ScoreBias {
  const S* base = nullptr;
  int64_t sb = 0, sh = 0, sq = 0, sk = 0, H = 1;
  ScoreBias(const Tensor& t) {  // NOLINT(google-explicit-constructor)
    if (!t.defined()) return;
    base = static_cast<const S*>(t.raw_data());
    sb = t.stride(0), sh = t.stride(1), sq = t.stride(2), sk = t.stride(3), H = t.size(1);
  }
  double operator()(int64_t bh, int64_t i, int64_t j) const {
    return base ? double(base[(bh / H) * sb + (bh % H) * sh + i * sq + j * sk]) : 0.0;
  }
};

// AttentionMask's block-sparse layout: whether query i may see key j (always, without a layout).
struct LiveBlocks {
  const bool* layout = nullptr;
  int64_t cols = 0, block = 0;
  explicit LiveBlocks(const AttentionMask& m) {
    if (m.block == 0) return;
    layout = m.layout.data_ptr<bool>(), cols = m.layout.size(1), block = m.block;
  }
  bool operator()(int64_t i, int64_t j) const { return !layout || layout[(i / block) * cols + j / block]; }
};

template <class T>
void forward_impl(const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& bias_t, const Tensor& out_t,
                  const Tensor& lse_t, const AttentionMask& attend, double scale, const DropoutMask& mask) {
  using S = stat_t<T>;
  const ScoreBias<S> bias(bias_t);
  const LiveBlocks live(attend);
  const int64_t BH = q_t.size(0) * q_t.size(1), Tq = q_t.size(2), Tk = k_t.size(2), D = q_t.size(3);
  Rows<const T> q(q_t), k(k_t), v(v_t);
  Rows<T> out(out_t);
  S* lse = static_cast<S*>(lse_t.raw_data());
  parallel_for(BH * Tq, Tk * D, [&](int64_t r) {
    // the keys query i sees: [j0, j1) (s is indexed from j0)
    const int64_t bh = r / Tq, i = r % Tq, j0 = attend.key_begin(i), j1 = std::max(j0, attend.key_end(i, Tk));
    std::vector<double> s(size_t(std::max<int64_t>(j1 - j0, 1))), acc(size_t(D), 0.0);
    const T* qi = q.row(bh, i);
    double m = -INFINITY;
    for (int64_t j = j0; j < j1; ++j) {
      if (!live(i, j)) {
        s[size_t(j - j0)] = -INFINITY;
        continue;
      }
      const T* kj = k.row(bh, j);
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += double(qi[d]) * double(kj[d]);
      s[size_t(j - j0)] = dot * scale + bias(bh, i, j);
      m = std::max(m, s[size_t(j - j0)]);
    }
    if (m == -INFINITY) {  // every key masked: O = 0, lse = +inf
      T* oi = out.row(bh, i);
      for (int64_t d = 0; d < D; ++d) oi[d] = T(0);
      lse[r] = S(INFINITY);
      return;
    }
    double l = 0;
    for (int64_t j = j0; j < j1; ++j) l += std::exp(s[size_t(j - j0)] - m);
    const double lse_i = m + std::log(l);
    for (int64_t j = j0; j < j1; ++j) {
      double pz = std::exp(s[size_t(j - j0)] - lse_i) * mask(bh, i, j);
      if (pz == 0.0) continue;
      const T* vj = v.row(bh, j);
      for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += pz * double(vj[d]);
    }
    T* oi = out.row(bh, i);
    for (int64_t d = 0; d < D; ++d) oi[d] = T(acc[size_t(d)]);
    lse[r] = S(lse_i);
  });
}

template <class T>
void backward_impl(const Tensor& do_t, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& bias_t,
                   const Tensor& out_t, const Tensor& lse_t, const Tensor& dq_t, const Tensor& dk_t, const Tensor& dv_t,
                   const AttentionMask& attend, double scale, const DropoutMask& mask) {
  using S = stat_t<T>;
  const ScoreBias<S> bias(bias_t);
  const LiveBlocks live(attend);
  const int64_t BH = q_t.size(0) * q_t.size(1), Tq = q_t.size(2), Tk = k_t.size(2), D = q_t.size(3);
  Rows<const T> dout(do_t), q(q_t), k(k_t), v(v_t), out(out_t);
  Rows<T> dq(dq_t), dk(dk_t), dv(dv_t);
  const S* lse = static_cast<const S*>(lse_t.raw_data());
  parallel_for(BH, Tq * Tk * D, [&](int64_t bh) {
    std::vector<double> dk_acc(size_t(Tk * D), 0.0), dv_acc(size_t(Tk * D), 0.0), dq_acc(size_t(D), 0.0);
    for (int64_t i = 0; i < Tq; ++i) {
      const T *qi = q.row(bh, i), *doi = dout.row(bh, i), *oi = out.row(bh, i);
      const double lse_i = double(lse[bh * Tq + i]);
      double Di = 0;  // D_i = Σ_d dO_id O_id
      for (int64_t d = 0; d < D; ++d) Di += double(doi[d]) * double(oi[d]);
      std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
      for (int64_t j = attend.key_begin(i), j1 = attend.key_end(i, Tk); j < j1; ++j) {
        if (!live(i, j)) continue;
        const T *kj = k.row(bh, j), *vj = v.row(bh, j);
        double dot = 0, dp = 0;
        for (int64_t d = 0; d < D; ++d) {
          dot += double(qi[d]) * double(kj[d]);
          dp += double(doi[d]) * double(vj[d]);
        }
        const double p = std::exp(dot * scale + bias(bh, i, j) - lse_i), z = mask(bh, i, j);
        const double ds = p * (dp * z - Di);  // dS = P ⊙ (dP - D_i), dP = (dO Vᵀ) ⊙ Z
        double* dkj = &dk_acc[size_t(j * D)];
        double* dvj = &dv_acc[size_t(j * D)];
        for (int64_t d = 0; d < D; ++d) {
          dq_acc[size_t(d)] += ds * double(kj[d]);
          dkj[d] += ds * double(qi[d]);
          dvj[d] += p * z * double(doi[d]);
        }
      }
      T* dqi = dq.row(bh, i);
      for (int64_t d = 0; d < D; ++d) dqi[d] = T(scale * dq_acc[size_t(d)]);
    }
    for (int64_t j = 0; j < Tk; ++j) {
      T *dkj = dk.row(bh, j), *dvj = dv.row(bh, j);
      for (int64_t d = 0; d < D; ++d) {
        dkj[d] = T(scale * dk_acc[size_t(j * D + d)]);
        dvj[d] = T(dv_acc[size_t(j * D + d)]);
      }
    }
  });
}

}  // namespace

void kernels::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias,
                                const Tensor& out, const Tensor& lse, const AttentionMask& attend, double scale,
                                double dropout_p,
                                const PhiloxDraw& dropout_rng) {
  KILN_CHECK(!dropout_rng.replay_base, "attention_forward: a CUDA graph's draw given to the CPU kernel");
  DropoutMask mask(dropout_p, dropout_rng.seed, dropout_rng.offset, q.size(2), k.size(2));
  KILN_DISPATCH_FLOATING(q.dtype(), "attention_forward",
                         forward_impl<scalar_t>(q, k, v, bias, out, lse, attend, scale, mask));
}

void kernels::attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& bias, const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                 const Tensor& dv, const AttentionMask& attend, double scale, double dropout_p,
                                 const PhiloxDraw& dropout_rng) {
  KILN_CHECK(!dropout_rng.replay_base, "attention_backward: a CUDA graph's draw given to the CPU kernel");
  DropoutMask mask(dropout_p, dropout_rng.seed, dropout_rng.offset, q.size(2), k.size(2));
  KILN_DISPATCH_FLOATING(q.dtype(), "attention_backward",
                         backward_impl<scalar_t>(dout, q, k, v, bias, out, lse, dq, dk, dv, attend, scale, mask));
}

}  // namespace kiln::cpu
