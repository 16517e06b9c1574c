// matmul with NumPy semantics, built from differentiable views around one batched GEMM node.
#include <algorithm>

#include <kiln/core/kernels/gemm.h>
#include <kiln/core/op.h>

namespace kiln {

namespace {

// Whether a (B, R, C) operand is column-major in its last two dims: a transposed view of a contiguous
// matrix (the saved input of matmul(x, y.transpose(-2, -1)) and the like).
bool column_major(const Tensor& x) {
  return x.size(1) > 1 && x.size(2) > 1 && x.stride(1) == 1 && x.stride(2) == x.size(1);
}

// (B, M, K) · (B, K, N) -> (B, M, N)
Tensor bmm3(const Tensor& a, const Tensor& b) {
  Tensor out = empty({a.size(0), a.size(1), b.size(2)}, {.dtype = a.dtype(), .device = a.device()});
  {
    NoGradGuard ng;
    kernels::bmm(matrix_ready(a), matrix_ready(b), out);
  }
  if (any_requires_grad({a, b}))
    record("matmul", {a, b}, {out}, [sa = SavedTensor(a), sb = SavedTensor(b), ra = a.requires_grad(),
                                     rb = b.requires_grad()](const Grads& g) {
      // dA = G Bᵀ, dB = Aᵀ G. A gradient takes its operand's layout: for a column-major operand the GEMM
      // writes the transpose, dAᵀ = B Gᵀ (dBᵀ = Gᵀ A), so that the gradient of the contiguous matrix it is a
      // transposed view of comes out contiguous, not as a strided view every later add or copy reads slowly.
      Tensor ga, gb;
      if (ra) {
        const Tensor A = sa.unpack("matmul"), B = sb.unpack("matmul");
        ga = column_major(A) ? bmm3(B, g[0].transpose(1, 2)).transpose(1, 2) : bmm3(g[0], B.transpose(1, 2));
      }
      if (rb) {
        const Tensor A = sa.unpack("matmul"), B = sb.unpack("matmul");
        gb = column_major(B) ? bmm3(g[0].transpose(1, 2), A).transpose(1, 2) : bmm3(A.transpose(1, 2), g[0]);
      }
      return Grads{ga, gb};
    });
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  KILN_CHECK(a_in.device() == b_in.device(), "matmul: tensors on different devices: ", a_in.str(), " and ", b_in.str());
  KILN_CHECK(a_in.dim() >= 1 && b_in.dim() >= 1, "matmul: both operands need at least 1 dim, got ", a_in.str(), " and ",
             b_in.str());
  KILN_CHECK(is_floating(a_in.dtype()) && is_floating(b_in.dtype()), "matmul: expected floating-point tensors, got ",
             a_in.str(), " and ", b_in.str());
  // Under autocast both operands go to its dtype; otherwise the wider of the two.
  Tensor al = amp::to_lower_precision(a_in), bl = amp::to_lower_precision(b_in);
  DType t = promote_types(al.dtype(), bl.dtype());
  Tensor a = cast(al, t), b = cast(bl, t);
  bool a_vec = a.dim() == 1, b_vec = b.dim() == 1;
  if (a_vec) a = a.unsqueeze(0);
  if (b_vec) b = b.unsqueeze(1);
  int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  KILN_CHECK(b.size(-2) == K, "matmul: inner dimensions differ: ", a_in.str(), " and ", b_in.str());

  Shape result;
  Tensor out;
  if (b.dim() == 2) {
    // (..., M, K) · (K, N): fold every batch dim into M for one GEMM with a shared weight.
    Shape batch(a.sizes().begin(), a.sizes().end() - 2);
    // explicit sizes, not -1: a -1 cannot be inferred when K == 0
    out = bmm3(a.reshape({1, shape_numel(batch) * M, K}), b.unsqueeze(0));
    result = batch;
  } else {
    Shape ba(a.sizes().begin(), a.sizes().end() - 2), bb(b.sizes().begin(), b.sizes().end() - 2);
    Shape batch;
    try {
      batch = broadcast_shapes(ba, bb, "matmul");
    } catch (const Error&) {  // name the operands, not just their batch dims
      KILN_FAIL("matmul: the batch dims of ", a_in.str(), " and ", b_in.str(), " cannot be broadcast together");
    }
    Shape ea = batch, eb = batch;
    ea.insert(ea.end(), {M, K});
    eb.insert(eb.end(), {K, N});
    int64_t nb = shape_numel(batch);
    out = bmm3(a.expand(ea).reshape({nb, M, K}), b.expand(eb).reshape({nb, K, N}));
    result = batch;
  }
  if (!a_vec) result.push_back(M);
  if (!b_vec) result.push_back(N);
  return out.reshape(result);
}

Tensor scaled_mm(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b, DType out_dtype,
                 const Tensor& bias, bool use_fast_accum) {
  const char* op = "scaled_mm";
  KILN_CHECK(a.defined() && b.defined() && scale_a.defined() && scale_b.defined(), op,
             ": a, b, scale_a and scale_b must be defined");
  auto fp8 = [](DType t) { return t == DType::f8e4m3 || t == DType::f8e5m2; };
  KILN_CHECK(fp8(a.dtype()) && fp8(b.dtype()) && !(a.dtype() == DType::f8e5m2 && b.dtype() == DType::f8e5m2), op,
             ": expected FP8 operands (f8e4m3 or f8e5m2, not both f8e5m2), got ", a.str(), " and ", b.str());
  KILN_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), op, ": expected a (M, K) and b (K, N), got ",
             a.str(), " and ", b.str());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  KILN_CHECK(K % 16 == 0 && N % 16 == 0, op, ": K and N must be multiples of 16 (FP8 layouts), got a ", a.str(),
             " and b ", b.str());
  KILN_CHECK((a.stride(1) == 1 || K == 1) && a.stride(0) >= K && a.stride(0) % 16 == 0, op,
             ": a must be row-major with a row stride that is a multiple of 16, got ", a.str(), " with strides ",
             shape_str(a.strides()));
  KILN_CHECK(b.stride(0) == 1 && b.stride(1) >= K && b.stride(1) % 16 == 0, op,
             ": b must be column-major (the transpose of a row-major (N, K) matrix: w.t()), got ", b.str(),
             " with strides ", shape_str(b.strides()));
  for (const Tensor* s : {&scale_a, &scale_b})
    KILN_CHECK(s->numel() == 1 && s->dtype() == DType::f32, op, ": scales must be one-element f32 tensors, got ",
               s->str());
  KILN_CHECK(out_dtype == DType::bf16 || out_dtype == DType::f16 || out_dtype == DType::f32, op,
             ": out_dtype must be bf16, f16 or f32, got ", dtype_name(out_dtype));
  if (bias.defined())
    KILN_CHECK(out_dtype != DType::f32 && bias.dim() == 1 && bias.size(0) == N && bias.dtype() == out_dtype, op,
               ": bias must be (N) = (", N, ") of out_dtype ", dtype_name(out_dtype),
               " (bf16 or f16: none with an f32 output), got ", bias.str());
  for (const Tensor* t : {&b, &scale_a, &scale_b, &bias})
    KILN_CHECK(!t->defined() || t->device() == a.device(), op, ": tensors on different devices: a ", a.str(), ", ",
               t->str());
  KILN_CHECK(!any_requires_grad({a, b, scale_a, scale_b, bias}), op,
             ": not differentiable (its inputs require grad); FP8 training builds its own backward");
  Tensor out = empty({M, N}, {.dtype = out_dtype, .device = a.device()});
  if (out.numel() == 0) return out;
  if (K == 0) {  // an empty inner dim: the product is zero
    out.zero_();
    if (bias.defined()) out.add_(bias);
    return out;
  }
  kernels::scaled_gemm(a, b, scale_a.reshape({1}), scale_b.reshape({1}), bias.defined() ? bias.contiguous() : bias,
                       out, use_fast_accum, Tensor());
  return out;
}

}  // namespace kiln
