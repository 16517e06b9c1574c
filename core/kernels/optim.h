#pragma once
// Kernel family: fused optimizer and loss-scaler steps over many tensors.
#include <vector>

#include <kiln/core/kernel.h>

namespace kiln {
// Hyper-parameters of one AdamW step; bias corrections are computed on the host in double.
struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay;
  double bias_correction1;       // 1 - beta1^t
  double bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};
}  // namespace kiln

// Fused AdamW (all tensors contiguous, on one device). For each i, with g = grads[i] and m, v = exp_avgs[i],
// exp_avg_sqs[i] (state dtype, f32 or f64):
//   p ← p (1 - lr wd);  m ← β1 m + (1-β1) g;  v ← β2 v + (1-β2) g²;
//   p ← p - (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps)
// computed in the state dtype and rounded once into p's dtype.
KILN_KERNEL(adamw_step, void(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                             const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                             const AdamWHyper& h));
// Loss-scaler unscale: every tensor (contiguous, floating) ← tensor · inv_scale, and found_inf (f32 scalar)
// is set to 1 if any element of any tensor is not finite. inv_scale is an f32 scalar tensor on this device,
// so no value crosses to the host.
KILN_KERNEL(amp_unscale, void(const std::vector<Tensor>& tensors, const Tensor& inv_scale, const Tensor& found_inf));
