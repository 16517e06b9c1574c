// Random-feature attention (Performer's FAVOR+, Choromanski et al. 2021; ../shared/ALGORITHMS.md,
// docs/sketched.md), composed of differentiable ops: every gradient is autograd's, and every op runs on
// both devices.
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
// over the chunks the cumsum kernel (in f32), and within a chunk the masked C x C products times [V_c | 1].
// Time and memory are linear in T: the largest tensors are the
// features (T x m per head) and the chunk states ((T / C) x m x D_p per head). C defaults to 256: on an H200
// at m = 256, D = 64 it measured faster than 128 and 64 at T = 8192 (2.76 against 3.08 and 3.87 ms) and
// 32768 (9.44 against 10.8 and 13.9 ms), with less memory: the states shrink as C grows while the C x C
// products grow (docs/sketched.md).
#include <algorithm>
#include <cmath>
#include <vector>

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

// exp(p − r) + offset, r (..., T, 1) one value per row, as one node (kernels::exp_features): out in p's dtype,
// computed in f32 (f64 for f64); backward dp = dout · (out − offset), dr = −Σ_row dp.
Tensor exp_features(const Tensor& p_in, const Tensor& r_in, double offset) {
  const DType ct = p_in.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor p = p_in.contiguous(), r = cast(r_in, ct).contiguous();
  const int64_t m = p.size(-1), M = m > 0 ? p.numel() / m : 0;
  KILN_CHECK(r.numel() == M, "exp_features: one row value per row of ", p.str(), ", got ", r.str());
  Tensor out = empty(p.sizes(), {.dtype = p.dtype(), .device = p.device()});
  {
    NoGradGuard ng;
    kernels::exp_features(p.reshape({M, m}), r.reshape({M}), offset, out.reshape({M, m}));
  }
  if (any_requires_grad({p, r}))
    record("exp_features", {p, r}, {out},
           [so = SavedTensor(out), offset, M, m, rshape = r.sizes(), ct](const Grads& g) {
             const Tensor y = so.unpack("exp_features");
             const TensorOptions o{.dtype = y.dtype(), .device = y.device()};
             Tensor dp = empty(y.sizes(), o), dr = empty({M}, {.dtype = ct, .device = y.device()});
             kernels::exp_features_backward(cast(g[0], y.dtype()).contiguous().reshape({M, m}), y.reshape({M, m}), offset,
                                            dp.reshape({M, m}), dr);
             return Grads{dp, dr.reshape(rshape)};
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
  const Tensor xs = mul(x, std::pow(double(D), -0.25));
  // Ω x' in the GEMM's dtype (the autocast dtype under autocast), the rest in f32 (f64 for f64).
  const Tensor proj = matmul(xs, projection.t());
  const DType wide = proj.dtype() == DType::f64 ? DType::f64 : DType::f32;
  if (kernel == RandomFeatureKernel::relu)
    return add(kiln::relu(mul(cast(proj, wide), 1.0 / std::sqrt(double(m)))), kFeatureEps);
  const Tensor xw = cast(xs, wide);
  const Tensor half_norm = mul(sum(mul(xw, xw), {-1}, true), 0.5);
  // The stabilizer c: a query row's max over its m features, the max over a key head's whole (T, m). Taken
  // by gather at the argmax, so that its exact gradient (nonzero only through the 1e-5) goes to the one
  // element it came from; amax's backward would build full-size masks for it.
  const int64_t T = proj.size(-2);
  const Tensor rows = is_query ? proj.reshape({-1, m}) : proj.reshape({-1, T * m});
  Tensor index;
  {
    NoGradGuard ng;
    index = argmax(rows, 1, true);
  }
  Shape c_shape = proj.sizes();
  c_shape.back() = 1;
  if (!is_query) c_shape[c_shape.size() - 2] = 1;
  const Tensor stabilizer = gather(rows, 1, index).reshape(c_shape);
  // m^(-1/2) · (exp(p − h − c) + ε) = exp(p − r) + ε/√m with r = h + c + ln √m one value per row: the (T, m)
  // features are one pass over the projection, forward and backward (kernels::exp_features).
  const Tensor r = add(add(half_norm, cast(stabilizer, wide)), 0.5 * std::log(double(m)));
  return exp_features(proj, r, kFeatureEps / std::sqrt(double(m)));
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
    const Tensor qc = chunks(qf), kc = chunks(kf), vc = chunks(cat({vt, pad}, -1));
    // Each chunk's φ(K)ᵀ[V | 1] = [S | z] (m, Dp); their sums over the chunks before, in f32 (the running
    // sums over T / C chunks), then back in the GEMMs' dtype.
    const DType wide = t == DType::f64 ? DType::f64 : DType::f32;
    auto before = [&](const Tensor& per_chunk) {
      const Tensor x = cast(per_chunk, wide);
      return cast(sub(cumsum(x, 1), x), t);
    };
    const Tensor state_before = before(matmul(kc.transpose(-2, -1), vc));  // (BH, nc, m, Dp)
    // this chunk, keys j <= t: the C x C products times a constant lower-triangular mask (a broadcast
    // multiply, forward and backward, where tril would select through a bool mask each way)
    Tensor causal_mask;
    {
      NoGradGuard ng;
      causal_mask = tril(ones({chunk, chunk}, {.dtype = t, .device = q.device()}));
    }
    const Tensor a = mul(matmul(qc, kc.transpose(-2, -1)), causal_mask);  // (BH, nc, C, C)
    // [numerator | denominator | 0 ...] of every position: (BH, Tp, Dp)
    Tensor both = add(matmul(qc, state_before), matmul(a, vc)).reshape({BH, Tp, Dp});
    if (Tp != T) both = both.narrow(1, 0, T);
    Shape s = lead;
    s.push_back(T);
    s.push_back(Dp);
    both = both.reshape(s);
    // contiguous operands for the division (a strided one would take the generic strided kernel)
    num = both.narrow(-1, 0, Dv).contiguous();
    den = both.narrow(-1, Dv, 1).contiguous();
  }
  return div(num, den);
}

}  // namespace kiln::nn::functional
