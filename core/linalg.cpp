// Matrix functions (core/linalg.h): the symmetric eigendecomposition through the linalg kernels, and the
// inverse p-th roots composed from it or from batched GEMMs (the coupled Newton iteration).
#include <kiln/core/linalg.h>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/stream.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/kernels/linalg.h>
#include <kiln/core/ops.h>

namespace kiln::linalg {

namespace {

// Square f32/f64 matrices not requiring grad (what every function here takes), finite or not.
void check_square(const char* op, const Tensor& a) {
  KILN_CHECK(a.defined(), op, ": the input is an undefined tensor");
  KILN_CHECK(a.dim() >= 2 && a.size(-1) == a.size(-2), op, ": expected square matrices (..., n, n), got ", a.str());
  KILN_CHECK(a.dtype() == DType::f32 || a.dtype() == DType::f64, op, ": expected f32 or f64 matrices, got ", a.str());
  KILN_CHECK(!(autograd::is_grad_enabled() && a.requires_grad()), op, ": has no backward, but ", a.str(),
             " requires grad; call it under NoGradGuard or on a detached tensor");
}

void check_matrices(const char* op, const Tensor& a) {
  check_square(op, a);
  KILN_CHECK(a.numel() == 0 || all_true(isfinite(a)), op, ": the input ", a.str(), " has non-finite elements");
}

void check_basis(const char* op, const Tensor& a, const Tensor& basis) {
  KILN_CHECK(basis.defined() && basis.sizes() == a.sizes() && basis.dtype() == a.dtype() &&
                 basis.device() == a.device() && basis.is_contiguous(),
             op, ": the basis must be a contiguous tensor of the matrices' shape, dtype and device: matrices ", a.str(),
             ", basis ", basis.defined() ? basis.str() : std::string("undefined"));
}

// Job j's stream on a device: a pool of a few streams made once per device (as PyTorch pools them).
cuda::Stream lane_stream(int device, size_t j) {
  constexpr size_t kLanes = 8;
  static std::mutex mutex;
  static std::map<int, std::vector<cuda::Stream>> pools;
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<cuda::Stream>& pool = pools[device];
  while (pool.size() <= j % kLanes) pool.push_back(cuda::Stream::create(device));
  return pool[j % kLanes];
}

// The number of elements of t that are finite, as a one-element f64 tensor on t's device (read later).
Tensor finite_count(const Tensor& t) { return sum(cast(isfinite(t), DType::f64)).reshape({1}); }
// The number of zeros in a solver's info (the matrices it converged on), likewise.
Tensor zero_count(const Tensor& info) {
  return sum(cast(eq(info, zeros({1}, {.dtype = DType::i32, .device = info.device()})), DType::f64)).reshape({1});
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

// V·diag(λ^(−1/p))·Vᵀ for eigenpairs (λ, V) of a + ε·I, batched (b, n) and (b, n, n), V's columns the
// vectors: λ ← λ + (ε − λ_min) where λ_min < ε, per matrix (the eigen method's lift).
Tensor root_from_eigenpairs(const Tensor& values, const Tensor& vectors, double p, double epsilon) {
  const Tensor lowest = amin(values, {-1}, /*keepdim=*/true);
  const Tensor lift =
      clamp(sub(full({1}, epsilon, {.dtype = values.dtype(), .device = values.device()}), lowest), 0.0, INFINITY);
  const Tensor scale = pow(add(values, lift), -1.0 / p);
  return matmul(mul(vectors, scale.unsqueeze(-2)), vectors.transpose(-2, -1));
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

// The eigendecomposition of (b, n, n) contiguous matrices, the solver's info left on their device (no wait
// for the host).
EighEx eigh_device(const Tensor& a3) {
  const int64_t b = a3.size(0), n = a3.size(-1);
  const TensorOptions o{.dtype = a3.dtype(), .device = a3.device()};
  Tensor w = empty({b, n}, o), v = empty({b, n, n}, o);
  Tensor info = zeros({b}, {.dtype = DType::i32, .device = a3.device()});
  if (b > 0 && n > 0) kernels::eigh(a3, w, v, info);
  // the kernel writes eigenvectors as rows: their transpose is the columns' view
  return {w, v.transpose(-2, -1), info};
}

// The warm method's first half on (b, n, n): the ridged matrices, the Rayleigh quotients λ_j = q_jᵀ·(A·q)_j
// (the column sums of q ⊙ A·q), and 2b f64 sums: Σλ² of each matrix, then ‖A‖_F² of each.
struct WarmStart {
  Tensor ridged, quotients, sums;
};
WarmStart warm_start(const Tensor& a3, const Tensor& q, double epsilon);

// The matrices that keep their basis: δ = sqrt(1 − Σλ²/‖A‖²) within the tolerance (and below 1: a basis of
// zeros is always refreshed). Writes each δ to delta.
std::vector<bool> keeps_basis(const double* sums, int64_t b, double tolerance, double* delta) {
  std::vector<bool> keep(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    const double captured = sums[i], total = sums[b + i];
    delta[i] = total > 0 ? std::sqrt(std::max(0.0, 1.0 - captured / total)) : 1.0;
    keep[size_t(i)] = delta[i] <= tolerance && delta[i] < 1.0 && std::isfinite(captured);
  }
  return keep;
}

// The warm method's second half: the kept matrices' roots from their quotients and basis, the others
// eigendecomposed afresh with their basis rows overwritten. `info` (device i32, one per refreshed matrix) is
// undefined when none was refreshed.
struct WarmFinish {
  Tensor root, info;
  int64_t refreshed = 0;
};
WarmFinish warm_finish(const WarmStart& w, const Tensor& q, const std::vector<bool>& keep, double p, double epsilon);

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

WarmStart warm_start(const Tensor& a3, const Tensor& q, double epsilon) {
  WarmStart w;
  w.ridged = ridge(a3, epsilon);
  w.quotients = sum(mul(q, matmul(w.ridged, q)), {-2});
  w.sums = cast(cat({sum(mul(w.quotients, w.quotients), {-1}), sum(mul(w.ridged, w.ridged), {-2, -1})}), DType::f64);
  return w;
}

WarmFinish warm_finish(const WarmStart& w, const Tensor& q, const std::vector<bool>& keep, double p, double epsilon) {
  const int64_t b = w.ridged.size(0), n = w.ridged.size(-1);
  std::vector<int64_t> kept, refreshed;
  for (int64_t i = 0; i < b; ++i) (keep[size_t(i)] ? kept : refreshed).push_back(i);
  auto rows = [&](const Tensor& t, const std::vector<int64_t>& which) {
    if (int64_t(which.size()) == b) return t;
    return index_select(t, 0, from_vector(which, {int64_t(which.size())}, {.dtype = DType::i64, .device = t.device()}));
  };
  auto put = [&](const Tensor& into, const std::vector<int64_t>& which, const Tensor& values) {
    Tensor target = into;  // a handle on the same storage
    if (int64_t(which.size()) == b) {
      target.copy_(values);
      return;
    }
    for (size_t j = 0; j < which.size(); ++j) target.narrow(0, which[j], 1).copy_(values.narrow(0, int64_t(j), 1));
  };
  WarmFinish f;
  f.root = empty({b, n, n}, {.dtype = w.ridged.dtype(), .device = w.ridged.device()});
  if (!kept.empty()) put(f.root, kept, root_from_eigenpairs(rows(w.quotients, kept), rows(q, kept), p, epsilon));
  if (!refreshed.empty()) {
    const EighEx e = eigh_device(rows(w.ridged, refreshed).contiguous());
    put(f.root, refreshed, root_from_eigenpairs(e.eigenvalues, e.eigenvectors, p, epsilon));
    put(q, refreshed, e.eigenvectors);
    f.info = e.info;
    f.refreshed = int64_t(refreshed.size());
  }
  return f;
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
  const EighEx e = eigh_device(a.contiguous().reshape({count(batch), n, n}));
  return {e.eigenvalues.reshape(with(batch, {n})), e.eigenvectors.reshape(with(batch, {n, n})),
          e.info.cpu().reshape(batch)};
}

Eigh eigh(const Tensor& a) {
  EighEx e = eigh_ex(a);
  const int32_t* info = static_cast<const int32_t*>(e.info.contiguous().raw_data());
  for (int64_t i = 0; i < e.info.numel(); ++i)
    KILN_CHECK(info[i] == 0, "linalg::eigh: the solver did not converge on matrix ", i, " of ", a.str(), " (info ",
               info[i], ")");
  return {e.eigenvalues, e.eigenvectors};
}

InverseRoot inverse_root_ex(const Tensor& a, double p, const InverseRootOptions& options) {
  const char* op = "linalg::inverse_root";
  check_matrices(op, a);
  KILN_CHECK(p > 0 && std::isfinite(p), op, ": the root p must be positive, got ", p);
  KILN_CHECK(options.epsilon >= 0, op, ": epsilon must be non-negative, got ", options.epsilon);
  const NoGradGuard no_grad;
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
    for (int64_t i : failed) x.narrow(0, i, 1).copy_(eigen_root(op, a3.narrow(0, i, 1), p, options.epsilon));
    out.fallbacks = int64_t(failed.size());
  }
  out.root = x.reshape(a.sizes());
  return out;
}

WarmInverseRoot inverse_root_warm(const Tensor& a, double p, const Tensor& basis, const InverseRootOptions& options) {
  const char* op = "linalg::inverse_root_warm";
  check_matrices(op, a);
  KILN_CHECK(p > 0 && std::isfinite(p), op, ": the root p must be positive, got ", p);
  KILN_CHECK(options.epsilon >= 0, op, ": epsilon must be non-negative, got ", options.epsilon);
  KILN_CHECK(options.warm_tolerance >= 0, op, ": warm_tolerance must be non-negative, got ", options.warm_tolerance);
  check_basis(op, a, basis);
  const NoGradGuard no_grad;
  const int64_t n = a.size(-1);
  const Shape batch = batch_shape(a);
  const int64_t b = count(batch);
  WarmInverseRoot out;
  if (b == 0 || n == 0) {
    out.root = empty(a.sizes(), {.dtype = a.dtype(), .device = a.device()});
    out.off_diagonal = zeros(batch, {.dtype = DType::f64});
    return out;
  }
  const cuda::AllowTf32Guard exact(true, false);  // TF32's 1e-3 would drown the small Rayleigh quotients
  const Tensor q = basis.reshape({b, n, n});       // a view: refreshed rows are written through it
  const WarmStart w = warm_start(a.contiguous().reshape({b, n, n}), q, options.epsilon);
  const std::vector<double> sums = w.sums.cpu().contiguous().to_vector<double>();
  out.off_diagonal = empty(batch, {.dtype = DType::f64});
  const std::vector<bool> keep =
      keeps_basis(sums.data(), b, options.warm_tolerance, static_cast<double*>(out.off_diagonal.raw_data()));
  WarmFinish f = warm_finish(w, q, keep, p, options.epsilon);
  if (f.info.defined()) {
    const std::vector<int32_t> info = f.info.cpu().contiguous().to_vector<int32_t>();
    for (size_t i = 0; i < info.size(); ++i)
      KILN_CHECK(info[i] == 0, op, ": the symmetric eigensolver did not converge on a matrix of ", a.str(), " (info ",
                 info[i], ")");
  }
  out.refreshed = f.refreshed;
  out.root = f.root.reshape(a.sizes());
  return out;
}

std::vector<RootJobResult> inverse_roots(const std::vector<RootJob>& jobs, const InverseRootOptions& options) {
  const char* op = "linalg::inverse_roots";
  const bool warm = options.method == RootMethod::warm_eigen;
  KILN_CHECK(warm || options.method == RootMethod::eigen, op,
             ": takes the eigen or warm_eigen method; the newton method goes batch by batch (inverse_root_ex)");
  KILN_CHECK(options.warm_tolerance >= 0, op, ": warm_tolerance must be non-negative, got ", options.warm_tolerance);
  for (const RootJob& job : jobs) {
    check_square(op, job.a);
    KILN_CHECK(job.p > 0 && std::isfinite(job.p), op, ": the root p must be positive, got ", job.p);
    KILN_CHECK(job.epsilon >= 0, op, ": epsilon must be non-negative, got ", job.epsilon);
    if (warm) check_basis(op, job.a, job.basis);
  }
  const NoGradGuard no_grad;
  const cuda::AllowTf32Guard exact(true, false);
  const size_t J = jobs.size();
  std::vector<RootJobResult> out(J);
  // Each job's work on its own stream (CUDA), after that stream waits for the caller's; `done` joins them
  // back: the caller's stream waits for each lane, and the lane's tensors it will read are recorded as used
  // by it (their blocks are not handed out again on the lane before the caller is done with them).
  std::vector<cuda::Stream> used(J);
  auto on_lane = [&](size_t j, auto&& work) {
    const Device& device = jobs[j].a.device();
    if (!device.is_cuda()) return work();
    if (!used[j].valid()) used[j] = lane_stream(device.index, j);
    used[j].wait(cuda::Stream::current(device.index));
    const cuda::StreamGuard guard(used[j]);
    work();
  };
  auto join = [&](size_t j, std::initializer_list<Tensor> handed_back) {
    if (!used[j].valid()) return;
    const cuda::Stream caller = cuda::Stream::current(used[j].device());
    caller.wait(used[j]);
    for (const Tensor& t : handed_back)
      if (t.defined()) cuda::record_stream(t, caller);
  };
  struct State {
    int64_t b = 0, n = 0;
    Tensor a3, q, checks;  // checks: finite elements of a, converged matrices, finite elements of the root
    WarmStart start;
  };
  std::vector<State> st(J);
  for (size_t j = 0; j < J; ++j) {
    st[j].n = jobs[j].a.size(-1);
    st[j].b = count(batch_shape(jobs[j].a));
  }
  auto empty_job = [&](size_t j) { return st[j].b == 0 || st[j].n == 0; };
  // warm_eigen, first half: every job's quotients and sums, read in one transfer
  std::vector<std::vector<bool>> keep(J);
  if (warm) {
    std::vector<Tensor> sums;
    for (size_t j = 0; j < J; ++j) {
      if (empty_job(j)) continue;
      on_lane(j, [&] {
        st[j].a3 = jobs[j].a.contiguous().reshape({st[j].b, st[j].n, st[j].n});
        st[j].q = jobs[j].basis.reshape({st[j].b, st[j].n, st[j].n});
        st[j].start = warm_start(st[j].a3, st[j].q, jobs[j].epsilon);
      });
    }
    for (size_t j = 0; j < J; ++j)  // joined only once every lane is launched: lanes wait for the caller
      if (!empty_job(j)) {
        join(j, {st[j].start.sums});
        sums.push_back(st[j].start.sums);
      }
    const std::vector<double> host = sums.empty() ? std::vector<double>() : cat(sums).cpu().contiguous().to_vector<double>();
    size_t at = 0;
    for (size_t j = 0; j < J; ++j) {
      if (empty_job(j)) continue;
      std::vector<double> delta(size_t(st[j].b));
      keep[j] = keeps_basis(host.data() + at, st[j].b, options.warm_tolerance, delta.data());
      at += size_t(2 * st[j].b);
    }
  }
  // the roots, and each job's checks, read in one transfer
  std::vector<Tensor> checks;
  for (size_t j = 0; j < J; ++j) {
    const RootJob& job = jobs[j];
    State& s = st[j];
    if (empty_job(j)) {
      out[j].root = empty(job.a.sizes(), {.dtype = job.a.dtype(), .device = job.a.device()});
      out[j].finite_input = out[j].ok = true;
      continue;
    }
    on_lane(j, [&] {
      Tensor converged;  // matrices the solver converged on (one that kept its basis needs none)
      if (warm) {
        WarmFinish f = warm_finish(s.start, s.q, keep[j], job.p, job.epsilon);
        out[j].root = f.root;
        out[j].refreshed = f.refreshed;
        converged = f.info.defined() ? add(zero_count(f.info), double(s.b - f.refreshed))
                                     : full({1}, double(s.b), {.dtype = DType::f64, .device = job.a.device()});
        s.start = WarmStart();
      } else {
        s.a3 = job.a.contiguous().reshape({s.b, s.n, s.n});
        const EighEx e = eigh_device(ridge(s.a3, job.epsilon));
        out[j].root = root_from_eigenpairs(e.eigenvalues, e.eigenvectors, job.p, job.epsilon);
        converged = zero_count(e.info);
      }
      s.checks = cat({finite_count(s.a3), converged, finite_count(out[j].root)});
    });
  }
  for (size_t j = 0; j < J; ++j)
    if (!empty_job(j)) {
      join(j, {out[j].root, st[j].checks});
      checks.push_back(st[j].checks);
    }
  const std::vector<double> host = checks.empty() ? std::vector<double>() : cat(checks).cpu().contiguous().to_vector<double>();
  size_t at = 0;
  for (size_t j = 0; j < J; ++j) {
    if (empty_job(j)) continue;
    const double elements = double(jobs[j].a.numel());
    out[j].finite_input = host[at] == elements;
    out[j].ok = out[j].finite_input && host[at + 1] == double(st[j].b) && host[at + 2] == elements;
    out[j].root = out[j].root.reshape(jobs[j].a.sizes());
    at += 3;
  }
  return out;
}

Tensor inverse_root(const Tensor& a, double p, const InverseRootOptions& options) {
  return inverse_root_ex(a, p, options).root;
}

}  // namespace kiln::linalg
