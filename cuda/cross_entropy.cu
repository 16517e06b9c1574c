// Fused cross-entropy over rows of logits (N, C), with label smoothing ε and an ignore index.
//   forward:  lse_n = log Σ_c exp(x_nc)  (online: running max m and Σ exp(x - m), rescaled when m grows),
//             loss_n = lse_n - (1-ε) x[n, t_n] - (ε/C) Σ_c x_nc;  0 for ignored rows (lse still saved)
//   backward: grad[n, c] = g_n (exp(x_nc - lse_n) - ε/C - (1-ε)[c = t_n]);  0 for ignored rows
// Math in f32 (f64 for f64). The softmax is never written: the forward reads the logits once (N*C*sizeof(T))
// and writes 2N stats; the backward reads the logits once and writes the gradient once, recomputing the
// probabilities from the saved lse.
// A group of G threads (32..512) owns a row; 16-byte loads, four in flight per thread. A target that is
// neither ignore_index nor in [0, C) sets a device flag (and a NaN loss); the host checks the flag after
// the forward kernel and throws kiln::Error.
#include <cmath>

#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/cuda_backend.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

template <class S>
__global__ void __launch_bounds__(512)
    cross_entropy_kernel(const device_t<S>* x, const int64_t* target, int64_t N, int64_t C, int G, int64_t ignore_index,
                         compute_t<S> eps, compute_t<S>* loss, compute_t<S>* lse_out, int* bad_target) {
  using D = device_t<S>;
  using A = compute_t<S>;
  __shared__ A smem[32];
  const int upb = int(blockDim.x) / G, lane = int(threadIdx.x) % G;
  const bool smooth = eps != A(0);
  for (int64_t tile = blockIdx.x; tile * upb < N; tile += gridDim.x) {
    const int64_t row = tile * upb + threadIdx.x / G;
    const bool valid = row < N;
    const D* xr = x + (valid ? row : 0) * C;
    A m = -INFINITY, s = 0, sx = 0;
    if (valid)
      visit_row(xr, C, lane, G, true, [&](int64_t, const auto& vec) {
        constexpr int K = sizeof(vec.v) / sizeof(D);
        A v[K];
        A pm = -INFINITY;
#pragma unroll
        for (int j = 0; j < K; ++j) {
          v[j] = convert<A>(vec.v[j]);
          pm = MaxOp()(pm, v[j]);
        }
        if (pm > m) {
          s *= fast_exp(m - pm);
          m = pm;
        }
        const A c = shift_of(m);
#pragma unroll
        for (int j = 0; j < K; ++j) {
          s += exp_shifted(v[j], c);
          if (smooth) sx += v[j];
        }
      });
    A gm = group_allreduce(m, G, smem, MaxOp());
    s = s == A(0) ? A(0) : s * fast_exp(m - gm);
    s = group_allreduce(s, G, smem, SumOp());
    if (smooth) sx = group_allreduce(sx, G, smem, SumOp());
    if (valid && lane == 0) {
      A lse = gm + acc_log(s);
      lse_out[row] = lse;
      int64_t t = target[row];
      if (t == ignore_index) {
        loss[row] = A(0);
      } else if (t < 0 || t >= C) {
        *bad_target = 1;
        loss[row] = A(NAN);
      } else {
        loss[row] = lse - (A(1) - eps) * convert<A>(xr[t]) - eps / A(C) * sx;
      }
    }
  }
}

template <class S>
__global__ void __launch_bounds__(512)
    cross_entropy_backward_kernel(const device_t<S>* x, const int64_t* target, const compute_t<S>* lse,
                                  const compute_t<S>* grad_loss, int64_t N, int64_t C, int G, int64_t ignore_index,
                                  compute_t<S> eps, bool vec_ok, device_t<S>* grad) {
  using D = device_t<S>;
  using A = compute_t<S>;
  const int upb = int(blockDim.x) / G, lane = int(threadIdx.x) % G;
  const A off = eps / A(C), hit = A(1) - eps;
  // No group reductions here: groups may leave their rows independently.
  for (int64_t row = (blockIdx.x * int64_t(upb)) + threadIdx.x / G; row < N; row += int64_t(gridDim.x) * upb) {
    const D* xr = x + row * C;
    D* gr = grad + row * C;
    const int64_t t = target[row];
    if (t == ignore_index) {
      fill_row(gr, C, lane, G, convert<D>(A(0)));  // zeros, without reading the logits
      continue;
    }
    const A c = shift_of(lse[row]), g = grad_loss[row];
    visit_row(xr, C, lane, G, vec_ok, [&](int64_t i, const auto& vec) {
      constexpr int K = sizeof(vec.v) / sizeof(D);
      Vec<D, K> o;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        A d = exp_shifted(convert<A>(vec.v[j]), c) - off;
        if (i + j == t) d -= hit;
        o.v[j] = convert<D>(g * d);
      }
      store_vec(gr + i, o);
    });
  }
}

int group_size(int64_t C, int vec) { return pow2_clamp((C + 4 * vec - 1) / (4 * vec), 32, 512); }

void check_ce_args(const Tensor& logits, const Tensor& target, const char* op) {
  KILN_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cuda(), op,
             ": logits must be contiguous (N, C) on a CUDA device, got ", logits.str());
  KILN_CHECK(target.dtype() == DType::i64 && target.is_contiguous() && target.numel() == logits.size(0) &&
                 target.device() == logits.device(),
             op, ": target must be contiguous i64 (N) on ", logits.device().str(), ", got ", target.str());
}

void check_ce_stat(const Tensor& s, const Tensor& logits, const char* op) {
  KILN_CHECK(s.dtype() == stat_dtype(logits.dtype()) && s.is_contiguous() && s.numel() == logits.size(0) &&
                 s.device() == logits.device(),
             op, ": per-row tensor ", s.str(), " must be ", dtype_name(stat_dtype(logits.dtype())), " (N) for logits ",
             logits.str());
}

}  // namespace

void CudaBackend::cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                                const Tensor& loss, const Tensor& lse) const {
  NvtxRange range("cross_entropy");
  check_ce_args(logits, target, "cross_entropy");
  check_ce_stat(loss, logits, "cross_entropy");
  check_ce_stat(lse, logits, "cross_entropy");
  DeviceGuard guard(logits.device().index);
  int64_t N = logits.size(0), C = logits.size(1);
  if (N == 0) return;
  KILN_CHECK(C > 0, "cross_entropy: logits ", logits.str(), " have no classes");
  ErrorFlag flag(logits.device());
  KILN_CUDA_DISPATCH_FLOATING(logits.dtype(), "cross_entropy", {
    using D = device_t<scalar_t>;
    using A = compute_t<scalar_t>;
    int G = group_size(C, kVec<D>), block = G < 256 ? 256 : G;
    int64_t upb = block / G, tiles = (N + upb - 1) / upb;
    unsigned grid = unsigned(std::min<int64_t>(tiles, int64_t(sm_count()) * 32));
    cross_entropy_kernel<scalar_t><<<grid, block, 0, current_stream()>>>(
        static_cast<const D*>(logits.raw_data()), static_cast<const int64_t*>(target.raw_data()), N, C, G, ignore_index,
        A(label_smoothing), static_cast<A*>(loss.raw_data()), static_cast<A*>(lse.raw_data()), flag.ptr());
    KILN_LAUNCH_CHECK("cross_entropy_kernel", "cross_entropy");
  });
  // One synchronization per call: a bad target must be an exception, not a silent NaN.
  KILN_CHECK(flag.read() == 0, "cross_entropy: a target is out of range for ", C, " classes (and is not ignore_index ",
             ignore_index, ")");
}

void CudaBackend::cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                         const Tensor& grad_loss, int64_t ignore_index, double label_smoothing,
                                         const Tensor& grad_logits) const {
  NvtxRange range("cross_entropy_backward");
  check_ce_args(logits, target, "cross_entropy_backward");
  check_ce_stat(lse, logits, "cross_entropy_backward");
  check_ce_stat(grad_loss, logits, "cross_entropy_backward");
  KILN_CHECK(grad_logits.sizes() == logits.sizes() && grad_logits.dtype() == logits.dtype() &&
                 grad_logits.is_contiguous() && grad_logits.device() == logits.device(),
             "cross_entropy_backward: grad_logits ", grad_logits.str(), " must be contiguous like ", logits.str());
  DeviceGuard guard(logits.device().index);
  int64_t N = logits.size(0), C = logits.size(1);
  if (N == 0 || C == 0) return;
  bool vec_ok = ((reinterpret_cast<uintptr_t>(logits.raw_data()) ^ reinterpret_cast<uintptr_t>(grad_logits.raw_data())) &
                 15) == 0;
  KILN_CUDA_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_backward", {
    using D = device_t<scalar_t>;
    using A = compute_t<scalar_t>;
    int G = group_size(C, kVec<D>), block = G < 256 ? 256 : G;
    int64_t upb = block / G, tiles = (N + upb - 1) / upb;
    unsigned grid = unsigned(std::min<int64_t>(tiles, int64_t(sm_count()) * 32));
    cross_entropy_backward_kernel<scalar_t><<<grid, block, 0, current_stream()>>>(
        static_cast<const D*>(logits.raw_data()), static_cast<const int64_t*>(target.raw_data()),
        static_cast<const A*>(lse.raw_data()), static_cast<const A*>(grad_loss.raw_data()), N, C, G, ignore_index,
        A(label_smoothing), vec_ok, static_cast<D*>(grad_logits.raw_data()));
    KILN_LAUNCH_CHECK("cross_entropy_backward_kernel", "cross_entropy_backward");
  });
}

}  // namespace kiln::cuda
