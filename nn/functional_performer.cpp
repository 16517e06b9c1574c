// Random-feature attention (Performer's FAVOR+, Choromanski et al. 2021; ../shared/ALGORITHMS.md,
// docs/sketched.md). Every op runs on both devices; three nodes have hand-written backwards (the softmax
// features, the causal chunks' products, the final ratio), checked against finite differences in f64.
//
// Features of x (..., T, D) through a projection Ω (m, D), with x' = x · D^(-1/4):
//   softmax kernel  φ(x) = m^(-1/2) · (exp(Ω x' − ‖x'‖²/2 − c) + 1e-5),   E[φ(q)ᵀφ(k)] ∝ exp(qᵀk / √D)
//   ReLU kernel     φ(x) = relu(m^(-1/2) · Ω x') + 1e-5
// The stabilizer c is, for queries, each row's max over the m features and, for keys, the max over the
// whole sequence and features of each head: a query's c scales its numerator and denominator alike, the
// keys' c scales every key alike, so both cancel in the output (up to the 1e-5).
//   non-causal  out = φ(Q) · (φ(K)ᵀ V) / (φ(Q) · Σ_j φ(k_j))
//   causal      out_t = φ(q_t)ᵀ S_t / φ(q_t)ᵀ z_t,  S_t = Σ_{j<=t} φ(k_j) v_jᵀ,  z_t = Σ_{j<=t} φ(k_j)
// The causal prefix sums run over chunks of C positions. V gets a column of ones (padded with zero columns
// to a multiple of 8, so rows stay 16-byte aligned for the GEMMs): [V | 1] carries the denominator through
// the numerator's own products, φ(K_c)ᵀ[V_c | 1] = [S_c | z_c], and no separate sum (with its copies and
// broadcast gradients) is needed. The chunks' own sums are one batched GEMM, their exclusive running sums
// over the chunks one exclusive cumsum (summed in f32), and within a chunk the C x C products with their
// upper triangle zeroed, times [V_c | 1]; the output is the numerator columns over the ones column.
// Time and memory are linear in T: the largest tensors are the features (T x m per head), the chunk states
// ((T / C) x m x D_p per head) and the chunks' products (T x C per head). C defaults to 128: at m = 256,
// D = 64 it measured faster than 256 and 64 on an H100 and an H200, at T = 8192 and 32768 (docs/sketched.md).
#include <algorithm>
#include <cmath>
#include <vector>

#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/index.h>
#include <kiln/core/kernels/random_features.h>
#include <kiln/core/op.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

namespace {

constexpr double kFeatureEps = 1e-5;

void check_projection(const Tensor& x, const Tensor& projection, const char* op) {
  KILN_CHECK(x.defined() && projection.defined(), op, ": undefined input or projection");
  KILN_CHECK(projection.dim() == 2 && x.dim() >= 2 && projection.size(1) == x.size(-1), op, ": projection ",
             projection.str(), " must be (m, D) for inputs ", x.str(), " of head dim D");
  KILN_CHECK(projection.device() == x.device() && is_floating(x.dtype()) && is_floating(projection.dtype()), op,
             ": expected floating inputs on one device, got ", x.str(), " and projection ", projection.str());
}

// The softmax-kernel features of p = x'·Ωᵀ (..., T, m), x' = s·x, as one node:
//   φ_ij = exp(p_ij − r_i) + offset,   r_i = s2·‖x_i‖²/2 + c_i + log_sqrt_m      (s2 = s²)
// with the stabilizer c_i the row's max of p (queries: per_row) or the max over the whole (T, m) of the row's
// head (keys). Forward: for queries one kernel (kernels::exp_features_rowmax); for keys the rows' statistics
// (max, its index, the norm) in one pass over p and x (kernels::feature_row_stats), each head's maximum of
// them, then exp_features. Backward, with dp = dφ·(φ − offset) and
// dr_i = −Σ_j dp_ij from exp_features_backward: dx_i = dr_i·s2·x_i, and each stabilizer's gradient, the sum of
// its rows' dr, added at the element of p it was taken from (its exact gradient, nonzero only through the
// offset, which the stabilizer does not scale); no (T, m) mask or gather is formed either way.
Tensor softmax_features(const Tensor& p_in, const Tensor& x_in, double s2, bool per_row, double log_sqrt_m,
                        double offset) {
  const DType ct = p_in.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor p = p_in.contiguous(), x = cast(x_in, p_in.dtype()).contiguous();
  const int64_t m = p.size(-1), D = x.size(-1), T = p.size(-2);
  const int64_t M = m > 0 ? p.numel() / m : 0, G = T > 0 ? M / T : 0;
  const TensorOptions c_opts{.dtype = ct, .device = p.device()}, i_opts{.dtype = DType::i64, .device = p.device()};
  Tensor out = empty(p.sizes(), {.dtype = p.dtype(), .device = p.device()});
  Tensor at_elem;  // where each stabilizer's element sits: its column in the row (M, 1), or its index in the
                   // head's (T·m) elements (G, 1)
  if (per_row) {  // one kernel: each row's statistics and its features
    NoGradGuard ng;
    const Tensor rowarg = empty({M}, i_opts);
    kernels::exp_features_rowmax(p.reshape({M, m}), x.reshape({M, D}), s2, log_sqrt_m, offset, out.reshape({M, m}),
                                 rowarg);
    at_elem = rowarg.reshape({M, 1});
  } else {
    NoGradGuard ng;
    Tensor rowmax = empty({M}, c_opts), rowarg = empty({M}, i_opts), h = empty({M}, c_opts);
    kernels::feature_row_stats(p.reshape({M, m}), x.reshape({M, D}), s2, rowmax, rowarg, h);
    const Tensor heads = rowmax.reshape({G, T});
    const Tensor at = argmax(heads, 1, true);  // (G, 1): the row of each head's maximum
    const Tensor r = add(add(h.reshape({G, T}), gather(heads, 1, at)), log_sqrt_m).reshape({M});
    at_elem = add(mul(at, double(m)), gather(rowarg.reshape({G, T}), 1, at));
    kernels::exp_features(p.reshape({M, m}), r, offset, out.reshape({M, m}));
  }
  if (any_requires_grad({p_in, x_in}))
    record("softmax_features", {p_in, x_in}, {out},
           [so = SavedTensor(out), sx = SavedTensor(x), at_elem, offset, s2, per_row, M, m, G, T, ct,
            xdt = x_in.dtype()](const Grads& g) {
             NoGradGuard ng;
             const Tensor y = so.unpack("softmax_features"), xs = sx.unpack("softmax_features");
             const TensorOptions o{.dtype = y.dtype(), .device = y.device()};
             Tensor dp = empty(y.sizes(), o), dr = empty({M}, {.dtype = ct, .device = y.device()});
             kernels::exp_features_backward(cast(g[0], y.dtype()).contiguous().reshape({M, m}), y.reshape({M, m}),
                                            offset, dp.reshape({M, m}), dr);
             const Tensor dc = per_row ? dr.reshape({M, 1}) : sum(dr.reshape({G, T}), {1}, true);
             kernels::scatter_add(per_row ? dp.reshape({M, m}) : dp.reshape({G, T * m}), 1, at_elem,
                                  cast(dc, dp.dtype()).contiguous());
             // dx = dr·s2·x in x's dtype, one pass (dr·s2 rounded to it first)
             Shape rows = xs.sizes();
             rows.back() = 1;
             const Tensor dx = cast(mul(xs, cast(mul(dr, s2), xs.dtype()).reshape(rows)), xdt);
             return Grads{dp, dx};
           });
  return out;
}

// kernels::bmm into a new (B, M, N) tensor of a's dtype and device.
Tensor bmm_into_new(const Tensor& a, const Tensor& b) {
  Tensor out = empty({a.size(0), a.size(1), b.size(2)}, {.dtype = a.dtype(), .device = a.device()});
  kernels::bmm(a, b, out);
  return out;
}

// The causal chunks' products as one node, for qc, kc (B3, C, m) and vc = [V | 1 | 0 ...] chunks (B3, C, Dp),
// B3 = BH·nc with a head's nc chunks consecutive, and M the (C, C) lower-triangular mask (keys j <= t):
//   S_c = kc_cᵀ·vc_c,  Sb = the exclusive running sum of S over a head's chunks,  A = (qc·kcᵀ) ⊙ M,
//   both = qc·Sb + A·vc                                                       (B3, C, Dp)
// Backward, with G = dboth: dA = (G·vcᵀ) ⊙ M, dS = the reverse exclusive running sum of qcᵀ·G, and
//   dqc = G·Sbᵀ + dA·kc,  dkc = dAᵀ·qc + vc·dSᵀ,  dvc = Aᵀ·G + kc·dS
// each second product added into the first's output by the GEMM (kernels::bmm_add) rather than by a pass of
// its own: autograd's composition accumulated qc, kc and vc's gradients with (T, m)-sized adds.
// The mask is applied in place (kernels::zero_above_diagonal: the upper triangle zeroed, nothing read).
Tensor causal_chunk_products(const Tensor& qc_in, const Tensor& kc_in, const Tensor& vc_in, int64_t BH, int64_t nc) {
  const Tensor qc = qc_in.contiguous(), kc = kc_in.contiguous(), vc = vc_in.contiguous();
  const int64_t B3 = qc.size(0), m = qc.size(2), Dp = vc.size(2);
  Tensor sb, a, both;
  {
    NoGradGuard ng;
    const Tensor states = bmm_into_new(kc.transpose(1, 2), vc).reshape({BH, nc, m, Dp});  // S_c
    sb = cumsum(states, 1, /*exclusive=*/true).reshape({B3, m, Dp});
    a = bmm_into_new(qc, kc.transpose(1, 2));
    kernels::zero_above_diagonal(a);
    both = bmm_into_new(qc, sb);
    kernels::bmm_add(a, vc, both, 1.0, 1.0);
  }
  if (any_requires_grad({qc_in, kc_in, vc_in}))
    record("causal_chunk_products", {qc_in, kc_in, vc_in}, {both},
           [sq = SavedTensor(qc), sk = SavedTensor(kc), sv = SavedTensor(vc), sb, a, BH, nc, B3, m,
            Dp](const Grads& g) {
             NoGradGuard ng;
             const char* op = "causal_chunk_products";
             const Tensor q = sq.unpack(op), k = sk.unpack(op), v = sv.unpack(op);
             const Tensor G = cast(g[0], q.dtype()).contiguous();
             const Tensor da = bmm_into_new(G, v.transpose(1, 2));
             kernels::zero_above_diagonal(da);
             const Tensor ds = cumsum(bmm_into_new(q.transpose(1, 2), G).reshape({BH, nc, m, Dp}), 1, true, true)
                                   .reshape({B3, m, Dp});
             Tensor dq = bmm_into_new(G, sb.transpose(1, 2)), dk = bmm_into_new(da.transpose(1, 2), q),
                    dv = bmm_into_new(a.transpose(1, 2), G);
             kernels::bmm_add(da, k, dq, 1.0, 1.0);
             kernels::bmm_add(v, ds.transpose(1, 2), dk, 1.0, 1.0);
             kernels::bmm_add(k, ds, dv, 1.0, 1.0);
             return Grads{dq, dk, dv};
           });
  return both;
}

// out (..., Dv) = both[..., :Dv] / both[..., Dv] for both (..., Dp), Dp > Dv: the numerators over the
// denominator column the ones column of [V | 1] carried (kernels::divide_by_column). Backward:
// dboth[..., :Dv] = g / den, dboth[..., Dv] = −Σ_j g_j·out_j / den, 0 in the padding columns.
Tensor divide_by_column(const Tensor& both_in, int64_t Dv) {
  const Tensor both = both_in.contiguous();
  const int64_t Dp = both.size(-1), M = Dp > 0 ? both.numel() / Dp : 0;
  Shape s = both.sizes();
  s.back() = Dv;
  Tensor out = empty(s, {.dtype = both.dtype(), .device = both.device()});
  {
    NoGradGuard ng;
    kernels::divide_by_column(both.reshape({M, Dp}), out.reshape({M, Dv}));
  }
  if (any_requires_grad({both_in}))
    record("divide_by_column", {both_in}, {out},
           [sb = SavedTensor(both), so = SavedTensor(out), M, Dp, Dv](const Grads& g) {
      NoGradGuard ng;
      const Tensor b = sb.unpack("divide_by_column"), y = so.unpack("divide_by_column");
      Tensor db = empty(b.sizes(), {.dtype = b.dtype(), .device = b.device()});
      kernels::divide_by_column_backward(cast(g[0], y.dtype()).contiguous().reshape({M, Dv}), b.reshape({M, Dp}),
                                         y.reshape({M, Dv}), db.reshape({M, Dp}));
      return Grads{db};
    });
  return out;
}

}  // namespace

Tensor orthogonal_random_projection(int64_t m, int64_t d, Generator* gen, const TensorOptions& options) {
  KILN_CHECK(m > 0 && d > 0, "orthogonal_random_projection: m and d must be positive, got ", m, " and ", d);
  // Blocks of d orthonormal rows (Gram-Schmidt, twice for accuracy, in f64 on the CPU: d is a head size)
  // from Gaussian matrices, the last block cut to m mod d rows; then each row scaled to the norm of a
  // d-dimensional Gaussian vector, so every row is marginally N(0, I) and rows of a block are orthogonal.
  NoGradGuard ng;
  const Tensor g = randn({m + d - 1 - (m - 1) % d, d}, {.dtype = DType::f64}, gen);  // whole blocks
  std::vector<double> a = g.to_vector<double>();
  const int64_t rows = g.size(0);
  for (int64_t b = 0; b < rows; b += d)
    for (int64_t i = b; i < b + d; ++i)
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t j = b; j < i; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += a[size_t(i * d + c)] * a[size_t(j * d + c)];
          for (int64_t c = 0; c < d; ++c) a[size_t(i * d + c)] -= dot * a[size_t(j * d + c)];
        }
        double n2 = 0;
        for (int64_t c = 0; c < d; ++c) n2 += a[size_t(i * d + c)] * a[size_t(i * d + c)];
        const double inv = 1.0 / std::sqrt(n2);
        for (int64_t c = 0; c < d; ++c) a[size_t(i * d + c)] *= inv;
      }
  // row norms: ‖z‖ for z ~ N(0, I_d)
  const std::vector<double> z = randn({m, d}, {.dtype = DType::f64}, gen).to_vector<double>();
  for (int64_t i = 0; i < m; ++i) {
    double n2 = 0;
    for (int64_t c = 0; c < d; ++c) n2 += z[size_t(i * d + c)] * z[size_t(i * d + c)];
    for (int64_t c = 0; c < d; ++c) a[size_t(i * d + c)] *= std::sqrt(n2);
  }
  a.resize(size_t(m * d));
  return from_vector(a, {m, d}).to(options.device, options.dtype);
}

Tensor random_features(const Tensor& x, const Tensor& projection, RandomFeatureKernel kernel, bool is_query) {
  check_projection(x, projection, "random_features");
  const int64_t m = projection.size(0), D = x.size(-1);
  const double s = std::pow(double(D), -0.25);
  // Ω x' in the GEMM's dtype (the autocast dtype under autocast), the rest in f32 (f64 for f64); x' = s·x
  // is never formed: the scale goes on the (m, D) projection, and ‖x'‖² = s²‖x‖².
  const Tensor proj = matmul(x, mul(projection, s).t());
  if (kernel == RandomFeatureKernel::relu) {
    const DType wide = proj.dtype() == DType::f64 ? DType::f64 : DType::f32;
    return add(kiln::relu(mul(cast(proj, wide), 1.0 / std::sqrt(double(m)))), kFeatureEps);
  }
  return softmax_features(proj, x, s * s, is_query, 0.5 * std::log(double(m)), kFeatureEps / std::sqrt(double(m)));
}

Tensor performer_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& projection, bool causal,
                           RandomFeatureKernel kernel, int64_t chunk) {
  const char* op = "performer_attention";
  KILN_CHECK(q.defined() && k.defined() && v.defined(), op, ": q, k and v must be defined");
  KILN_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), op, ": expected q, k, v of shape (..., T, D), got ",
             q.str(), ", ", k.str(), ", ", v.str());
  KILN_CHECK(k.size(-1) == q.size(-1) && k.size(-2) == v.size(-2), op, ": q ", q.str(), ", k ", k.str(), ", v ", v.str(),
             " must share the head dim (q, k) and the key length (k, v)");
  KILN_CHECK(std::equal(q.sizes().begin(), q.sizes().end() - 2, k.sizes().begin()) &&
                 std::equal(q.sizes().begin(), q.sizes().end() - 2, v.sizes().begin()),
             op, ": q ", q.str(), ", k ", k.str(), ", v ", v.str(), " must share their leading dims");
  KILN_CHECK(!causal || q.size(-2) == k.size(-2), op, ": causal attention needs as many queries as keys, got ", q.str(),
             " and ", k.str());
  KILN_CHECK(chunk > 0, op, ": chunk must be positive, got ", chunk);
  KILN_CHECK(q.device() == k.device() && q.device() == v.device(), op, ": q, k, v on different devices");
  check_projection(q, projection, op);
  const Tensor fq = random_features(q, projection, kernel, true), fk = random_features(k, projection, kernel, false);
  // The GEMMs in the inputs' dtype (the autocast dtype under autocast).
  const DType t = amp::is_enabled(q.device().type) ? amp::dtype(q.device().type) : promote_types(q.dtype(), v.dtype());
  const Tensor qf = cast(fq, t), kf = cast(fk, t), vt = cast(v, t);
  Tensor num, den;  // (..., T, Dv) and (..., T, 1): numerator and denominator, each contiguous
  if (!causal) {
    num = matmul(qf, matmul(kf.transpose(-2, -1), vt));
    den = matmul(qf, sum(kf, {-2}, true).transpose(-2, -1));
  } else {
    const int64_t T = q.size(-2), nc = (T + chunk - 1) / chunk, Tp = nc * chunk;
    Shape lead(q.sizes().begin(), q.sizes().end() - 2);
    const int64_t BH = shape_numel(lead);
    // (BH, nc, C, ·), zero rows padding T to a whole chunk (a zero key feature adds nothing)
    auto chunks = [&](const Tensor& x) {
      Tensor x3 = x.reshape({BH, T, x.size(-1)});
      if (Tp != T) x3 = cat({x3, zeros({BH, Tp - T, x.size(-1)}, {.dtype = x.dtype(), .device = x.device()})}, 1);
      return x3.reshape({BH, nc, chunk, x.size(-1)});
    };
    // [V | 1 | 0 ...] (..., T, Dp)
    const int64_t Dv = v.size(-1), Dp = (Dv + 1 + 7) / 8 * 8;
    Tensor pad;
    {
      NoGradGuard ng;
      Shape ps = vt.sizes();
      ps.back() = Dp - Dv;
      pad = zeros(ps, {.dtype = t, .device = q.device()});
      pad.narrow(-1, 0, 1).fill_(1.0);
    }
    auto chunk3 = [&](const Tensor& x) { return chunks(x).reshape({BH * nc, chunk, x.size(-1)}); };
    // Each chunk's φ(K)ᵀ[V | 1] = [S | z] (m, Dp); their sums over the chunks before (one exclusive running
    // sum over the T / C chunks, in f32); within a chunk, keys j <= t, the C x C products with their upper
    // triangle zeroed; then [numerator | denominator | 0 ...] of every position, (BH, Tp, Dp), and their ratio.
    Tensor both =
        causal_chunk_products(chunk3(qf), chunk3(kf), chunk3(cat({vt, pad}, -1)), BH, nc).reshape({BH, Tp, Dp});
    if (Tp != T) both = both.narrow(1, 0, T);
    Shape s = lead;
    s.push_back(T);
    s.push_back(Dv);
    return divide_by_column(both, Dv).reshape(s);
  }
  return div(num, den);
}

}  // namespace kiln::nn::functional
