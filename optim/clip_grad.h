#pragma once
// Gradient clipping by global norm, as torch.nn.utils.clip_grad_norm_.
#include <limits>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::optim {

// The norm of all gradients taken together, as if concatenated into one vector:
//   total = (sum_i sum_j |g_ij|^norm_type)^(1/norm_type),   or max_ij |g_ij| for norm_type = inf.
// When total > max_norm every gradient is scaled in place by max_norm / (total + 1e-6) (the 1e-6 keeps a
// zero norm harmless and is PyTorch's). Parameters without a gradient are skipped. Returns the norm
// before clipping. A non-finite total norm throws kiln::Error when error_if_nonfinite is set; otherwise
// the gradients are scaled by the resulting non-finite factor (NaN propagates, as in PyTorch).
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                      bool error_if_nonfinite = false);

// The same clipping without waiting for the device: the norm, the factor min(1, max_norm / (total + 1e-6))
// and the scaling all stay on the gradients' device, and the norm comes back as a 0-d tensor there (as
// torch.nn.utils.clip_grad_norm_ returns it). Use it in GPU training loops, where reading the norm on the
// host would stall the step every iteration. All gradients must be on one device.
Tensor clip_grad_norm_async(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0);
// clip_grad_norm_async over gradient tensors themselves (a flat gradient buffer, FlatParameters::grad()).
Tensor clip_gradients_async(const std::vector<Tensor>& grads, double max_norm, double norm_type = 2.0);

inline constexpr double kInfNorm = std::numeric_limits<double>::infinity();

}  // namespace kiln::optim
