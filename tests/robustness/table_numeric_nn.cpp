// NaN and Inf inputs with their defined values (PyTorch's), and the nn modules and functional ops.
#include <cmath>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/modules.h>

#include "robustness.h"

namespace kiln::robustness {

namespace F = nn::functional;

namespace {
constexpr double kInf = INFINITY;
Tensor row(std::initializer_list<double> v) { return tensor(v, {1, int64_t(v.size())}); }
Tensor target(int64_t t) { return from_vector<int64_t>({t}, {1}); }
}  // namespace

std::vector<Row> numeric_rows() {
  return {
      ok("cross_entropy_minus_inf_non_target_logit", [] {
        // log(e^0 + e^1) - 1 = log(1 + e) - 1
        EXPECT_NEAR(F::cross_entropy(row({-kInf, 0, 1}), target(2)).item<float>(), 0.31326169, 1e-6);
      }),
      ok("cross_entropy_minus_inf_rows_per_sample", [] {
        Tensor l = F::cross_entropy(tensor({-kInf, 0, 1, 2, -kInf, -kInf}, {2, 3}), from_vector<int64_t>({1, 0}, {2}),
                                    {.reduction = F::Reduction::none});
        EXPECT_NEAR(l.to_vector<float>()[0], std::log(1 + std::exp(1.0)), 1e-6);
        EXPECT_EQ(l.to_vector<float>()[1], 0.0f);
      }),
      ok("cross_entropy_minus_inf_target_logit_is_inf", [] {
        EXPECT_EQ(F::cross_entropy(row({-kInf, 0, 1}), target(0)).item<float>(), INFINITY);
      }),
      ok("cross_entropy_minus_inf_with_smoothing_is_inf", [] {
        EXPECT_EQ(F::cross_entropy(row({-kInf, 0, 1}), target(2), {.label_smoothing = 0.1}).item<float>(), INFINITY);
      }),
      ok("cross_entropy_minus_inf_gradient_is_finite", [] {
        Tensor x = row({-kInf, 0, 1});
        x.requires_grad_();
        F::cross_entropy(x, target(2)).backward();
        std::vector<float> g = x.grad().to_vector<float>();
        EXPECT_EQ(g[0], 0.0f);
        EXPECT_NEAR(g[1], 1 / (1 + std::exp(1.0)), 1e-6);
        EXPECT_NEAR(g[2], std::exp(1.0) / (1 + std::exp(1.0)) - 1, 1e-6);  // softmax - one-hot
      }),
      ok("cross_entropy_all_ignored_is_nan", [] {
        EXPECT_TRUE(std::isnan(F::cross_entropy(row({1, 2}), target(-100)).item<float>()));
      }),
      ok("linear_cross_entropy_minus_inf_free", [] {
        Tensor x = tensor({1, 0}, {1, 2}), w = tensor({0, 0, 1, 0, 0, 1}, {3, 2});
        EXPECT_NEAR(F::linear_cross_entropy(x, w, target(1)).item<float>(), std::log(2 + std::exp(1.0)) - 1, 1e-6);
      }),
      ok("softmax_with_one_minus_inf", [] {
        std::vector<float> p = softmax(row({-kInf, 0, 0}), 1).to_vector<float>();
        EXPECT_EQ(p[0], 0.0f);
        EXPECT_FLOAT_EQ(p[1], 0.5f);
      }),
      ok("softmax_of_an_all_minus_inf_row_is_nan", [] {
        EXPECT_TRUE(std::isnan(softmax(row({-kInf, -kInf}), 1).to_vector<float>()[0]));
      }),
      ok("log_softmax_of_plus_inf", [] { EXPECT_TRUE(std::isnan(log_softmax(row({kInf, 0}), 1).to_vector<float>()[0])); }),
      ok("log_of_zero_is_minus_inf", [] { EXPECT_EQ(log(zeros({1})).item<float>(), -INFINITY); }),
      ok("sqrt_of_negative_is_nan", [] { EXPECT_TRUE(std::isnan(sqrt(full({1}, -1.0)).item<float>())); }),
      ok("division_by_zero", [] {
        std::vector<float> r = div(tensor({1, -1, 0}, {3}), zeros({3})).to_vector<float>();
        EXPECT_EQ(r[0], INFINITY);
        EXPECT_EQ(r[1], -INFINITY);
        EXPECT_TRUE(std::isnan(r[2]));
      }),
      ok("relu_keeps_nan", [] { EXPECT_TRUE(std::isnan(relu(full({1}, NAN)).item<float>())); }),
      ok("isfinite_flags", [] {
        EXPECT_EQ(isfinite(tensor({1, kInf, -kInf, NAN}, {4})).to_vector<bool>(),
                  (std::vector<bool>{true, false, false, false}));
      }),
      ok("sum_with_nan_is_nan", [] { EXPECT_TRUE(std::isnan(sum(tensor({1, NAN}, {2})).item<float>())); }),
      ok("amax_with_inf", [] { EXPECT_EQ(amax(tensor({1, kInf}, {2})).item<float>(), INFINITY); }),
      ok("exp_overflow_is_inf", [] { EXPECT_EQ(exp(full({1}, 1000.0)).item<float>(), INFINITY); }),
      ok("f16_overflow_is_inf", [] { EXPECT_EQ(full({1}, 1e6).to(DType::f16).to(DType::f32).item<float>(), INFINITY); }),
      error("clamp_min_above_max", [] { clamp(zeros({2}), 1.0, 0.0); }, {"clamp", "min 1", "max 0"}),
      ok("tanh_saturates", [] { EXPECT_EQ(tanh(full({1}, 1e4)).item<float>(), 1.0f); }),
  };
}

std::vector<Row> nn_rows() {
  return {
      error("linear_wrong_in_features", [] { nn::Linear fc(4, 3); fc(zeros({2, 5})); }, {"linear", "[2, 5]", "[3, 4]"}),
      error("linear_module_non_positive", [] { nn::Linear fc(0, 3); }, {"Linear"}),
      error("linear_bias_shape", [] { F::linear(zeros({2, 4}), zeros({3, 4}), zeros({4})); }, {"linear", "[4]"}),
      // PyTorch refuses mixed dtypes too: an f64 input would silently run an f32 layer in f64
      error("linear_f64_input_f32_weight", [] { nn::Linear fc(4, 3); fc(zeros({2, 4}, {.dtype = DType::f64})); },
            {"linear", "f64", "f32", "autocast"}),
      error("tril_of_a_vector", [] { tril(ones({3})); }, {"tril", "[3]"}),
      error("masked_fill_float_mask", [] { masked_fill(ones({2, 2}), ones({2, 2}), 0.0); }, {"masked_fill", "bool"}),
      error("nll_loss_target_out_of_range", [] { F::nll_loss(zeros({2, 3}), tensor({0, 3}, {2}, {.dtype = DType::i64})); },
            {"nll_loss", "3 classes"}),
      error("rms_norm_wrong_shape", [] { F::rms_norm(zeros({2, 4}), {3}); }, {"rms_norm", "[3]", "[2, 4]"}),
      error("multinomial_negative_weight", [] { multinomial(tensor({0.5, -0.1}, {2}), 1); }, {"multinomial", "non-negative"}),
      error("cumsum_dim_out_of_range", [] { cumsum(ones({2, 3}), 2); }, {"cumsum"}),
      error("conv2d_wrong_channels", [] { nn::Conv2d c(3, 8, 3); c(zeros({1, 4, 8, 8})); }, {"conv2d", "[1, 4, 8, 8]"}),
      error("sklinear_wrong_in_features", [] { nn::SKLinear fc(64, 48, {.low_rank = 4}); fc(zeros({2, 63})); },
            {"SKLinear", "[2, 63]", "64"}),
      error("sklinear_saves_nothing", [] { nn::SKLinear fc(16, 16, {.low_rank = 8}); }, {"SKLinear", "saves nothing", "256"}),
      error("sklinear_f64_input_f32_factors", [] { nn::SKLinear fc(64, 48, {.low_rank = 4}); fc(zeros({2, 64}, {.dtype = DType::f64})); },
            {"sketched_linear", "f64", "f32"}),
      error("sketched_linear_trained_sketch",
            [] { F::sketched_linear(zeros({2, 4}), zeros({1, 4, 2}), zeros({1, 2, 3}), zeros({1, 2, 3}).requires_grad_(),
                                    zeros({1, 4, 2})); },
            {"sketched_linear", "fixed"}),
      error("skconv2d_wrong_channels", [] { nn::SKConv2d c(3, 32, 3, {.low_rank = 2}); c(zeros({1, 4, 8, 8})); },
            {"SKConv2d", "[1, 4, 8, 8]"}),
      error("linear_sketched_twice", [] { nn::Linear fc(64, 64); fc.sketch({.low_rank = 4}); fc.sketch({.low_rank = 4}); },
            {"Linear", "already sketched"}),
      error("conv2d_3d_input", [] { F::conv2d(zeros({4, 8, 8}), zeros({2, 4, 3, 3})); }, {"conv2d", "[4, 8, 8]"}),
      error("conv2d_kernel_larger_than_input", [] { F::conv2d(zeros({1, 1, 2, 2}), zeros({1, 1, 3, 3})); }, {"conv2d"}),
      error("conv2d_zero_stride", [] { F::conv2d(zeros({1, 1, 4, 4}), zeros({1, 1, 3, 3}), {}, {.stride = {0, 1}}); },
            {"conv2d", "stride"}),
      error("conv2d_negative_padding",
            [] { F::conv2d(zeros({1, 1, 4, 4}), zeros({1, 1, 3, 3}), {}, {.padding = {-1, 0}}); }, {"conv2d"}),
      error("max_pool2d_padding_over_half", [] { F::max_pool2d(zeros({1, 1, 4, 4}), {.kernel_size = {2, 2}, .padding = {2, 0}}); },
            {"max_pool2d", "padding"}),
      error("avg_pool2d_padding_over_half", [] { F::avg_pool2d(zeros({1, 1, 4, 4}), {.kernel_size = {2, 2}, .padding = {2, 0}}); },
            {"avg_pool2d", "padding"}),
      error("max_pool2d_window_larger_than_input", [] { F::max_pool2d(zeros({1, 1, 2, 2}), {.kernel_size = {3, 3}}); },
            {"max_pool2d"}),
      error("layer_norm_wrong_shape", [] { nn::LayerNorm ln(8); ln(zeros({2, 7})); }, {"layer_norm", "[2, 7]"}),
      error("embedding_index_out_of_range", [] { nn::Embedding e(10, 4); e(from_vector<int64_t>({3, 10}, {2})); },
            {"embedding", "index 10", "10 rows"}),
      error("embedding_negative_index", [] { nn::Embedding e(10, 4); e(from_vector<int64_t>({-1}, {1})); },
            {"embedding", "index -1"}),
      error("embedding_float_indices", [] { nn::Embedding e(10, 4); e(zeros({2})); }, {"embedding", "i32 or i64"}),
      error("multihead_attention_heads_do_not_divide", [] { nn::MultiheadAttention mha(10, 3); }, {"MultiheadAttention"}),
      error("multihead_attention_wrong_width", [] { nn::MultiheadAttention mha(8, 2); mha(zeros({1, 4, 6})); },
            {"[1, 4, 6]"}),
      error("sdpa_mismatched_head_dims",
            [] { F::scaled_dot_product_attention(zeros({1, 2, 4, 8}), zeros({1, 2, 4, 6}), zeros({1, 2, 4, 8})); },
            {"scaled_dot_product_attention", "[1, 2, 4, 6]"}),
      error("sdpa_mask_does_not_broadcast",
            [] {
              F::scaled_dot_product_attention(zeros({1, 2, 4, 8}), zeros({1, 2, 5, 8}), zeros({1, 2, 5, 8}),
                                              zeros({4, 4}, {.dtype = DType::boolean}));
            },
            {"scaled_dot_product_attention", "attn_mask", "[4, 4]", "[1, 2, 4, 5]"}),
      error("sdpa_integer_mask",
            [] {
              F::scaled_dot_product_attention(zeros({2, 4, 8}), zeros({2, 4, 8}), zeros({2, 4, 8}),
                                              zeros({4, 4}, {.dtype = DType::i64}));
            },
            {"scaled_dot_product_attention", "attn_mask", "i64"}),
      error("multihead_attention_key_padding_mask_shape",
            [] {
              nn::MultiheadAttention mha(8, 2);
              Tensor x = zeros({2, 4, 8});
              mha(x, x, x, zeros({2, 5}, {.dtype = DType::boolean}));
            },
            {"MultiheadAttention", "key_padding_mask", "[2, 5]"}),
      error("multihead_attention_too_many_inputs",
            [] {
              nn::MultiheadAttention mha(8, 2);
              Tensor x = zeros({2, 4, 8});
              mha(x, x, x, Tensor(), Tensor(), x);
            },
            {"MultiheadAttention", "6 inputs"}),
      error("rotary_embedding_odd_dim", [] { nn::RotaryEmbedding rope(7); }, {"RotaryEmbedding", "7"}),
      error("rotary_embedding_past_max_len",
            [] {
              nn::RotaryEmbedding rope(8, {.max_seq_len = 4});
              rope(zeros({2, 5, 8}));
            },
            {"RotaryEmbedding", "max_seq_len 4", "[2, 5, 8]"}),
      error("linear_called_with_two_inputs", [] { nn::Linear fc(2, 2); fc(zeros({1, 2}), zeros({1, 2})); },
            {"Linear", "2 inputs"}),
      error("dropout_p_above_one", [] { F::dropout(zeros({4}), 1.5, true); }, {"dropout", "1.5"}),
      error("dropout_module_negative_p", [] { nn::Dropout d(-0.1); }, {"Dropout"}),
      error("cross_entropy_target_out_of_range", [] { F::cross_entropy(zeros({2, 3}), from_vector<int64_t>({0, 3}, {2})); },
            {"cross_entropy", "3"}),
      error("cross_entropy_float_target", [] { F::cross_entropy(zeros({2, 3}), zeros({2})); }, {"cross_entropy", "f32[2]"}),
      error("cross_entropy_target_shape", [] { F::cross_entropy(zeros({2, 3}), zeros({3}, {.dtype = DType::i64})); },
            {"cross_entropy", "[3]"}),
      error("cross_entropy_smoothing_out_of_range",
            [] { F::cross_entropy(zeros({2, 3}), zeros({2}, {.dtype = DType::i64}), {.label_smoothing = 1.5}); },
            {"cross_entropy", "1.5"}),
      error("mse_loss_shapes", [] { F::mse_loss(zeros({2, 3}), zeros({3, 2})); }, {"mse_loss", "[2, 3]", "[3, 2]"}),
      ok("dropout_p_one_zeroes_everything", [] {
        EXPECT_EQ(F::dropout(ones({8}), 1.0, true).to_vector<float>(), std::vector<float>(8, 0.0f));
      }),
      ok("dropout_in_eval_is_identity", [] { EXPECT_EQ(F::dropout(ones({4}), 0.5, false).to_vector<float>(), std::vector<float>(4, 1.0f)); }),
  };
}

}  // namespace kiln::robustness
