// Matrix functions (core/linalg.h): the symmetric eigendecomposition through the linalg kernels, and the
// inverse p-th roots composed from it or from batched GEMMs (the coupled Newton iteration).
#include <kiln/core/linalg.h>
#include <kiln/cuda/runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/error.h>
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/linalg.h>
#include <kiln/core/ops.h>

namespace kiln::linalg {

namespace {

// finite: also a pass over a (and a wait for it) that every element is finite
void check_matrices(const char* op, const Tensor& a, bool finite = true) {
  KILN_CHECK(a.defined(), op, ": the input is an undefined tensor");
  KILN_CHECK(a.dim() >= 2 && a.size(-1) == a.size(-2), op, ": expected square matrices (..., n, n), got ", a.str());
  KILN_CHECK(a.dtype() == DType::f32 || a.dtype() == DType::f64, op, ": expected f32 or f64 matrices, got ", a.str());
  KILN_CHECK(!(autograd::is_grad_enabled() && a.requires_grad()), op, ": has no backward, but ", a.str(),
             " requires grad; call it under NoGradGuard or on a detached tensor");
  KILN_CHECK(!finite || a.numel() == 0 || all_true(isfinite(a)), op, ": the input ", a.str(),
             " has non-finite elements");
}

Shape batch_shape(const Tensor& a) { return Shape(a.sizes().begin(), a.sizes().end() - 2); }

int64_t count(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape with(Shape s, std::initializer_list<int64_t> tail) {
  s.insert(s.end(), tail);
  return s;
}

// The eigen method's lift of eigenvalues (b, n) of a + ε·I: λ ← λ + (ε − λ_min) where λ_min < ε, per matrix.
Tensor lift_eigenvalues(const Tensor& values, double epsilon) {
  return add(values, clamp(rsub(amin(values, {-1}, /*keepdim=*/true), epsilon), 0.0, INFINITY));
}

// V·diag(λ^(−1/p))·Vᵀ for eigenpairs (λ, V) of a + ε·I, batched (b, n) and (b, n, n), V's columns the
// vectors, λ lifted (lift_eigenvalues).
Tensor root_from_eigenpairs(const Tensor& values, const Tensor& vectors, double p, double epsilon) {
  const Tensor scale = pow(lift_eigenvalues(values, epsilon), -1.0 / p);
  return matmul(mul(vectors, scale.unsqueeze(-2)), vectors.transpose(-2, -1));
}

// ⌈log2 sqrt(n)⌉: the least k with 4^k >= n (|x| ≤ sqrt(n)·max of a sum of n products of unit-norm columns)
int log2_sqrt_ceil(int64_t n) {
  int k = 0;
  while ((int64_t(1) << (2 * k)) < n) ++k;
  return k;
}

// B = qᵀ·a·q for (b, n, n) a and q, as B_k = coupled_k·scales_k (scales undefined: 1).
struct Rayleigh {
  Tensor coupled, scales;
  Tensor q16;  // split: q·2^13 in f16 (q's split), for the roots' products (kept_root_products_f16)
};

// qᵀ·a·q for (b, n, n) a and q. In the matrices' dtype, TF32 off: one TF32 pass (~1e-3 of λ_max) would drown
// the small Rayleigh quotients that the roots raise to −1/p, and the coupling ρ divides by. split (f32 on a
// GPU): T = a·q as three f16 products of split operands (kernels::split_f16), about f32's accuracy (2^-22 of
// the terms' size) at twice the TF32 rate, as one product over K = 3n of the concatenated operands
// [a_lo | a_hi | a_hi]·[q_hi; q_lo; q_hi] (one pass over T where three accumulating products took three). The
// scales that put the operands in f16's range: a's s_k from its largest diagonal entry (a PSD matrix has no
// larger entry; one ~4x larger still fits, and a matrix that overflows has a non-finite B, which refreshes
// it), q's 2^13 from its bound 1 (a basis' unit columns; one that is not is refreshed by its column norms).
// T is written in f16 under the common factor 2^-(13 + ⌈log2 sqrt n⌉): |T_ij| ≤ ‖a_i‖ ≤ sqrt(a_ii·tr a) ≤
// sqrt(n)·max a_ii for a PSD a, so T·s_k·2^13 times it stays under 2^14, and each matrix keeps its own scale
// (T's columns for the quotients at the n·u·λ_max floor stay in f16's normal range). Then qᵀ·T as one f16
// product of q·2^13 and T, both rounded to nearest as TF32 would be (11 bits), with f32 accumulation; the
// common factors are undone by its alpha and s_k is left for the caller (B = coupled / s_k: kept_basis_expansion
// takes it as it reads B). That product is not symmetric: its entry (i, j) = q_iᵀ·T_j is off by
// ~2^-11·‖T_j‖/sqrt(n), and T_j = a·q_j is ~λ_j·q_j, so each pair's entry in the column of the smaller quotient
// is about as accurate as f32 products' in the units ΔB_ij/sqrt(λ_i·λ_j) that ρ and the root follow (a CPU
// emulation, n 256..1024, condition 1e3..1e8: largest 6e-5..1e-4, where three TF32 products gave ~1e-5 and the
// f32 products measured on the GPU 2-6e-4). The caller reads that entry (kernels::kept_basis_expansion's pick).
// Three TF32 products for T took a fifth of a GPT-2 root step (5.2 of 21 ms on an H200), and the second
// product on TF32 needed T and q rounded in passes of their own.
Rayleigh rayleigh_matrix(const Tensor& a3, const Tensor& q, bool split) {
  if (!split) {
    const cuda::AllowTf32Guard exact(true, false);
    Rayleigh products;
    products.coupled = matmul(q.transpose(-2, -1), matmul(a3, q));
    return products;
  }
  const int64_t b = a3.size(0), n = a3.size(-1);
  const TensorOptions f32{.dtype = DType::f32, .device = a3.device()};
  const TensorOptions f16{.dtype = DType::f16, .device = a3.device()};
  const Tensor a_scales = empty({b}, f32), q_scales = empty({b}, f32);
  const Tensor q_split = empty({b, 3 * n, n}, f16);
  const double alpha = std::ldexp(1.0, -(13 + log2_sqrt_ceil(n)));
  const Tensor t16 = empty({b, n, n}, f16);
  {
    const Tensor a_split = empty({b, n, 3 * n}, f16);
    const Tensor a_bounds = amax(abs(a3.view({b, n * n}).slice(1, 0, n * n, n + 1)), {-1});
    kernels::split_f16(a3, a_bounds, a_scales, a_split.narrow(2, n, n), a_split.narrow(2, 0, n),
                       a_split.narrow(2, 2 * n, n));
    kernels::split_f16(q, ones({b}, f32), q_scales, q_split.narrow(1, 0, n), q_split.narrow(1, n, n),
                       q_split.narrow(1, 2 * n, n));  // q's scale: 2^13 (a bound of 1)
    kernels::bmm_add(a_split, q_split, t16, alpha, 0.0);
  }  // a's split freed here
  Rayleigh out{.coupled = empty({b, n, n}, f32), .scales = rdiv(a_scales, 1.0), .q16 = q_split.narrow(1, 0, n)};
  // (q·2^13)ᵀ·(alpha·2^13·s_k·T) = alpha·2^26·s_k·qᵀ·T: powers of two, exact
  kernels::bmm_add(out.q16.transpose(-2, -1), t16, out.coupled, 1.0 / (alpha * 0x1p26), 0.0);
  return out;
}

// q·M·qᵀ of (b, n, n) kept bases q and middles M (f32 on a GPU with options.tf32) as two f16 products: twice
// the TF32 rate, with TF32's 11 bits an operand (rounded to nearest, where the tensor cores truncate f32 to
// TF32). q16 = q·2^13 (rayleigh_matrix's). Each M is scaled by a power of two from a bound on its entries:
// its largest diagonal root times max(1, 1.5·tolerance·max(1, 1/p)) (off the diagonal |M_ij| = |F_ij·B_ij| is
// at most ~1.41·ρ_i·max_j f(φ_j) for quotients apart by 2x or more, and ~1.41·ρ_i·max_j f(φ_j)/p for nearer
// ones, with ρ_i ≤ tolerance where the basis is kept; a refreshed matrix's root is overwritten, and split_f16
// leaves ~4x room above its bound). W = q·M is written in f16 scaled by 2^-(13 + ⌈log2 sqrt(n)⌉): |W_ij| ≤
// ‖q_i‖·‖M_j‖ ≤ sqrt(n)·max|M|, so W stays under 2^14 where M is within its bound. Each matrix's own scale
// keeps its W in f16's normal range (one scale for a batch whose roots lie 2^20 apart would leave the smaller
// ones' W, ~2^-6·2^-20 at n = 1024, in f16's subnormals). The second product undoes the common scales (host
// alpha); each matrix's own is returned beside it, for the caller's copy of the roots to apply (a pass of its
// own took ~0.55 ms of a GPT-2 root step on an H200). (split_f16's shift is clamped to ±100, which M's bound
// reaches only beyond 2^114 or under 2^-87: with f32 quotients λ^(−1/p), only for p below ~1.5; Shampoo's
// p = 2·order ≥ 2.)
struct ScaledRoots {
  Tensor root, scales;  // the root of matrix b is root_b·scales_b
};
ScaledRoots kept_root_products_f16(const Tensor& q16, const Tensor& middle, const Tensor& diagonal_roots, double p,
                                   double tolerance) {
  const int64_t b = middle.size(0), n = middle.size(-1);
  const TensorOptions f32{.dtype = DType::f32, .device = middle.device()};
  const TensorOptions f16{.dtype = DType::f16, .device = middle.device()};
  const Tensor bounds = mul(amax(diagonal_roots, {-1}), std::max(1.0, 1.5 * tolerance * std::max(1.0, 1.0 / p)));
  const Tensor m16 = empty({b, n, n}, f16), m_scales = empty({b}, f32);
  kernels::split_f16(middle, bounds, m_scales, m16, Tensor(), Tensor());
  const double alpha = std::ldexp(1.0, -(13 + log2_sqrt_ceil(n)));
  const Tensor w16 = empty({b, n, n}, f16);
  kernels::bmm_add(q16, m16, w16, alpha, 0.0);
  // W·(q·2^13)ᵀ = alpha·2^26·s_M·q·M·qᵀ: powers of two, exact
  Tensor root = empty({b, n, n}, f32);
  kernels::bmm_add(w16, q16.transpose(-2, -1), root, 1.0 / (alpha * 0x1p26), 0.0);
  return {root, rdiv(m_scales, 1.0)};
}

// The eigenpairs of (batch, n, n) ridged matrices; a matrix the solver does not converge on is an error.
Eigh checked_eigh(const char* op, const Tensor& ridged) {
  EighEx e = eigh_ex(ridged);
  const int32_t* info = static_cast<const int32_t*>(e.info.raw_data());
  for (int64_t b = 0; b < e.info.numel(); ++b)
    KILN_CHECK(info[b] == 0, op, ": the symmetric eigensolver did not converge on matrix ", b, " of ", ridged.str(),
               " (info ", info[b], ")");
  return {e.eigenvalues, e.eigenvectors};
}

Tensor ridge(const Tensor& a3, double epsilon) {
  return add(a3, mul(eye(a3.size(-1), {.dtype = a3.dtype(), .device = a3.device()}), epsilon));
}

// The eigen method on (batch, n, n): the matrices' (a + ε·I)^(−1/p), eigenvalues below ε lifted per matrix.
Tensor eigen_root(const char* op, const Tensor& a3, double p, double epsilon) {
  const Eigh e = checked_eigh(op, ridge(a3, epsilon));
  return root_from_eigenpairs(e.eigenvalues, e.eigenvectors, p, epsilon);
}

Tensor matrix_power(const Tensor& t, int64_t p) {  // p >= 1, by squaring
  Tensor result, base = t;
  for (; p > 0; p >>= 1) {
    if (p & 1) result = result.defined() ? matmul(result, base) : base;
    if (p > 1) base = matmul(base, base);
  }
  return result;
}

}  // namespace

Tensor eye(int64_t n, const TensorOptions& options) {
  KILN_CHECK(n >= 0, "linalg::eye: n must be non-negative, got ", n);
  const Tensor i = arange(n, {.dtype = DType::i64, .device = options.device});
  return cast(eq(i.view({n, 1}), i.view({1, n})), options.dtype);
}

EighEx eigh_ex(const Tensor& a) {
  check_matrices("linalg::eigh", a);
  const NoGradGuard no_grad;
  const int64_t n = a.size(-1);
  const Shape batch = batch_shape(a);
  const int64_t b = count(batch);
  const TensorOptions o{.dtype = a.dtype(), .device = a.device()};
  Tensor w = empty({b, n}, o), v = empty({b, n, n}, o);
  Tensor info = zeros({b}, {.dtype = DType::i32, .device = a.device()});
  if (b > 0 && n > 0) kernels::eigh(a.contiguous().reshape({b, n, n}), w, v, info);
  // the kernel writes eigenvectors as rows: their transpose is the columns' view
  return {w.reshape(with(batch, {n})), v.reshape(with(batch, {n, n})).transpose(-2, -1), info.cpu().reshape(batch)};
}

Eigh eigh(const Tensor& a) {
  EighEx e = eigh_ex(a);
  const int32_t* info = static_cast<const int32_t*>(e.info.contiguous().raw_data());
  for (int64_t i = 0; i < e.info.numel(); ++i)
    KILN_CHECK(info[i] == 0, "linalg::eigh: the solver did not converge on matrix ", i, " of ", a.str(), " (info ",
               info[i], ")");
  return {e.eigenvalues, e.eigenvectors};
}

namespace {
// What every inverse root takes: finite square f32/f64 matrices, p > 0, ε >= 0 (finite: checked here, else
// by the caller)
void check_root(const char* op, const Tensor& a, double p, const InverseRootOptions& options, bool finite = true) {
  check_matrices(op, a, finite);
  KILN_CHECK(p > 0 && std::isfinite(p), op, ": the root p must be positive, got ", p);
  KILN_CHECK(options.epsilon >= 0, op, ": epsilon must be non-negative, got ", options.epsilon);
}
}  // namespace

InverseRoot inverse_root_ex(const Tensor& a, double p, const InverseRootOptions& options) {
  const char* op = "linalg::inverse_root";
  check_root(op, a, p, options);
  const NoGradGuard no_grad;
  const amp::Autocast full_precision(a.device(), DType::bf16, /*enabled=*/false);  // products in a's dtype
  const int64_t n = a.size(-1);
  const Shape batch = batch_shape(a);
  const int64_t b = count(batch);
  InverseRoot out;
  if (b == 0 || n == 0) {
    out.root = empty(a.sizes(), {.dtype = a.dtype(), .device = a.device()});
    return out;
  }
  const Tensor a3 = a.contiguous().reshape({b, n, n});
  KILN_CHECK(options.method != RootMethod::warm_eigen, op, ": the warm_eigen method needs a basis: call "
             "linalg::inverse_root_warm");
  if (options.method == RootMethod::eigen) {
    out.root = eigen_root(op, a3, p, options.epsilon).reshape(a.sizes());
    return out;
  }

  KILN_CHECK(p == std::round(p) && p >= 1, op, ": the newton method needs an integer root, got p = ", p);
  KILN_CHECK(options.max_iterations >= 0, op, ": max_iterations must be non-negative, got ", options.max_iterations);
  const bool tf32 = options.tf32 && a.dtype() == DType::f32 && a.device().is_cuda();
  const double tolerance =
      options.tolerance > 0 ? options.tolerance : (a.dtype() == DType::f64 ? 1e-10 : tf32 ? 2e-3 : 1e-4);
  const cuda::AllowTf32Guard tf32_products(tf32, true);  // TF32 products for the iteration
  const int64_t q = int64_t(p);
  const Tensor identity = eye(n, {.dtype = a.dtype(), .device = a.device()});
  const Tensor ridged = add(a3, mul(identity, options.epsilon));
  // c = (p+1) / (2‖a + ε·I‖_F) puts M₀'s eigenvalues in (0, (p+1)/2]: the iteration converges
  const Tensor c = div(full({1}, (p + 1) / 2, {.dtype = a.dtype(), .device = a.device()}),
                       sqrt(sum(mul(ridged, ridged), {-2, -1}, /*keepdim=*/true)));
  Tensor x = mul(pow(c, 1.0 / p), identity);
  Tensor m = mul(c, ridged);
  Tensor residual = amax(abs(sub(m, identity)), {-2, -1});
  int64_t it = 0;
  while (it < options.max_iterations && !all_true(le(residual, full({1}, tolerance, {.dtype = a.dtype(), .device = a.device()})))) {
    const Tensor t = div(sub(mul(identity, p + 1), m), p);  // ((p+1)·I − M) / p
    x = matmul(x, t);
    m = matmul(matrix_power(t, q), m);
    residual = amax(abs(sub(m, identity)), {-2, -1});
    ++it;
  }
  out.iterations = it;
  out.residual = cast(residual, DType::f64).cpu().reshape(batch);
  // the matrices the iteration did not bring within the tolerance (or that it made non-finite)
  const std::vector<double> r = out.residual.contiguous().to_vector<double>();
  std::vector<int64_t> failed;
  for (int64_t i = 0; i < b; ++i)
    if (!(r[size_t(i)] <= tolerance)) failed.push_back(i);
  if (!failed.empty()) {
    KILN_CHECK(options.fallback, op, ": the newton iteration left ", failed.size(), " of ", b,
               " matrices above the tolerance ", tolerance, " after ", it, " iterations (matrix ", failed[0],
               ": residual ", r[size_t(failed[0])], "); fallback = true computes them by the eigen method");
    // one batched eigen job for all of them: one by one, each would pay the solver's latency (milliseconds
    // a matrix on a GPU)
    if (int64_t(failed.size()) == b) {
      x = eigen_root(op, a3, p, options.epsilon);
    } else {
      std::vector<Tensor> rows;
      for (int64_t i : failed) rows.push_back(a3.select(0, i));
      const Tensor redone = eigen_root(op, stack(rows), p, options.epsilon);
      for (size_t j = 0; j < failed.size(); ++j) x.select(0, failed[j]).copy_(redone.select(0, int64_t(j)));
    }
    out.fallbacks = int64_t(failed.size());
  }
  out.root = x.reshape(a.sizes());
  return out;
}

WarmRootsStarted start_warm_roots(const Tensor& a, double p, const Tensor& basis, const InverseRootOptions& options) {
  const char* op = "linalg::inverse_root_warm";
  // Non-finite elements are found through B, not a pass of their own: a non-finite a makes every entry of its
  // B non-finite (inf·0 is NaN), so its ρ (n > 1) and its quotients' sum, which refresh it, and the
  // refreshed are checked (finish_warm_roots).
  check_root(op, a, p, options, /*finite=*/false);
  KILN_CHECK(options.warm_tolerance >= 0, op, ": warm_tolerance must be non-negative, got ", options.warm_tolerance);
  KILN_CHECK(basis.defined() && basis.sizes() == a.sizes() && basis.dtype() == a.dtype() &&
                 basis.device() == a.device() && basis.is_contiguous(),
             op, ": the basis must be a contiguous tensor of the matrices' shape, dtype and device: matrices ", a.str(),
             ", basis ", basis.defined() ? basis.str() : std::string("undefined"));
  const NoGradGuard no_grad;
  const amp::Autocast full_precision(a.device(), DType::bf16, /*enabled=*/false);  // products in a's dtype
  const int64_t n = a.size(-1);
  const int64_t b = count(batch_shape(a));
  const TensorOptions like{.dtype = a.dtype(), .device = a.device()};
  WarmRootsStarted out;
  out.p = p;
  out.options = options;
  if (b == 0 || n == 0) {
    out.root = empty(a.sizes(), like);
    out.figures = zeros({3, b}, like);  // ρ 0, columns of unit norm, finite: nothing refreshed
    return out;
  }
  out.matrices = a.contiguous().reshape({b, n, n});
  out.basis = basis.reshape({b, n, n});  // a view: refreshed rows are written through it
  const Tensor& a3 = out.matrices;
  const Tensor& q = out.basis;
  // B = qᵀ·A·q with A = a + ε·I, as qᵀ·a·q (rayleigh_matrix) + ε·I: qᵀ·q is I to the eigensolver's rounding
  // for the bases it made, and a kept basis' columns are within 1e-3 of unit norm (checked by the figures),
  // so ε·(qᵀ·q − I) is under 1e-3 of ε (ε·q added through the product took a pass over q of its own).
  // λ_j = B_jj, lifted as the eigen method lifts eigenvalues and floored at n·u·λ_max (u the dtype's unit
  // roundoff).
  const bool tf32 = options.tf32 && a.dtype() == DType::f32 && a.device().is_cuda();
  const Rayleigh rayleigh = rayleigh_matrix(a3, q, tf32);
  const Tensor diagonal = rayleigh.coupled.view({b, n * n}).slice(1, 0, n * n, n + 1);
  const Tensor quotients =
      add(rayleigh.scales.defined() ? mul(diagonal, rayleigh.scales.view({b, 1})) : diagonal, options.epsilon);
  const Tensor lifted = lift_eigenvalues(quotients, options.epsilon);
  const double unit_roundoff = a.dtype() == DType::f64 ? 0x1p-53 : 0x1p-24;
  const Tensor floored = maximum(lifted, mul(amax(lifted, {-1}, true), double(n) * unit_roundoff));
  // in one pass over B: the kept basis' root expansion (core/kernels/linalg.h) and each row's coupling
  // Σ_{j≠i} B_ij²/(λ_i·λ_j), whose largest is ρ²
  const Tensor middle = empty({b, n, n}, like), row_coupling = empty({b, n}, like);
  const Tensor diagonal_roots = pow(lifted, -1.0 / p);
  kernels::kept_basis_expansion(rayleigh.coupled, rayleigh.scales, floored, pow(floored, -1.0 / p), diagonal_roots, p,
                                middle, row_coupling);
  // the figures: ρ, the basis' largest column-norm deviation max_j |‖q_j‖² − 1| (1 for a basis of zeros), and
  // the quotients' sum (non-finite with a: for n = 1, ρ, a sum over no off-diagonal entries, is 0 whatever a is)
  const Tensor gaps = empty({b}, like);
  kernels::column_norm_gap(q, gaps);
  out.figures = stack({sqrt(amax(row_coupling, {-1})), gaps, sum(quotients, {-1})});
  // every matrix's root q·M·qᵀ in its basis, as if kept (those refreshed are overwritten: at a refresh of all,
  // the first call's, two products wasted beside the eigensolver's ~10x): in f32, or on f16 where asked
  if (tf32) {
    ScaledRoots kept = kept_root_products_f16(rayleigh.q16, middle, diagonal_roots, p, options.warm_tolerance);
    out.root = kept.root.reshape(a.sizes());
    out.root_scales = kept.scales;
  } else {
    const cuda::AllowTf32Guard exact(true, false);
    out.root = matmul(matmul(q, middle), q.transpose(-2, -1)).reshape(a.sizes());
  }
  return out;
}

WarmInverseRoot finish_warm_roots(const WarmRootsStarted& started, const std::vector<double>& figures) {
  const char* op = "linalg::inverse_root_warm";
  const Tensor& a3 = started.matrices;
  const Tensor& q = started.basis;
  const int64_t b = started.figures.size(1);
  KILN_CHECK(int64_t(figures.size()) == 3 * b, op, ": finish_warm_roots takes the 3 x ", b,
             " figures of start_warm_roots, got ", figures.size(), " values");
  const NoGradGuard no_grad;
  WarmInverseRoot out;
  out.root = started.root;
  out.root_scales = started.root_scales;
  out.coupling = empty(batch_shape(started.root), {.dtype = DType::f64});
  if (!a3.defined()) {  // no matrices, or matrices of size 0
    out.coupling.zero_();
    return out;
  }
  double* rho = static_cast<double*>(out.coupling.raw_data());
  std::vector<int64_t> refreshed;
  for (int64_t i = 0; i < b; ++i) {
    // columns of unit norm (a basis of zeros is off by 1); columns that are not orthogonal show in ρ
    const double coupling_i = figures[size_t(i)], gap = figures[size_t(b + i)];
    const bool unit_columns = gap <= 1e-3;  // false for NaN
    rho[i] = unit_columns ? coupling_i : gap;
    const bool reuse = unit_columns && rho[i] <= started.options.warm_tolerance &&  // false for NaN
                       std::isfinite(figures[size_t(2 * b + i)]);
    if (!reuse) refreshed.push_back(i);
  }
  if (refreshed.empty()) return out;
  const amp::Autocast full_precision(a3.device(), DType::bf16, /*enabled=*/false);
  const bool tf32 = started.options.tf32 && a3.dtype() == DType::f32 && a3.device().is_cuda();
  const cuda::AllowTf32Guard products(true, tf32);  // V·diag·Vᵀ as the kept roots' products
  const int64_t n = a3.size(-1);
  // values' rows into rows `which` of `into`: one launch however many (a job of 146 factors with one refreshed
  // writes its one root)
  auto put = [&](Tensor into, const Tensor& values) {
    if (int64_t(refreshed.size()) == b) {
      into.copy_(values);
      return;
    }
    // copy_matrices reads rows of unit stride: eigenvectors come as the columns' (transposed) view
    const Tensor rows_of_values = values.contiguous();
    std::vector<Tensor> from, to;
    for (size_t j = 0; j < refreshed.size(); ++j) {
      from.push_back(rows_of_values.select(0, int64_t(j)));
      to.push_back(into.select(0, refreshed[j]));
    }
    kernels::copy_matrices(from, to);
    into.bump_version();  // an in-place write, as copy_ marks it (the basis is the caller's tensor)
  };
  Tensor fresh = a3;
  if (int64_t(refreshed.size()) != b)
    fresh = index_select(a3, 0, from_vector(refreshed, {int64_t(refreshed.size())},
                                            {.dtype = DType::i64, .device = a3.device()}));
  KILN_CHECK(all_true(isfinite(fresh)), op, ": the input ", a3.str(), " has non-finite elements (matrix ",
             refreshed.front(), " among those refreshed)");
  const Eigh e = checked_eigh(op, ridge(fresh, started.options.epsilon));
  put(out.root.reshape({b, n, n}),
      root_from_eigenpairs(e.eigenvalues, e.eigenvectors, started.p, started.options.epsilon));
  put(q, e.eigenvectors);
  out.refreshed = int64_t(refreshed.size());
  if (out.root_scales.defined()) {  // the refreshed roots are written at their own scale: 1
    if (out.refreshed == b) {
      out.root_scales = Tensor();
    } else {
      std::vector<float> kept(size_t(b), 1.0f);
      for (int64_t i : refreshed) kept[size_t(i)] = 0.0f;
      const Tensor keep = from_vector(kept, {b}, {.dtype = out.root_scales.dtype(), .device = a3.device()});
      out.root_scales = add(mul(out.root_scales, keep), rsub(keep, 1.0));
    }
  }
  return out;
}

WarmInverseRoot inverse_root_warm(const Tensor& a, double p, const Tensor& basis, const InverseRootOptions& options) {
  const WarmRootsStarted started = start_warm_roots(a, p, basis, options);
  // ρ, the column norms' deviation and the quotients' sum in one transfer
  WarmInverseRoot out =
      finish_warm_roots(started, cast(started.figures, DType::f64).cpu().contiguous().to_vector<double>());
  if (out.root_scales.defined()) {
    const int64_t n = a.size(-1), b = out.root_scales.numel();
    out.root.reshape({b, n, n}).mul_(out.root_scales.view({b, 1, 1}));
    out.root_scales = Tensor();
  }
  return out;
}

Tensor inverse_root(const Tensor& a, double p, const InverseRootOptions& options) {
  return inverse_root_ex(a, p, options).root;
}

}  // namespace kiln::linalg
