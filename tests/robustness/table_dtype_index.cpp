// Dtypes, devices, indices, empty tensors and the factories.
#include <cmath>
#include <cstdint>
#include <limits>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "robustness.h"

namespace kiln::robustness {

namespace {
Tensor i64(std::vector<int64_t> v) {
  const int64_t n = int64_t(v.size());
  return from_vector<int64_t>(v, {n});
}
Tensor bools() { return zeros({3}, {.dtype = DType::boolean}); }
}  // namespace

std::vector<Row> dtype_device_rows() {
  return {
      error("requires_grad_on_i64", [] { zeros({2}, {.dtype = DType::i64}).requires_grad_(); }, {"requires_grad_", "i64"}),
      error("requires_grad_on_bool", [] { bools().requires_grad_(); }, {"requires_grad_", "bool"}),
      error("requires_grad_option_on_i32", [] { zeros({2}, {.dtype = DType::i32, .requires_grad = true}); },
            {"requires_grad_", "i32"}),
      error("data_ptr_wrong_type", [] { zeros({2}).data_ptr<double>(); }, {"data_ptr", "f32", "f64"}),
      error("item_wrong_count", [] { zeros({2}).item<float>(); }, {"item", "[2]"}),
      error("mean_of_integers", [] { mean(zeros({2}, {.dtype = DType::i32})); }, {"mean", "i32"}),
      error("softmax_of_integers", [] { softmax(zeros({2}, {.dtype = DType::i64}), 0); }, {"softmax", "i64"}),
      error("log_softmax_of_bool", [] { log_softmax(bools(), 0); }, {"log_softmax", "bool"}),
      error("matmul_of_integers", [] { matmul(zeros({2, 2}, {.dtype = DType::i64}), zeros({2, 2}, {.dtype = DType::i64})); },
            {"matmul", "i64"}),
      error("where_condition_not_bool", [] { where(zeros({3}), zeros({3}), zeros({3})); }, {"where", "bool", "f32[3]"}),
      error("set_grad_other_dtype", [] { zeros({2}).set_grad(zeros({2}, {.dtype = DType::f64})); },
            {"set_grad", "f64[2]", "f32[2]"}),
      error("set_grad_other_shape", [] { zeros({2}).set_grad(zeros({3})); }, {"set_grad", "f32[3]", "f32[2]"}),
      error("device_parse_unknown", [] { Device::parse("gpu"); }, {"Device::parse", "gpu"}),
      error("device_parse_bad_index", [] { Device::parse("cuda:x"); }, {"Device::parse", "cuda:x"}),
      ok("cast_round_trips", [] {
        Tensor t = tensor({1.5, -2.25, 3}, {3});
        EXPECT_EQ(cast(cast(t, DType::f64), DType::f32).to_vector<float>(), t.to_vector<float>());
        EXPECT_EQ(cast(t, DType::i64).to_vector<int64_t>(), (std::vector<int64_t>{1, -2, 3}));
      }),
      ok("mixed_dtypes_promote", [] {
        EXPECT_EQ(add(zeros({2}), zeros({2}, {.dtype = DType::f64})).dtype(), DType::f64);
        EXPECT_EQ(add(zeros({2}, {.dtype = DType::i64}), zeros({2})).dtype(), DType::f32);
        EXPECT_EQ(add(zeros({2}, {.dtype = DType::bf16}), zeros({2}, {.dtype = DType::f16})).dtype(), DType::f32);
      }),
      ok("comparisons_give_bool", [] {
        Tensor r = lt(tensor({1, 5}, {2}), tensor({2, 2}, {2}));
        EXPECT_EQ(r.dtype(), DType::boolean);
        EXPECT_EQ(r.to_vector<bool>(), (std::vector<bool>{true, false}));
      }),
      ok("argmax_is_i64", [] { EXPECT_EQ(argmax(tensor({1, 3, 2}, {3}), 0).item<int64_t>(), 1); }),
  };
}

std::vector<Row> index_rows() {
  return {
      // indices
      error("index_select_out_of_range", [] { index_select(zeros({2, 3}), 0, i64({0, 2})); }, {"index_select", "index 2"}),
      error("index_select_negative", [] { index_select(zeros({2, 3}), 1, i64({-1})); }, {"index_select", "-1"}),
      error("index_select_float_index", [] { index_select(zeros({2, 3}), 0, zeros({1})); }, {"index_select", "i32 or i64"}),
      error("index_select_2d_index", [] { index_select(zeros({2, 3}), 0, zeros({1, 1}, {.dtype = DType::i64})); },
            {"index_select", "1-D"}),
      error("index_select_dim_out_of_range", [] { index_select(zeros({2, 3}), 2, i64({0})); }, {"index_select", "dim 2"}),
      error("gather_out_of_range", [] { gather(zeros({2, 3}), 1, from_vector<int64_t>({0, 3, 0, 0, 0, 0}, {2, 3})); },
            {"gather", "index 3"}),
      error("gather_rank_mismatch", [] { gather(zeros({2, 3}), 1, zeros({2}, {.dtype = DType::i64})); }, {"gather"}),
      error("scatter_add_out_of_range",
            [] { scatter_add(zeros({2, 3}), 0, from_vector<int64_t>({0, 0, 5, 0, 0, 0}, {2, 3}), ones({2, 3})); },
            {"scatter_add", "5"}),
      error("index_add_out_of_range", [] { index_add(zeros({2, 3}), 0, i64({7}), ones({1, 3})); }, {"index_add", "7"}),
      error("index_add_src_shape", [] { index_add(zeros({2, 3}), 0, i64({0}), ones({2, 3})); }, {"index_add"}),
      error("argmax_dim_out_of_range", [] { argmax(zeros({2, 3}), -3); }, {"argmax", "-3"}),
      error("sum_dim_out_of_range", [] { sum(zeros({2, 3}), {2}); }, {"sum", "dim 2"}),
      error("sum_dim_twice", [] { sum(zeros({2, 3}), {1, 1}); }, {"sum", "twice"}),
      error("softmax_dim_out_of_range", [] { softmax(zeros({2, 3}), 2); }, {"softmax", "dim 2"}),
      // empty tensors: PyTorch's values
      ok("sum_of_empty_is_zero", [] { EXPECT_EQ(sum(zeros({0})).item<float>(), 0.0f); }),
      ok("mean_of_empty_is_nan", [] { EXPECT_TRUE(std::isnan(mean(zeros({0})).item<float>())); }),
      ok("sum_over_empty_dim", [] {
        Tensor s = sum(zeros({3, 0}), {1});
        EXPECT_EQ(s.sizes(), (Shape{3}));
        EXPECT_EQ(s.to_vector<float>(), (std::vector<float>{0, 0, 0}));
      }),
      error("amax_of_empty", [] { amax(zeros({0})); }, {"amax"}),
      error("argmax_of_empty", [] { argmax(zeros({0}), 0); }, {"argmax"}),
      ok("matmul_with_empty_inner_dim_is_zeros", [] {
        Tensor r = matmul(zeros({2, 0}), zeros({0, 3}));
        EXPECT_EQ(r.sizes(), (Shape{2, 3}));
        EXPECT_EQ(r.to_vector<float>(), std::vector<float>(6, 0.0f));
      }),
      ok("matmul_with_empty_rows", [] { EXPECT_EQ(matmul(zeros({0, 4}), zeros({4, 3})).sizes(), (Shape{0, 3})); }),
      ok("softmax_of_empty_rows", [] { EXPECT_EQ(softmax(zeros({0, 5}), 1).sizes(), (Shape{0, 5})); }),
      ok("cat_with_an_empty_tensor", [] {
        EXPECT_EQ(cat({zeros({2, 3}), zeros({0, 3})}, 0).sizes(), (Shape{2, 3}));
      }),
      error("item_of_empty", [] { zeros({0}).item<float>(); }, {"item", "[0]"}),
      // factories
      error("zeros_negative_size", [] { zeros({-1}); }, {"negative", "[-1]"}),
      error("empty_negative_size", [] { empty({2, -3}); }, {"empty", "-3"}),
      error("from_vector_wrong_count", [] { tensor({1, 2, 3}, {2, 2}); }, {"from_vector", "[2, 2]"}),
      error("arange_zero_step", [] { arange(0.0, 1.0, 0.0); }, {"arange", "step=0"}),
      error("arange_wrong_direction", [] { arange(0.0, 10.0, -1.0); }, {"arange"}),
      error("arange_tiny_step", [] { arange(0.0, 10.0, 1e-300); }, {"arange", "overflow"}),
      error("arange_too_long", [] { arange(0.0, 1e13); }, {"arange", "1e+13"}),
      error("arange_infinite_end", [] { arange(0.0, INFINITY); }, {"arange", "inf"}),
      error("arange_nan_step", [] { arange(0.0, 1.0, NAN); }, {"arange", "nan"}),
      error("randperm_negative", [] { randperm(-3); }, {"randperm", "-3"}),
      error("randint_negative_shape", [] { randint(0, 5, {-1}); }, {"randint", "-1"}),
      error("randint_empty_range", [] { randint(5, 5, {2}); }, {"randint", "[5, 5)"}),
      ok("randint_full_int64_range", [] {
        Tensor r = randint(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), {64});
        EXPECT_EQ(r.numel(), 64);
      }),
      ok("randperm_zero_is_empty", [] { EXPECT_EQ(randperm(0).numel(), 0); }),
      ok("randperm_is_a_permutation", [] {
        std::vector<int64_t> p = randperm(100).to_vector<int64_t>();
        std::sort(p.begin(), p.end());
        for (int64_t i = 0; i < 100; ++i) ASSERT_EQ(p[size_t(i)], i);
      }),
      ok("arange_counts", [] {
        EXPECT_EQ(arange(0.0, 1.0, 0.3).numel(), 4);
        EXPECT_EQ(arange(int64_t(5)).to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
        EXPECT_EQ(arange(3.0, 3.0).numel(), 0);
      }),
  };
}

}  // namespace kiln::robustness
