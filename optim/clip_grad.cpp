#include <kiln/optim/clip_grad.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>

namespace kiln::optim {

namespace {

std::vector<Tensor> defined_grads(const std::vector<Tensor>& params) {
  std::vector<Tensor> grads;
  for (const auto& p : params) {
    Tensor g = p.grad();
    if (g.defined() && g.numel() > 0) grads.push_back(g);
  }
  return grads;
}

// The total norm of `grads` as a 0-d tensor on their device, accumulated in f32 (f64 when every gradient
// is f64): one reduction per gradient, then one over the partial results. NaN anywhere gives NaN.
Tensor total_norm(const std::vector<Tensor>& grads, double norm_type) {
  bool all_f64 = true;
  for (const auto& g : grads) all_f64 &= g.dtype() == DType::f64;
  const DType acc = all_f64 ? DType::f64 : DType::f32;
  const bool inf_norm = std::isinf(norm_type);
  std::vector<Tensor> parts;
  for (const auto& g : grads) {
    KILN_CHECK(g.device() == grads[0].device(), "clip_grad_norm: gradients on ", grads[0].device().str(), " and ",
               g.device().str(), "; all must be on one device");
    Tensor a = abs(g.to(acc));
    if (inf_norm) parts.push_back(amax(a));
    else if (norm_type == 2.0) parts.push_back(sum(square(a)));
    else if (norm_type == 1.0) parts.push_back(sum(a));
    else parts.push_back(sum(pow(a, norm_type)));
  }
  Tensor all = stack(parts), s = sum(all);
  if (inf_norm) return where(ne(s, s), s, amax(all));  // the sum is NaN exactly when a part is (parts are >= 0)
  if (norm_type == 2.0) return sqrt(s);
  if (norm_type == 1.0) return s;
  return pow(s, 1.0 / norm_type);
}

}  // namespace

Tensor clip_grad_norm_async(const std::vector<Tensor>& params, double max_norm, double norm_type) {
  return clip_gradients_async(defined_grads(params), max_norm, norm_type);
}

Tensor clip_gradients_async(const std::vector<Tensor>& grads_in, double max_norm, double norm_type) {
  KILN_CHECK(norm_type > 0.0, "clip_grad_norm: norm_type must be positive (or infinity), got ", norm_type);
  KILN_CHECK(max_norm >= 0.0, "clip_grad_norm: max_norm must be non-negative, got ", max_norm);
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& g : grads_in)
    if (g.defined() && g.numel() > 0) grads.push_back(g);
  if (grads.empty()) return zeros({});
  Tensor total = total_norm(grads, norm_type);
  // min(1, max_norm / (total + 1e-6)) as PyTorch's clamp(max=1): a NaN factor is applied, as in PyTorch.
  Tensor q = rdiv(add(total, 1e-6), max_norm);
  Tensor coef = where(ge(q, full({}, 1.0, {.dtype = q.dtype(), .device = q.device()})),
                      full({}, 1.0, {.dtype = q.dtype(), .device = q.device()}), q);
  for (auto& g : grads) g.mul_(coef);
  return total;
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  KILN_CHECK(norm_type > 0.0, "clip_grad_norm: norm_type must be positive (or infinity), got ", norm_type);
  KILN_CHECK(max_norm >= 0.0, "clip_grad_norm: max_norm must be non-negative, got ", max_norm);
  NoGradGuard no_grad;
  std::vector<Tensor> grads = defined_grads(params);
  if (grads.empty()) return 0.0;
  const double total = total_norm(grads, norm_type).item<double>();  // one wait for the device
  KILN_CHECK(!error_if_nonfinite || std::isfinite(total), "clip_grad_norm: the total norm of order ", norm_type,
             " of the gradients of ", grads.size(), " parameters is non-finite (", total,
             "), so they cannot be clipped; pass error_if_nonfinite = false to clip anyway");
  const double coef = max_norm / (total + 1e-6);
  // coef >= 1 would leave the gradients unchanged (PyTorch clamps it to 1), so skip the pass. A NaN coef
  // fails the test and is applied, as in PyTorch.
  if (!(coef >= 1.0))
    for (auto& g : grads) g.mul_(coef);
  return total;
}

}  // namespace kiln::optim
