#include <kiln/nn/linear_backward.h>

#include <kiln/core/op.h>

namespace kiln::nn::functional::detail {

LinearGrads linear_layer_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& pre, Epilogue ep,
                                  LinearWants want, DType wdt, DType bdt, size_t w_input) {
  const int64_t M = dy.size(0), N = dy.size(1);
  const Device dev = dy.device();
  const DType gt = dy.dtype();
  const TensorOptions to{.dtype = gt, .device = dev};
  Tensor dx = want.dx ? empty({M, w.size(1)}, to) : Tensor();
  const Shape wshape = want.dw ? Shape{N, x.size(1)} : Shape{};
  if ((gt == DType::bf16 || gt == DType::f16) && (!want.dw || wdt == DType::f32) && (!want.db || bdt == DType::f32)) {
    TensorOptions f32{.dtype = DType::f32, .device = dev};
    Tensor dw = want.dw ? pinned_gradient_or_empty(w_input, wshape, f32) : Tensor();
    Tensor db = want.db ? pinned_gradient_or_empty(w_input + 1, {N}, f32) : Tensor();
    if (kernels::linear_backward_f32_params(dy, x, w, pre, ep, dx, dw, db)) return {dx, dw, db};
  }
  Tensor dw = want.dw ? pinned_gradient_or_empty(w_input, wshape, to) : Tensor();
  Tensor db = want.db ? pinned_gradient_or_empty(w_input + 1, {N}, to) : Tensor();
  kernels::linear_backward(dy, x, w, pre, ep, dx, dw, db);
  return {dx, want.dw ? cast(dw, wdt) : Tensor(), want.db ? cast(db, bdt) : Tensor()};
}

}  // namespace kiln::nn::functional::detail
