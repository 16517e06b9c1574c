// Fused optimizer and loss-scaler kernels on the CPU (the reference for the CUDA multi-tensor kernels).
// One pass over each tensor, in double, rounding once into each stored dtype.
#include <cmath>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/half.h>
#include <kiln/core/kernels/optim.h>

namespace kiln::cpu {

namespace {

template <class P, class S>
void adamw_typed(const Tensor& p_t, const Tensor& g_t, const Tensor& m_t, const Tensor& v_t, const AdamWHyper& h) {
  P* p = static_cast<P*>(p_t.raw_data());
  const P* g = static_cast<const P*>(g_t.raw_data());
  S* m = static_cast<S*>(m_t.raw_data());
  S* v = static_cast<S*>(v_t.raw_data());
  const double decay = 1.0 - h.lr * h.weight_decay, step_size = h.lr / h.bias_correction1;
  parallel_for(p_t.numel(), 8, [&](int64_t i) {
    double gi = double(g[i]);
    double mi = h.beta1 * double(m[i]) + (1.0 - h.beta1) * gi;
    double vi = h.beta2 * double(v[i]) + (1.0 - h.beta2) * gi * gi;
    m[i] = S(mi);
    v[i] = S(vi);
    double denom = std::sqrt(double(v[i])) / h.bias_correction2_sqrt + h.eps;
    p[i] = P(double(p[i]) * decay - step_size * double(m[i]) / denom);
  });
}

template <class P, class S>
void shampoo_moments_typed(const Tensor& g_t, const Tensor& m_t, const Tensor& v_t, const Tensor& f_t,
                           const Tensor& gr_t, const Tensor& gc_t, const Tensor& fc_t, const Tensor& sum_t,
                           const ShampooMomentsHyper& h) {
  // the copies' places (column-blocked: the gradient's k column blocks stacked)
  const ColumnBlocks at = gc_t.defined() || fc_t.defined() ? column_blocks(gc_t.defined() ? gc_t : fc_t, g_t)
                                                            : ColumnBlocks{};
  const P* g = static_cast<const P*>(g_t.raw_data());
  S* m = m_t.defined() ? static_cast<S*>(m_t.raw_data()) : nullptr;
  S* v = v_t.defined() ? static_cast<S*>(v_t.raw_data()) : nullptr;
  S* f = f_t.defined() ? static_cast<S*>(f_t.raw_data()) : nullptr;  // null: f only as its bf16 copy
  S* gr = gr_t.defined() ? static_cast<S*>(gr_t.raw_data()) : nullptr;
  BFloat16* gc = gc_t.defined() ? static_cast<BFloat16*>(gc_t.raw_data()) : nullptr;
  BFloat16* fc = fc_t.defined() ? static_cast<BFloat16*>(fc_t.raw_data()) : nullptr;
  // the grafted direction rounded to S, its sum of squares in f64 in the elements' order (sequential then)
  S* sum = sum_t.defined() ? static_cast<S*>(sum_t.raw_data()) : nullptr;
  auto element = [&](int64_t i) -> S {
    const double gi = double(g[i]);
    double fi = gi;
    if (m) {
      m[i] = S(h.beta1 * double(m[i]) + (1.0 - h.beta1) * gi);
      fi = double(m[i]) / h.bias_correction1;
    }
    const S f_state = S(fi);
    if (f) f[i] = f_state;
    if (gc) gc[at.offset(i)] = BFloat16(float(g[i]));  // g and f rounded once to bf16 (from P, and from S: as a cast does)
    if (fc) fc[at.offset(i)] = BFloat16(float(f_state));
    S direction = S(0);
    if (h.grafting == 3) {
      v[i] = S(h.grafting_beta2 * double(v[i]) + (1.0 - h.grafting_beta2) * gi * gi);
      direction = S(double(f_state) / (std::sqrt(double(v[i]) / h.grafting_bias_correction) + h.grafting_epsilon));
    } else if (h.grafting == 2) {
      v[i] = S(double(v[i]) + gi * gi);
      direction = S(double(f_state) / (std::sqrt(double(v[i])) + h.grafting_epsilon));
    }
    if (gr) gr[i] = direction;
    return direction;
  };
  if (!sum) {
    parallel_for(g_t.numel(), 8, [&](int64_t i) { element(i); });
    return;
  }
  double acc = 0;
  for (int64_t i = 0; i < g_t.numel(); ++i) {
    const double d = double(element(i));
    acc += d * d;
  }
  *sum = S(acc);
}

template <class P, class S>
void shampoo_apply_typed(const Tensor& p_t, const Tensor& d_t, const Tensor& b_t, const Tensor& s_t,
                         const ShampooApplyHyper& h) {
  P* p = static_cast<P*>(p_t.raw_data());
  const S* d = static_cast<const S*>(d_t.raw_data());
  S* b = b_t.defined() ? static_cast<S*>(b_t.raw_data()) : nullptr;
  const S* scale = s_t.defined() ? static_cast<const S*>(s_t.raw_data()) : nullptr;
  const ColumnBlocks at = column_blocks(d_t, p_t);  // column-blocked: block b's scale is scale[b]
  const double decay = 1.0 - h.lr * h.weight_decay;
  parallel_for(p_t.numel(), 4, [&](int64_t i) {
    const int64_t j = at.offset(i);
    const S s = !scale ? S(1) : at.count ? scale[j / (at.rows * at.cols)] : *scale;
    double di = scale ? double(S(s * d[j])) : double(d[j]);  // scaled in S, as a scaled copy would be
    if (b) {
      b[i] = S(h.momentum * double(b[i]) + di);
      di = h.nesterov ? di + h.momentum * double(b[i]) : double(b[i]);
    }
    p[i] = P(double(p[i]) * decay - h.lr * di);
  });
}

}  // namespace

void kernels::shampoo_moments(const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avgs,
                              const std::vector<Tensor>& grafting_states, const std::vector<Tensor>& filtered,
                              const std::vector<Tensor>& grafted, const std::vector<Tensor>& grad_copies,
                              const std::vector<Tensor>& filtered_copies, const std::vector<Tensor>& grafted_sums,
                              const ShampooMomentsHyper& h) {
  KILN_CHECK(!h.device_hyper, "shampoo_moments: device hyper-parameters (CUDA graphs) given to the CPU kernel");
  check_moments_copies(grads, filtered, grafted, grad_copies, filtered_copies, grafted_sums, h);
  const bool graft = h.grafting == 2 || h.grafting == 3;
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor m = h.beta1 > 0.0 ? exp_avgs[i] : Tensor(), v = graft ? grafting_states[i] : Tensor();
    const Tensor gr = graft ? grafted[i] : Tensor();
    const Tensor gc = grad_copies.empty() ? Tensor() : grad_copies[i];
    const Tensor fc = filtered_copies.empty() ? Tensor() : filtered_copies[i];
    const Tensor sum = grafted_sums.empty() ? Tensor() : grafted_sums[i];
    const DType state = (filtered[i].defined() ? filtered[i] : v).dtype();
    for (const Tensor& t : {m, v, gr, sum})  // (the GPU's launches check the state lists the same way)
      KILN_CHECK(!t.defined() || t.dtype() == state, "shampoo_moments: ", t.str(), " is not in the state dtype ",
                 dtype_name(state), " of gradient ", grads[i].str());
    if (state == DType::f64) {  // the state dtype
      KILN_DISPATCH_FLOATING(grads[i].dtype(), "shampoo_moments",
                             shampoo_moments_typed<scalar_t, double>(grads[i], m, v, filtered[i], gr, gc, fc, sum, h));
    } else {
      KILN_DISPATCH_FLOATING(grads[i].dtype(), "shampoo_moments",
                             shampoo_moments_typed<scalar_t, float>(grads[i], m, v, filtered[i], gr, gc, fc, sum, h));
    }
  }
}

void kernels::shampoo_apply(const std::vector<Tensor>& params, const std::vector<Tensor>& directions,
                            const std::vector<Tensor>& momentum_buffers, const std::vector<Tensor>& copies,
                            const std::vector<Tensor>& direction_scales, const ShampooApplyHyper& h) {
  KILN_CHECK(!h.device_hyper, "shampoo_apply: device hyper-parameters (CUDA graphs) given to the CPU kernel");
  KILN_CHECK(copies.empty() || copies.size() == params.size(), "shampoo_apply: ", copies.size(), " copies for ",
             params.size(), " parameters");
  check_apply_scales(params, directions, direction_scales);
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor b = h.momentum > 0.0 ? momentum_buffers[i] : Tensor();
    const Tensor s = direction_scales.empty() ? Tensor() : direction_scales[i];
    if (directions[i].dtype() == DType::f64) {
      KILN_DISPATCH_FLOATING(params[i].dtype(), "shampoo_apply",
                             shampoo_apply_typed<scalar_t, double>(params[i], directions[i], b, s, h));
    } else {
      KILN_DISPATCH_FLOATING(params[i].dtype(), "shampoo_apply",
                             shampoo_apply_typed<scalar_t, float>(params[i], directions[i], b, s, h));
    }
    if (!copies.empty() && copies[i].defined()) Tensor(copies[i]).copy_(params[i]);  // rounded as cast rounds
  }
}

void kernels::adamw_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                            const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                            const std::vector<Tensor>& copies, const AdamWHyper& h) {
  KILN_CHECK(!h.device_hyper, "adamw_step: device hyper-parameters (CUDA graphs) given to the CPU kernel");
  if (h.found_inf && *h.found_inf != 0.0f) return;  // a skipped step
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor &p = params[i], &g = grads[i], &m = exp_avgs[i], &v = exp_avg_sqs[i];
    if (m.dtype() == DType::f64) {
      KILN_DISPATCH_FLOATING(p.dtype(), "adamw_step", adamw_typed<scalar_t, double>(p, g, m, v, h));
    } else {
      KILN_DISPATCH_FLOATING(p.dtype(), "adamw_step", adamw_typed<scalar_t, float>(p, g, m, v, h));
    }
    if (!copies.empty() && copies[i].defined()) Tensor(copies[i]).copy_(p);  // rounded to nearest even, as cast
  }
}

void kernels::amp_unscale(const std::vector<Tensor>& tensors, const Tensor& inv_scale, const Tensor& found_inf) {
  double inv = double(*static_cast<const float*>(inv_scale.raw_data()));
  bool bad = false;
  for (const Tensor& t : tensors) {
    int64_t n = t.numel();
    for (int64_t s = 0; s < n; s += kChunk) {
      int64_t c = std::min(kChunk, n - s);
      double buf[kChunk];
      load(t, s, c, buf);
      for (int64_t i = 0; i < c; ++i) {
        bad |= !std::isfinite(buf[i]);
        buf[i] *= inv;
      }
      store(t, s, c, buf);
    }
  }
  if (bad) *static_cast<float*>(found_inf.raw_data()) = 1.0f;
}

}  // namespace kiln::cpu
