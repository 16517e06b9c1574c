#pragma once
// Kernel family: cross-entropy over rows of logits.
#include <cstdint>

#include <kiln/core/kernel.h>

// logits (N, C) contiguous, target (N) i64. loss (N) stat dtype: per-row loss (0 for ignored rows); lse (N)
// stat dtype: log-sum-exp of each row, saved for backward.
KILN_KERNEL(cross_entropy, void(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                double label_smoothing, const Tensor& loss, const Tensor& lse));
// grad_logits (N, C) = grad_loss[n] * d loss[n] / d logits[n, :]; grad_loss (N) stat dtype. grad_logits may
// be logits itself (each element is read before it is overwritten).
KILN_KERNEL(cross_entropy_backward, void(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                         const Tensor& grad_loss, int64_t ignore_index, double label_smoothing,
                                         const Tensor& grad_logits));
// loss and lse as cross_entropy, and logits overwritten by grad_loss[n] · d loss[n] / d logits[n, :]: the
// gradient computed ahead, for a loss whose upstream gradient is known up to a scalar. The CPU runs
// cross_entropy, then cross_entropy_backward in place; the GPU does both in one pass.
KILN_KERNEL(cross_entropy_in_place, void(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                         double label_smoothing, const Tensor& grad_loss, const Tensor& loss,
                                         const Tensor& lse));
