#pragma once
// The op table shared by the op harness (tests/ops/op_harness_test.cpp: gradcheck in f64 on the CPU) and
// its CUDA column (tests/cuda/op_harness_cuda_test.cpp: every row on the GPU against the CPU). One row
// per differentiable op; broadcasting shows up as rows whose inputs have different shapes.
#include <functional>
#include <string>
#include <vector>

#include <kiln/autograd/checkpoint.h>
#include <kiln/autograd/gradcheck.h>
#include <kiln/core/data/pad_sequence.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/rotary_embedding.h>

namespace kiln::test_ops {

namespace F = kiln::nn::functional;
using Inputs = std::vector<Tensor>;

enum class Domain { any, positive };

struct OpCase {
  std::string op;
  std::vector<Shape> shapes;
  std::function<Tensor(const Inputs&)> fn;
  Domain domain = Domain::any;
  std::vector<bool> differentiable = {};  // per input; empty means all
  autograd::GradcheckOptions tolerance = {};
};

// The device index tensors of the rows are made on: the CPU for the gradcheck harness, the GPU for the
// CUDA column (tests/cuda/op_harness_cuda_test.cpp).
inline Device& case_device() {
  static Device d = Device::cpu();
  return d;
}
inline Tensor idx(std::vector<int64_t> v, Shape s) { return from_vector(v, s, {.dtype = DType::i64, .device = case_device()}); }
// A bool mask on the case device: true where v is nonzero.
inline Tensor mask(std::vector<int64_t> v, Shape s) {
  return ne(idx(std::move(v), std::move(s)), zeros({}, {.dtype = DType::i64, .device = case_device()}));
}

inline std::vector<OpCase> cases() {
  using D = Domain;
  return {
      {"add", {{3, 4}, {3, 4}}, [](const Inputs& x) { return add(x[0], x[1]); }},
      {"add", {{3, 4}, {4}}, [](const Inputs& x) { return x[0] + x[1]; }},
      {"sub", {{2, 1, 4}, {3, 1}}, [](const Inputs& x) { return x[0] - x[1]; }},
      {"mul", {{3, 4}, {3, 1}}, [](const Inputs& x) { return x[0] * x[1]; }},
      {"div", {{4, 3}, {3}}, [](const Inputs& x) { return x[0] / x[1]; }, D::positive},
      {"pow", {{3, 4}, {3, 4}}, [](const Inputs& x) { return pow(x[0], x[1]); }, D::positive},
      {"pow_scalar", {{3, 4}}, [](const Inputs& x) { return pow(x[0], 2.5); }, D::positive},
      {"add_scalar", {{3, 4}}, [](const Inputs& x) { return x[0] + 2.0; }},
      {"mul_scalar", {{3, 4}}, [](const Inputs& x) { return x[0] * -3.0; }},
      {"div_scalar", {{3, 4}}, [](const Inputs& x) { return x[0] / 4.0; }},
      {"rsub_scalar", {{3, 4}}, [](const Inputs& x) { return 1.0 - x[0]; }},
      {"rdiv_scalar", {{3, 4}}, [](const Inputs& x) { return 2.0 / x[0]; }, D::positive},
      {"maximum", {{3, 4}, {4}}, [](const Inputs& x) { return maximum(x[0], x[1]); }},
      {"minimum", {{3, 4}, {3, 4}}, [](const Inputs& x) { return minimum(x[0], x[1]); }},
      {"neg", {{3, 4}}, [](const Inputs& x) { return -x[0]; }},
      {"exp", {{3, 4}}, [](const Inputs& x) { return exp(x[0]); }},
      {"log", {{3, 4}}, [](const Inputs& x) { return log(x[0]); }, D::positive},
      {"sqrt", {{3, 4}}, [](const Inputs& x) { return sqrt(x[0]); }, D::positive},
      {"rsqrt", {{3, 4}}, [](const Inputs& x) { return rsqrt(x[0]); }, D::positive},
      {"tanh", {{3, 4}}, [](const Inputs& x) { return tanh(x[0]); }},
      {"sigmoid", {{3, 4}}, [](const Inputs& x) { return sigmoid(x[0]); }},
      {"relu", {{3, 4}}, [](const Inputs& x) { return relu(x[0]); }},
      {"gelu", {{3, 4}}, [](const Inputs& x) { return gelu(x[0]); }},
      {"gelu_tanh", {{3, 4}}, [](const Inputs& x) { return gelu(x[0], true); }},
      {"abs", {{3, 4}}, [](const Inputs& x) { return abs(x[0]); }},
      {"clamp", {{3, 4}}, [](const Inputs& x) { return clamp(x[0], -0.5, 0.5); }},
      {"where", {{3, 4}, {4}}, [](const Inputs& x) { return where(gt(x[0], x[1]), x[0], x[1] * 2.0); }},
      {"sum", {{3, 4}}, [](const Inputs& x) { return sum(x[0]); }},
      {"sum", {{2, 3, 4}}, [](const Inputs& x) { return sum(x[0], {0, 2}, true); }},
      {"mean", {{2, 3, 4}}, [](const Inputs& x) { return mean(x[0], {1}); }},
      {"amax", {{3, 4}}, [](const Inputs& x) { return amax(x[0], {1}); }},
      {"amax", {{3, 4}}, [](const Inputs& x) { return x[0].max(); }},
      {"amin", {{3, 4}}, [](const Inputs& x) { return amin(x[0], {0}, true); }},
      {"var", {{3, 4}}, [](const Inputs& x) { return var(x[0], {1}); }},
      {"var", {{3, 4}}, [](const Inputs& x) { return var(x[0], {}, 0); }},
      {"cumsum", {{3, 4}}, [](const Inputs& x) { return cumsum(x[0], 1); }},
      {"sort", {{3, 5}}, [](const Inputs& x) { return std::get<0>(sort(x[0], 1)); }},
      {"sort", {{4, 3}}, [](const Inputs& x) { return std::get<0>(sort(x[0], 0, true)); }},
      {"topk", {{2, 6}}, [](const Inputs& x) { return std::get<0>(topk(x[0], 3)); }},
      {"sin", {{3, 4}}, [](const Inputs& x) { return sin(x[0]); }},
      {"cos", {{3, 4}}, [](const Inputs& x) { return cos(mul(x[0], 3.0)); }},
      {"tril", {{4, 5}}, [](const Inputs& x) { return tril(x[0]); }},
      {"tril", {{2, 3, 4}}, [](const Inputs& x) { return tril(x[0], -1); }},
      {"triu", {{4, 3}}, [](const Inputs& x) { return triu(x[0], 1); }},
      {"masked_fill", {{2, 3}}, [](const Inputs& x) { return masked_fill(x[0], mask({1, 0, 0, 1, 1, 0}, {2, 3}), -2.5); }},
      {"masked_fill", {{2, 3}}, [](const Inputs& x) { return masked_fill(x[0], mask({0, 1, 1}, {3}), 0.0); }},
      {"silu", {{3, 4}}, [](const Inputs& x) { return F::silu(x[0]); }},
      {"glu", {{3, 4}}, [](const Inputs& x) { return F::glu(x[0]); }},
      {"swiglu", {{2, 3, 6}}, [](const Inputs& x) { return F::swiglu(x[0]); }},
      {"conv1d", {{2, 3, 7}, {4, 3, 3}, {4}}, [](const Inputs& x) {
         return F::conv1d(x[0], x[1], x[2], {.stride = 2, .padding = 1});
       }},
      {"batch_norm", {{4, 3}, {3}, {3}}, [](const Inputs& x) {
         return F::batch_norm(x[0], Tensor(), Tensor(), x[1], x[2], /*training=*/true);
       }},
      {"batch_norm", {{2, 3, 2, 2}}, [](const Inputs& x) {
         return F::batch_norm(x[0], Tensor(), Tensor(), Tensor(), Tensor(), /*training=*/true);
       }},
      {"rms_norm", {{3, 6}, {6}}, [](const Inputs& x) { return F::rms_norm(x[0], {6}, x[1], 1e-5); }},
      {"rms_norm", {{2, 2, 3}}, [](const Inputs& x) { return F::rms_norm(x[0], {2, 3}); }},
      {"nll_loss", {{4, 5}}, [](const Inputs& x) { return F::nll_loss(x[0], idx({1, 0, 4, 2}, {4})); }},
      {"nll_loss", {{4, 5}}, [](const Inputs& x) {
         return F::nll_loss(x[0], idx({1, -100, 4, 2}, {4}), F::Reduction::sum);
       }},
      {"nll_loss", {{5}}, [](const Inputs& x) { return F::nll_loss(x[0], idx({3}, {}), F::Reduction::none); }},
      {"cumsum", {{4, 3, 2}}, [](const Inputs& x) { return cumsum(x[0], 0); }},
      {"cumsum", {{2, 5, 3}}, [](const Inputs& x) { return cumsum(x[0], -2); }},
      {"cumsum_exclusive", {{2, 5, 3}}, [](const Inputs& x) { return cumsum(x[0], 1, true); }},
      {"cumsum_reverse", {{4, 3}}, [](const Inputs& x) { return cumsum(x[0], 0, false, true); }},
      {"cumsum_exclusive_reverse", {{3, 6}}, [](const Inputs& x) { return cumsum(x[0], -1, true, true); }},
      {"matmul", {{3, 4}, {4, 5}}, [](const Inputs& x) { return matmul(x[0], x[1]); }},
      {"matmul", {{2, 3, 4}, {4, 5}}, [](const Inputs& x) { return matmul(x[0], x[1]); }},
      {"matmul", {{2, 1, 3, 4}, {3, 4, 2}}, [](const Inputs& x) { return matmul(x[0], x[1]); }},
      {"matmul", {{4}, {4, 3}}, [](const Inputs& x) { return matmul(x[0], x[1]); }},
      {"matmul", {{2, 3, 4}, {4}}, [](const Inputs& x) { return matmul(x[0], x[1]); }},
      // transposed (column-major) operands: their gradients are written transposed, in the operands' layout
      {"matmul", {{2, 4, 3}, {2, 5, 4}}, [](const Inputs& x) {
         return matmul(x[0].transpose(-2, -1), x[1].transpose(-2, -1));
       }},
      {"matmul", {{4, 3}, {5, 4}}, [](const Inputs& x) { return matmul(x[0].t(), x[1].t()); }},
      {"matmul", {{2, 2, 4, 3}, {4, 5}}, [](const Inputs& x) { return matmul(x[0].transpose(-2, -1), x[1]); }},
      {"softmax", {{3, 5}}, [](const Inputs& x) { return softmax(x[0], -1); }},
      {"softmax", {{3, 5}}, [](const Inputs& x) { return softmax(x[0], 0); }},
      {"log_softmax", {{2, 3, 4}}, [](const Inputs& x) { return log_softmax(x[0], 1); }},
      {"layer_norm", {{3, 6}, {6}, {6}}, [](const Inputs& x) { return F::layer_norm(x[0], {6}, x[1], x[2]); }},
      {"layer_norm", {{2, 2, 6}}, [](const Inputs& x) { return F::layer_norm(x[0], {2, 6}); }},
      {"add_layer_norm", {{3, 8}, {3, 8}, {8}, {8}}, [](const Inputs& x) {
         auto [h, y] = F::add_layer_norm(x[0], x[1], x[2], x[3]);
         return add(h, mul(y, 2.0));  // both outputs reach the result
       }},
      {"add_layer_norm", {{2, 2, 6}}, [](const Inputs& x) { return F::add_layer_norm(x[0], Tensor()).second; }},
      {"add_layer_norm", {{3, 8}, {3, 8}, {8}, {8}, {8}}, [](const Inputs& x) {  // with the branch's bias folded in
         auto [h, y] = F::add_layer_norm(x[0], x[1], x[2], x[3], 1e-5, x[4]);
         return add(h, mul(y, 2.0));
       }},
      {"embedding", {{5, 3}}, [](const Inputs& x) { return F::embedding(idx({4, 0, 4, 2}, {2, 2}), x[0]); }},
      {"dropout", {{4, 5}}, [](const Inputs& x) {
         Generator g(7);  // the same mask on every evaluation
         return F::dropout(x[0], 0.4, true, &g);
       }},
      {"linear_cross_entropy", {{4, 3}, {5, 3}},
       [](const Inputs& x) { return F::linear_cross_entropy(x[0], x[1], idx({1, 0, 4, 2}, {4})); }},
      {"linear_cross_entropy", {{2, 2, 3}, {5, 3}}, [](const Inputs& x) {
         return F::linear_cross_entropy(x[0], x[1], idx({1, -100, 4, 2}, {2, 2}), {.label_smoothing = 0.2});
       }},
      {"cross_entropy", {{4, 5}}, [](const Inputs& x) { return F::cross_entropy(x[0], idx({1, 0, 4, 2}, {4})); }},
      {"cross_entropy", {{4, 5}}, [](const Inputs& x) {
         return F::cross_entropy(x[0], idx({1, -100, 4, 2}, {4}), {.label_smoothing = 0.1});
       }},
      {"cross_entropy", {{2, 3, 4}}, [](const Inputs& x) {
         return F::cross_entropy(x[0], idx({0, 2, 1, 1, 2, 0, 0, 1}, {2, 4}), {.reduction = F::Reduction::sum});
       }},
      {"mse_loss", {{3, 4}, {3, 4}}, [](const Inputs& x) { return F::mse_loss(x[0], x[1]); }},
      {"linear", {{3, 4}, {5, 4}, {5}}, [](const Inputs& x) { return F::linear(x[0], x[1], x[2]); }},
      {"linear", {{2, 3, 4}, {5, 4}}, [](const Inputs& x) { return F::linear(x[0], x[1]); }},
      {"linear", {{4}, {3, 4}, {3}}, [](const Inputs& x) { return F::linear(x[0], x[1], x[2]); }},
      {"linear_gelu", {{3, 4}, {5, 4}, {5}}, [](const Inputs& x) { return F::linear_gelu(x[0], x[1], x[2]); }},
      {"linear_gelu", {{2, 3, 4}, {5, 4}, {5}}, [](const Inputs& x) { return F::linear_gelu(x[0], x[1], x[2]); }},
      {"packed_self_attention", {{2, 5, 8}, {24, 8}, {24}},
       [](const Inputs& x) { return F::packed_self_attention(x[0], x[1], x[2], 2, Tensor(), AttentionMask(true)); }},
      {"packed_self_attention", {{2, 4, 8}, {24, 8}},
       [](const Inputs& x) { return F::packed_self_attention(x[0], x[1], Tensor(), 4, Tensor(), AttentionMask(false)); }},
      {"linear_gelu_linear", {{3, 4}, {8, 4}, {8}, {5, 8}, {5}},
       [](const Inputs& x) { return F::linear_gelu_linear(x[0], x[1], x[2], x[3], x[4]); }},
      {"linear_gelu_linear", {{2, 3, 4}, {16, 4}, {5, 16}},
       [](const Inputs& x) { return F::linear_gelu_linear(x[0], x[1], Tensor(), x[2]); }},
      {"linear_gelu", {{3, 4}, {2, 4}}, [](const Inputs& x) { return F::linear_gelu(x[0], x[1]); }},
      {"cat", {{2, 3}, {4, 3}}, [](const Inputs& x) { return cat({x[0], x[1]}, 0); }},
      {"stack", {{2, 3}, {2, 3}}, [](const Inputs& x) { return stack({x[0], x[1]}, 1); }},
      {"split", {{5, 3}}, [](const Inputs& x) {
         auto p = split(x[0], 2, 0);
         return cat({p[2] * 3.0, p[0], p[1] * p[1]}, 0);
       }},
      {"index_select", {{5, 3}}, [](const Inputs& x) { return index_select(x[0], 0, idx({3, 1, 3}, {3})); }},
      {"gather", {{3, 4}}, [](const Inputs& x) { return gather(x[0], 1, idx({0, 3, 3, 1, 2, 2}, {3, 2})); }},
      {"index_add", {{4, 3}, {2, 3}}, [](const Inputs& x) { return index_add(x[0], 0, idx({1, 1}, {2}), x[1]); }},
      {"scatter_add", {{3, 4}, {3, 2}}, [](const Inputs& x) {
         return scatter_add(x[0], 1, idx({0, 3, 3, 3, 1, 2}, {3, 2}), x[1]);
       }},
      {"unfold", {{2, 2, 5, 6}}, [](const Inputs& x) {
         return F::unfold(x[0], {3, 2}, {.stride = {2, 1}, .padding = {1, 0}, .dilation = {1, 2}});
       }},
      {"conv2d", {{2, 2, 5, 5}, {3, 2, 3, 3}, {3}}, [](const Inputs& x) {
         return F::conv2d(x[0], x[1], x[2], {.stride = {2, 1}, .padding = {1, 1}});
       }},
      {"max_pool2d", {{1, 2, 4, 4}}, [](const Inputs& x) { return F::max_pool2d(x[0], {.kernel_size = {2, 2}}); }},
      {"avg_pool2d", {{1, 2, 5, 5}}, [](const Inputs& x) {
         return F::avg_pool2d(x[0], {.kernel_size = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
       }},
      {"scaled_dot_product_attention", {{2, 3, 4}, {2, 3, 4}, {2, 3, 4}}, [](const Inputs& x) {
         return F::scaled_dot_product_attention(x[0], x[1], x[2], true);
       }},
      {"scaled_dot_product_attention", {{2, 2, 5, 3}, {2, 2, 4, 3}, {2, 2, 4, 3}}, [](const Inputs& x) {
         return F::scaled_dot_product_attention(x[0], x[1], x[2], false, 0.7);
       }},
      {"scaled_dot_product_attention", {{1, 3, 6, 4}, {1, 3, 6, 4}, {1, 3, 6, 4}}, [](const Inputs& x) {
         return F::scaled_dot_product_attention(x[0].transpose(1, 2).contiguous().transpose(1, 2), x[1], x[2], true);
       }},
      // masks: key padding (bool, batch 1 attends to nothing), causal with a bool mask that empties row 0,
      // an additive bias (not differentiated: the fused kernels), a trainable bias (the composite)
      {"scaled_dot_product_attention", {{2, 2, 5, 4}, {2, 2, 6, 4}, {2, 2, 6, 4}}, [](const Inputs& x) {
         return F::scaled_dot_product_attention(x[0], x[1], x[2], mask({1, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0}, {2, 1, 1, 6}));
       }},
      {"scaled_dot_product_attention", {{1, 4, 3}, {1, 4, 3}, {1, 4, 3}}, [](const Inputs& x) {
         return F::scaled_dot_product_attention(x[0], x[1], x[2],
                                                mask({0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0}, {4, 4}), true);
       }},
      {"scaled_dot_product_attention", {{2, 4, 3}, {2, 5, 3}, {2, 5, 3}, {4, 5}},
       [](const Inputs& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], x[3]); }, D::any,
       {true, true, true, false}},
      {"scaled_dot_product_attention", {{1, 2, 3, 4}, {1, 2, 5, 4}, {1, 2, 5, 4}, {2, 1, 5}},
       [](const Inputs& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], x[3], true); }},
      {"scaled_dot_product_attention_qkvpacked", {{2, 5, 3, 2, 4}}, [](const Inputs& x) {
         return F::scaled_dot_product_attention_qkvpacked(x[0], mask({1, 0, 1, 1, 0, 0, 1, 1, 1, 1}, {2, 1, 1, 5}));
       }},
      {"scaled_dot_product_attention_qkvpacked", {{2, 5, 3, 2, 4}},
       [](const Inputs& x) { return F::scaled_dot_product_attention_qkvpacked(x[0], true); }},
      // D = 64: the tensor-core kernels on the GPU's half-precision columns, reading and writing rows 3HD apart
      {"scaled_dot_product_attention_qkvpacked", {{1, 17, 3, 2, 64}},
       [](const Inputs& x) { return F::scaled_dot_product_attention_qkvpacked(x[0], false); }},
      {"rotary_embedding", {{2, 3, 5, 8}}, [](const Inputs& x) {
         nn::RotaryEmbedding rope(8, {.max_seq_len = 16, .device = case_device()});
         return rope.forward(x[0], 2);
       }},
      {"pad_sequence", {{3, 2}, {1, 2}, {2, 2}}, [](const Inputs& x) { return data::pad_sequence({x[0], x[1], x[2]}); }},
      {"scaled_dot_product_attention_reference", {{2, 3, 4}, {2, 3, 4}, {2, 3, 4}}, [](const Inputs& x) {
         return F::scaled_dot_product_attention_reference(x[0], x[1], x[2], true);
       }},
      {"view", {{3, 4}}, [](const Inputs& x) { return x[0].reshape({2, 6}) * x[0].reshape({2, 6}); }},
      {"permute", {{2, 3, 4}}, [](const Inputs& x) { return x[0].permute({2, 0, 1}) * 2.0; }},
      {"transpose", {{3, 4}}, [](const Inputs& x) { return matmul(x[0].t(), x[0]); }},
      {"narrow", {{5, 3}}, [](const Inputs& x) { return x[0].narrow(0, 1, 3) * 2.0; }},
      {"slice", {{6, 3}}, [](const Inputs& x) { return x[0].slice(0, 1, 6, 2) * x[0].slice(0, 0, 3); }},
      {"select", {{3, 4}}, [](const Inputs& x) { return x[0].select(1, 2) * 3.0; }},
      {"expand", {{3, 1}}, [](const Inputs& x) { return x[0].expand({2, 3, 4}) * 1.5; }},
      {"squeeze", {{3, 1, 4}}, [](const Inputs& x) { return x[0].squeeze(1) * 2.0; }},
      {"unsqueeze", {{3, 4}}, [](const Inputs& x) { return x[0].unsqueeze(1) * 2.0; }},
      {"flatten", {{2, 3, 4}}, [](const Inputs& x) { return x[0].flatten(1) * 2.0; }},
      {"contiguous", {{3, 4}}, [](const Inputs& x) { return x[0].t().contiguous() * 2.0; }},
      {"clone", {{3, 4}}, [](const Inputs& x) { return x[0].clone() * x[0]; }},
      // Through f32 the function is only f32-accurate: a wider step and tolerance fit it.
      {"cast", {{3, 4}}, [](const Inputs& x) { return cast(cast(x[0], DType::f32), DType::f64) * 3.0; }, D::any, {},
       {.eps = 1e-2, .atol = 1e-4, .rtol = 1e-3}},
      {"checkpoint", {{3, 4}, {4, 4}}, [](const Inputs& x) {
         return autograd::checkpoint([](const Inputs& y) { return tanh(matmul(y[0], y[1])); }, {x[0], x[1]});
       }},
  };
}

}  // namespace kiln::test_ops
