#include <kiln/optim/clip_grad.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>

namespace kiln::optim {

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  KILN_CHECK(norm_type > 0.0, "clip_grad_norm: norm_type must be positive (or infinity), got ", norm_type);
  KILN_CHECK(max_norm >= 0.0, "clip_grad_norm: max_norm must be non-negative, got ", max_norm);
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const auto& p : params) {
    Tensor g = p.grad();
    if (g.defined()) grads.push_back(g);
  }
  if (grads.empty()) return 0.0;

  // Each tensor reduces on its device (accumulating in at least f32); the few partial results are
  // combined on the host in double.
  const bool inf_norm = std::isinf(norm_type);
  double total = 0.0;
  for (const auto& g : grads) {
    if (g.numel() == 0) continue;
    if (inf_norm) {
      const double m = amax(abs(g)).item<double>();
      if (std::isnan(m) || m > total) total = m;  // a NaN sticks: nothing compares greater than it
    } else if (norm_type == 2.0) {
      total += sum(square(g)).item<double>();
    } else if (norm_type == 1.0) {
      total += sum(abs(g)).item<double>();
    } else {
      total += sum(pow(abs(g), norm_type)).item<double>();
    }
  }
  if (!inf_norm) total = norm_type == 2.0 ? std::sqrt(total) : norm_type == 1.0 ? total : std::pow(total, 1.0 / norm_type);

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
