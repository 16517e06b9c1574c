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
  // CUDA graphs: when set, the CUDA kernel reads the seven values above, in this order, from this device
  // memory at run time (a replay hook writes each replay's), instead of the ones captured.
  const double* device_hyper = nullptr;
  // When set: an f32 in the tensors' memory (device memory for the CUDA kernel), GradScaler's inf/NaN flag;
  // where it is nonzero the kernel writes nothing (the skipped step of a CUDA graph replay, decided on the
  // device). Its value is read when the kernel runs.
  const float* found_inf = nullptr;
};
// One Shampoo step's elementwise moments (optim::Shampoo): the filtered gradient and the grafted method's
// direction; bias corrections computed on the host in double.
struct ShampooMomentsHyper {
  double beta1;              // 0: no first moment (the filtered gradient is the gradient)
  double bias_correction1;   // 1 - beta1^t
  int grafting;              // 0: none or SGD (no second statistic), 2: AdaGrad, 3: Adam (optim::Grafting's values)
  double grafting_beta2;     // Adam's
  double grafting_bias_correction;  // Adam's 1 - grafting_beta2^t
  double grafting_epsilon;
  // CUDA graphs: when set, the CUDA kernel reads {bias_correction1, grafting_bias_correction} from this
  // device memory at run time (a replay hook writes each replay's) instead of the captured ones.
  const double* device_hyper = nullptr;
};
// The update of a Shampoo step from its directions.
struct ShampooApplyHyper {
  double lr, weight_decay, momentum;
  bool nesterov;
  // CUDA graphs: when set, the CUDA kernel reads {lr, weight_decay} from this device memory at run time.
  const double* device_hyper = nullptr;
};
// A column-blocked companion of a matrix x of shape (R, k·C), k ≥ 2: a (k, R, C) tensor whose [b, r, c] is
// x[r, b·C + c], x's k column blocks stacked (Shampoo's operand and product stacks of a matrix cut into
// column blocks). shampoo_moments' copies and shampoo_apply's directions may be one. count 0: a companion that
// corresponds element for element, in flat order.
struct ColumnBlocks {
  int64_t count = 0, rows = 0, cols = 0;  // k, R, C
  // where element i of x (row-major) is in the companion (the CPU's loops and the GPU's kernels both call it)
#if defined(__CUDACC__)
  __host__ __device__
#endif
  int64_t offset(int64_t i) const {
    if (count == 0) return i;
    const int64_t width = count * cols, r = i / width, c = i - r * width, b = c / cols;
    return (b * rows + r) * cols + (c - b * cols);
  }
};
inline ColumnBlocks column_blocks(const Tensor& companion, const Tensor& x) {
  if (companion.dim() != 3 || x.dim() != 2 || companion.size(0) < 2 || companion.size(1) != x.size(0) ||
      companion.size(0) * companion.size(2) != x.size(1))
    return {};
  return {companion.size(0), companion.size(1), companion.size(2)};
}
}  // namespace kiln

// Fused AdamW (all tensors contiguous, on one device). For each i, with g = grads[i] and m, v = exp_avgs[i],
// exp_avg_sqs[i] (state dtype, f32 or f64):
//   p ← p (1 - lr wd);  m ← β1 m + (1-β1) g;  v ← β2 v + (1-β2) g²;
//   p ← p - (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps)
// computed in the state dtype and rounded once into p's dtype. copies (empty, or one per parameter, each
// undefined or a contiguous bf16/f16 tensor of an f32 parameter's shape: amp::cast_parameter's kept copy)
// get the new p rounded into their dtype in the same pass.
KILN_KERNEL(adamw_step, void(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                             const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                             const std::vector<Tensor>& copies, const AdamWHyper& h));
// Loss-scaler unscale: every tensor (contiguous, floating) ← tensor · inv_scale, and found_inf (f32 scalar)
// is set to 1 if any element of any tensor is not finite. inv_scale is an f32 scalar tensor on this device,
// so no value crosses to the host.
KILN_KERNEL(amp_unscale, void(const std::vector<Tensor>& tensors, const Tensor& inv_scale, const Tensor& found_inf));
// Shampoo's moments over many tensors (contiguous, one device). For each i, with g = grads[i] (parameter
// dtype) and the state tensors in the state dtype (f32, f64 for f64 parameters):
//   first moment (beta1 > 0):  m ← β1 m + (1-β1) g,  f = m / bc1;   else f = g        (filtered[i] ← f)
//   Adam grafting:             v ← βg v + (1-βg) g², grafted[i] ← f / (sqrt(v / bcg) + ε)
//   AdaGrad grafting:          v ← v + g²,           grafted[i] ← f / (sqrt(v) + ε)
// exp_avgs is empty without a first moment; grafting_states and grafted are empty for none / SGD grafting
// (whose direction is f itself). grad_copies and filtered_copies (each empty, or one per tensor, undefined or
// a contiguous bf16 tensor of the gradient's numel, any shape, on its device) get g and f rounded to bf16 in
// the same pass: Shampoo::bf16 writes the operands of its products there, rows of the stacks they read (a
// copy that is a column-blocked companion of its gradient, ColumnBlocks above, gets each element at its place
// there; both copies of a tensor then so, and its grafted sum undefined). With
// Adam's or AdaGrad's grafting, filtered[i] may be undefined where filtered_copies[i] is defined: f is then
// written only as that copy. grafted_sums (empty, or one per tensor, undefined or a one-element tensor in the
// state dtype on its device; Adam's or AdaGrad's grafting) gets Σ grafted² of its tensor, the squares of the
// direction as rounded to the state dtype, accumulated in f64 in a fixed order (the same every run; on the
// CPU the elements' order, as kernels::matrix_sum_squares sums a block) and rounded once: Shampoo's grafting
// norm ‖D_b‖² of a block. Where grafted_sums[i] is defined, grafted[i] may be undefined: the direction is then
// not written, only its sum.
KILN_KERNEL(shampoo_moments, void(const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avgs,
                                  const std::vector<Tensor>& grafting_states, const std::vector<Tensor>& filtered,
                                  const std::vector<Tensor>& grafted, const std::vector<Tensor>& grad_copies,
                                  const std::vector<Tensor>& filtered_copies, const std::vector<Tensor>& grafted_sums,
                                  const ShampooMomentsHyper& h));
namespace kiln {
// shampoo_moments' filtered tensors and copies, checked by both implementations
inline void check_moments_copies(const std::vector<Tensor>& grads, const std::vector<Tensor>& filtered,
                                 const std::vector<Tensor>& grafted, const std::vector<Tensor>& grad_copies,
                                 const std::vector<Tensor>& filtered_copies, const std::vector<Tensor>& grafted_sums,
                                 const ShampooMomentsHyper& h) {
  KILN_CHECK(filtered.size() == grads.size(), "shampoo_moments: ", filtered.size(), " filtered tensors for ",
             grads.size(), " gradients");
  const bool graft = h.grafting == 2 || h.grafting == 3;
  for (size_t i = 0; i < grads.size(); ++i)
    KILN_CHECK(filtered[i].defined() || (graft && !filtered_copies.empty() && filtered_copies[i].defined()),
               "shampoo_moments: the filtered gradient of ", grads[i].str(), " is undefined, which only a tensor "
               "with a bf16 copy of it and Adam's or AdaGrad's grafting may leave");
  KILN_CHECK(grafted_sums.empty() || (graft && grafted_sums.size() == grads.size()), "shampoo_moments: ",
             grafted_sums.size(), " grafted sums for ", grads.size(), " gradients",
             graft ? "" : " (sums of the grafted directions need Adam's or AdaGrad's grafting)");
  KILN_CHECK(!graft || grafted.size() == grads.size(), "shampoo_moments: ", grafted.size(),
             " grafted directions for ", grads.size(), " gradients");
  for (size_t i = 0; graft && i < grads.size(); ++i) {
    const Tensor& sum = grafted_sums.empty() ? Tensor() : grafted_sums[i];
    KILN_CHECK(!sum.defined() || (sum.numel() == 1 && sum.is_contiguous() && sum.device() == grads[i].device() &&
                                  sum.dtype() == (grads[i].dtype() == DType::f64 ? DType::f64 : DType::f32)),
               "shampoo_moments: a grafted sum ", sum.defined() ? sum.str() : std::string(), " does not fit gradient ",
               grads[i].str(), " (expected one element in the state dtype on its device)");
    KILN_CHECK(grafted[i].defined() || sum.defined(), "shampoo_moments: the grafted direction of ", grads[i].str(),
               " is undefined, which only a tensor whose direction's sum of squares is asked for may leave");
  }
  for (const auto* l : {&grad_copies, &filtered_copies}) {
    KILN_CHECK(l->empty() || l->size() == grads.size(), "shampoo_moments: ", l->size(), " copies for ",
               grads.size(), " gradients");
    for (size_t i = 0; i < l->size(); ++i) {
      const Tensor& c = (*l)[i];
      KILN_CHECK(!c.defined() || (c.dtype() == DType::bf16 && c.is_contiguous() && c.numel() == grads[i].numel() &&
                                  c.device() == grads[i].device() && grads[i].dtype() != DType::f64),
                 "shampoo_moments: a copy ", c.defined() ? c.str() : std::string(), " does not fit gradient ",
                 grads[i].str(), " (expected a contiguous bf16 tensor of its numel on its device, for a gradient "
                 "of f32 state: its values rounded once)");
    }
  }
  // a column-blocked copy: both copies of the tensor alike, and no grafted sum
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor none;
    const Tensor& gc = grad_copies.empty() ? none : grad_copies[i];
    const Tensor& fc = filtered_copies.empty() ? none : filtered_copies[i];
    const int64_t gb = gc.defined() ? column_blocks(gc, grads[i]).count : 0;
    const int64_t fb = fc.defined() ? column_blocks(fc, grads[i]).count : 0;
    if (gb == 0 && fb == 0) continue;
    KILN_CHECK((!gc.defined() || !fc.defined() || gc.sizes() == fc.sizes()) &&
                   (grafted_sums.empty() || !grafted_sums[i].defined()),
               "shampoo_moments: the copies of gradient ", grads[i].str(), " (", gc.defined() ? gc.str() : "none", ", ",
               fc.defined() ? fc.str() : "none", ") must be column-blocked alike, and without a grafted sum");
  }
}
// shampoo_apply's directions and their scales, checked by both implementations
inline void check_apply_scales(const std::vector<Tensor>& params, const std::vector<Tensor>& directions,
                               const std::vector<Tensor>& direction_scales) {
  KILN_CHECK(directions.size() == params.size() && (direction_scales.empty() || direction_scales.size() == params.size()),
             "shampoo_apply: ", directions.size(), " directions and ", direction_scales.size(), " scales for ",
             params.size(), " parameters");
  for (size_t i = 0; i < params.size(); ++i) {
    KILN_CHECK(directions[i].numel() == params[i].numel(), "shampoo_apply: direction ", directions[i].str(),
               " for parameter ", params[i].str());
    const Tensor& s = direction_scales.empty() ? directions[i] : direction_scales[i];
    const int64_t blocks = column_blocks(directions[i], params[i]).count;
    KILN_CHECK(direction_scales.empty() || !s.defined() ||
                   (s.numel() == (blocks > 0 ? blocks : 1) && s.is_contiguous() &&
                    s.dtype() == directions[i].dtype() && s.device() == directions[i].device()),
               "shampoo_apply: a direction's scale ", s.defined() ? s.str() : std::string(),
               " must be one element in the direction's dtype and device (one a column block of a column-blocked "
               "direction): direction ",
               directions[i].str(), ", parameter ", params[i].str());
  }
}
}  // namespace kiln
// Shampoo's update over many tensors: with d = directions[i] (state dtype),
//   momentum μ > 0:  b ← μ b + d (momentum_buffers[i]);  d ← nesterov ? d + μ b : b
//   p ← p (1 - lr·wd) - lr·d        computed in the state dtype, rounded once into p's dtype
// momentum_buffers is empty when μ = 0. copies as adamw_step's (amp::cast_parameter's kept copies, written
// with the new p in the same pass). direction_scales (empty, or one per tensor, each undefined or a one-element
// tensor in the state dtype on the tensor's device): d ← scale·d first, rounded in the state dtype (a Shampoo
// block's grafting step size, its direction read where its product left it: no scaled copy). A direction
// needs only the parameter's numel (any shape), or is a column-blocked companion of a 2-D parameter
// (ColumnBlocks: the rows of the product stack of a matrix cut into k column blocks), whose scale then has k
// elements, block b's direction taking element b.
KILN_KERNEL(shampoo_apply, void(const std::vector<Tensor>& params, const std::vector<Tensor>& directions,
                                const std::vector<Tensor>& momentum_buffers, const std::vector<Tensor>& copies,
                                const std::vector<Tensor>& direction_scales, const ShampooApplyHyper& h));

