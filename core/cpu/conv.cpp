// 2-D convolution on the CPU as im2col + batched GEMM, the reference for every other device.
//   forward:         out[n] = W (O, C*kh*kw) · cols(x[n]) (C*kh*kw, L) (+ bias[o]),   L = oh*ow
//   backward input:  grad_x  = col2im(Wᵀ · grad_out[n])
//   backward weight: grad_w  = sum_n grad_out[n] · cols(x[n])ᵀ
// Each step rounds to the storage dtype where the composed ops (matmul, add, sum) did before this moved
// into the kernels, so results are bit-identical to that composition. cols is recomputed in
// backward rather than saved: it holds kh*kw times the input.
#include <kiln/core/kernels/conv.h>
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/reduce.h>

namespace kiln::cpu {

namespace {

Tensor make_cols(const Tensor& x, const Window2d& g) {
  Tensor cols = empty({g.n, g.c * g.kh * g.kw, g.oh * g.ow}, {.dtype = x.dtype()});
  kernels::im2col(x, g, cols);
  return cols;
}

}  // namespace

void kernels::conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Window2d& g,
                                const Tensor& out) {
  int64_t O = w.size(0), CK = g.c * g.kh * g.kw, L = g.oh * g.ow;
  Tensor cols = make_cols(x, g);
  Tensor wb = w.reshape({1, O, CK}).expand({g.n, O, CK});  // one weight for every sample (batch stride 0)
  Tensor out3 = out.reshape({g.n, O, L});
  if (!bias.defined()) {
    bmm(wb, cols, out3);
    return;
  }
  Tensor prod = empty({g.n, O, L}, {.dtype = out.dtype()});
  bmm(wb, cols, prod);
  binary(BinaryOp::add, prod, bias.reshape({1, O, 1}).expand({g.n, O, L}), out3);
}

void kernels::conv2d_backward_input(const Tensor& grad_out, const Tensor& w, const Window2d& g,
                                       const Tensor& grad_x) {
  int64_t O = w.size(0), CK = g.c * g.kh * g.kw, L = g.oh * g.ow;
  Tensor wt = w.reshape({O, CK}).t().unsqueeze(0).expand({g.n, CK, O});  // column-major Wᵀ, shared
  Tensor dcols = empty({g.n, CK, L}, {.dtype = grad_x.dtype()});
  bmm(wt, grad_out.reshape({g.n, O, L}), dcols);
  fill(grad_x, 0.0);
  col2im(dcols, g, grad_x);
}

void kernels::conv2d_backward_weight(const Tensor& grad_out, const Tensor& x, const Window2d& g,
                                        const Tensor& grad_w) {
  int64_t O = grad_w.size(0), CK = g.c * g.kh * g.kw, L = g.oh * g.ow;
  if (grad_w.numel() == 0) return;
  if (g.n == 0) {
    fill(grad_w, 0.0);
    return;
  }
  Tensor cols = make_cols(x, g);
  Tensor per_sample = empty({g.n, O, CK}, {.dtype = grad_w.dtype()});
  bmm(grad_out.reshape({g.n, O, L}), cols.transpose(1, 2), per_sample);
  // sum over n: rows (o, ck) of a contiguous (O*CK, N) matrix, as the reduction op lays it out
  Tensor rows = empty({O, CK, g.n}, {.dtype = grad_w.dtype()});
  copy(per_sample.permute({1, 2, 0}), rows);
  reduce(ReduceOp::sum, rows.reshape({O * CK, g.n}), grad_w.reshape({O * CK}));
}

}  // namespace kiln::cpu
