// Multi-tensor kernels: the fused AdamW step and the loss-scaler unscale, each covering many tensors
// per launch. The host packs (tensor, chunk) work items into the kernel's argument block; every CUDA
// block handles one chunk of kChunk elements of one tensor.
//
// AdamW moves per element: read p, g (param dtype), m, v (f32); write p, m, v: 2·|p| + 2·|p| + 16 bytes
// (28 bytes for f32 params). Unscale reads and writes each gradient once.
#include <cmath>

#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/cuda_backend.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>

namespace kiln::cuda {

namespace {

constexpr int kMaxTensors = 40;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

struct TensorList {
  void* ptr[4][kMaxTensors];
  int64_t size[kMaxTensors];
  unsigned char block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};
static_assert(sizeof(TensorList) < 4000, "kernel parameters are limited to 4 KiB");

// In double so f64 parameters get f64 hyper-parameters; f32 kernels round them once.
struct AdamWArgs {
  double beta1, beta2, eps, decay, step_size, bc2_sqrt;
};

template <class P, class S>
__global__ void adamw_kernel(TensorList tl, AdamWArgs a) {
  int t = tl.block_tensor[blockIdx.x];
  int64_t base = int64_t(tl.block_chunk[blockIdx.x]) * kChunk;
  int64_t n = min(kChunk, tl.size[t] - base);
  using DP = device_t<P>;
  DP* p = static_cast<DP*>(tl.ptr[0][t]) + base;
  const DP* g = static_cast<const DP*>(tl.ptr[1][t]) + base;
  S* m = static_cast<S*>(tl.ptr[2][t]) + base;
  S* v = static_cast<S*>(tl.ptr[3][t]) + base;
  using C = S;  // arithmetic in the state dtype
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    C gi = convert<C>(g[i]);
    C mi = C(a.beta1) * m[i] + (C(1) - C(a.beta1)) * gi;
    C vi = C(a.beta2) * v[i] + (C(1) - C(a.beta2)) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    C denom = sqrt(vi) / C(a.bc2_sqrt) + C(a.eps);
    p[i] = convert<DP>(convert<C>(p[i]) * C(a.decay) - C(a.step_size) * mi / denom);
  }
}

template <class T>
__global__ void unscale_kernel(TensorList tl, const float* inv_scale, float* found_inf) {
  int t = tl.block_tensor[blockIdx.x];
  int64_t base = int64_t(tl.block_chunk[blockIdx.x]) * kChunk;
  int64_t n = min(kChunk, tl.size[t] - base);
  using D = device_t<T>;
  D* x = static_cast<D*>(tl.ptr[0][t]) + base;
  using C = compute_t<T>;
  C inv = C(*inv_scale);
  bool bad = false;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    C v = convert<C>(x[i]);
    bad |= !isfinite(v);
    x[i] = convert<D>(v * inv);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;  // benign race: every writer writes 1
}

// Packs tensors into as few launches as the argument block allows and calls launch(list, blocks).
template <class Launch>
void for_each_launch(const std::vector<std::vector<Tensor>>& lists, Launch&& launch) {
  TensorList tl{};
  int nt = 0, nb = 0;  // tensor slots and blocks used in the pending launch
  for (size_t i = 0; i < lists[0].size(); ++i) {
    int64_t n = lists[0][i].numel();
    if (n == 0) continue;
    for (size_t k = 0; k < lists.size(); ++k) tl.ptr[k][nt] = lists[k][i].raw_data();
    tl.size[nt] = n;
    int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      tl.block_tensor[nb] = (unsigned char)nt;
      tl.block_chunk[nb] = int(c);
      if (++nb < kMaxBlocks) continue;
      launch(tl, nb);
      nb = 0;
      // The rest of this tensor's chunks go in the next launch, with the tensor in slot 0.
      for (size_t k = 0; k < lists.size(); ++k) tl.ptr[k][0] = tl.ptr[k][nt];
      tl.size[0] = tl.size[nt];
      nt = 0;
    }
    if (nb == 0) continue;  // everything so far launched: slot 0 is free again
    if (++nt == kMaxTensors) {
      launch(tl, nb);
      nb = 0;
      nt = 0;
    }
  }
  if (nb) launch(tl, nb);
}

void check_list(const std::vector<Tensor>& ts, const char* op) {
  for (const Tensor& t : ts)
    KILN_CHECK(t.device().is_cuda() && t.is_contiguous(), op, ": expected contiguous CUDA tensors, got ", t.str());
}

}  // namespace

void CudaBackend::adamw_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                             const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                             const AdamWHyper& h) const {
  NvtxRange range("adamw_step");
  if (params.empty()) return;
  for (const auto* l : {&params, &grads, &exp_avgs, &exp_avg_sqs}) check_list(*l, "adamw_step");
  DeviceGuard guard(params[0].device().index);
  AdamWArgs a{h.beta1, h.beta2, h.eps, 1.0 - h.lr * h.weight_decay, h.lr / h.bias_correction1,
              h.bias_correction2_sqrt};
  // One launch sequence per (param dtype, state dtype) pair present.
  for (DType pd : {DType::f32, DType::f16, DType::bf16, DType::f64}) {
    std::vector<std::vector<Tensor>> lists(4);
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].dtype() != pd) continue;
      KILN_CHECK(grads[i].dtype() == pd && exp_avgs[i].dtype() == exp_avg_sqs[i].dtype(), "adamw_step: dtypes of ",
                 params[i].str(), ", ", grads[i].str(), ", ", exp_avgs[i].str(), " do not fit");
      lists[0].push_back(params[i]);
      lists[1].push_back(grads[i]);
      lists[2].push_back(exp_avgs[i]);
      lists[3].push_back(exp_avg_sqs[i]);
    }
    if (lists[0].empty()) continue;
    bool f64_state = lists[2][0].dtype() == DType::f64;
    KILN_DISPATCH_FLOATING(pd, "adamw_step", {
      for_each_launch(lists, [&](const TensorList& tl, int blocks) {
        if (f64_state) adamw_kernel<scalar_t, double><<<blocks, kThreads, 0, current_stream()>>>(tl, a);
        else adamw_kernel<scalar_t, float><<<blocks, kThreads, 0, current_stream()>>>(tl, a);
        KILN_LAUNCH_CHECK("adamw_kernel", "adamw_step");
      });
    });
  }
}

void CudaBackend::amp_unscale(const std::vector<Tensor>& tensors, const Tensor& inv_scale, const Tensor& found_inf) const {
  NvtxRange range("amp_unscale");
  if (tensors.empty()) return;
  check_list(tensors, "amp_unscale");
  DeviceGuard guard(tensors[0].device().index);
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::f64}) {
    std::vector<std::vector<Tensor>> lists(1);
    for (const Tensor& t : tensors)
      if (t.dtype() == d) lists[0].push_back(t);
    if (lists[0].empty()) continue;
    KILN_DISPATCH_FLOATING(d, "amp_unscale", {
      for_each_launch(lists, [&](const TensorList& tl, int blocks) {
        unscale_kernel<scalar_t><<<blocks, kThreads, 0, current_stream()>>>(
            tl, static_cast<const float*>(inv_scale.raw_data()), static_cast<float*>(found_inf.raw_data()));
        KILN_LAUNCH_CHECK("unscale_kernel", "amp_unscale");
      });
    });
  }
}

}  // namespace kiln::cuda
