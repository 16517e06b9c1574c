// Shapes: broadcasting, views, joins, matmul, in-place results that do not fit, and shape arithmetic
// that would overflow int64.
#include <cstdint>
#include <limits>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "robustness.h"

namespace kiln::robustness {

namespace {
constexpr int64_t kBig = int64_t(1) << 32;
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
Tensor abc() { return tensor({1, 2, 3}, {3}); }
}  // namespace

std::vector<Row> shape_rows() {
  return {
      // broadcasting
      error("add_mismatched_shapes", [] { add(zeros({2, 3}), zeros({4})); }, {"add", "[2, 3]", "[4]"}),
      error("sub_mismatched_shapes", [] { sub(zeros({2, 3}), zeros({3, 2})); }, {"sub", "[2, 3]", "[3, 2]"}),
      error("mul_mismatched_shapes", [] { mul(zeros({5}), zeros({4})); }, {"mul", "[5]", "[4]"}),
      error("div_mismatched_shapes", [] { div(zeros({2, 2}), zeros({3})); }, {"div", "[2, 2]", "[3]"}),
      error("maximum_mismatched_shapes", [] { maximum(zeros({2}), zeros({3})); }, {"maximum", "[2]", "[3]"}),
      error("where_mismatched_shapes", [] { where(zeros({2}, {.dtype = DType::boolean}), zeros({3}), zeros({3})); },
            {"where", "[2]", "[3]"}),
      ok("broadcast_scalar_and_row", [] {
        EXPECT_EQ(add(zeros({2, 3}), ones({3})).sizes(), (Shape{2, 3}));
        EXPECT_EQ(add(scalar_tensor(1.0), zeros({0, 3})).sizes(), (Shape{0, 3}));
      }),
      // in place: the result must keep self's shape
      error("add__grows_self", [] { Tensor a = abc(); a.add_(ones({2, 3})); }, {"add_", "[3]", "[2, 3]"}),
      error("sub__grows_self", [] { Tensor a = abc(); a.sub_(ones({2, 3})); }, {"sub_", "[3]", "[2, 3]"}),
      error("mul__grows_self", [] { Tensor a = abc(); a.mul_(ones({2, 3})); }, {"mul_", "[3]", "[2, 3]"}),
      error("div__grows_self", [] { Tensor a = abc(); a.div_(ones({2, 3})); }, {"div_", "[3]", "[2, 3]"}),
      error("add__mismatched", [] { Tensor a = abc(); a.add_(ones({4})); }, {"add_", "[3]", "[4]"}),
      ok("add__broadcast_into_self", [] {
        Tensor a = abc();
        a.add_(ones({1, 3}).squeeze(0));
        a.mul_(full({}, 2.0));
        EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{4, 6, 8}));
        Tensor m = zeros({2, 3});
        m.add_(abc());
        EXPECT_EQ(m.to_vector<float>(), (std::vector<float>{1, 2, 3, 1, 2, 3}));
      }),
      error("copy__mismatched", [] { zeros({2, 3}).copy_(zeros({4})); }, {"copy_", "[2, 3]", "[4]"}),
      error("copy__grows_self", [] { zeros({3}).copy_(zeros({2, 3})); }, {"copy_", "[3]", "[2, 3]"}),
      // views
      error("view_wrong_numel", [] { zeros({2, 3}).view({4}); }, {"view", "[4]", "6"}),
      error("view_two_inferred", [] { zeros({2, 3}).view({-1, -1}); }, {"view", "-1"}),
      error("view_negative_size", [] { zeros({2, 3}).view({-2, -3}); }, {"view", "-2"}),
      error("view_non_contiguous", [] { zeros({2, 3}).t().view({6}); }, {"view", "reshape"}),
      error("reshape_wrong_numel", [] { zeros({2, 3}).reshape({5}); }, {"reshape", "[5]"}),
      error("reshape_infer_from_zero", [] { zeros({0, 3}).reshape({0, -1}); }, {"reshape", "[0, -1]"}),
      ok("reshape_infer", [] { EXPECT_EQ(zeros({2, 3, 4}).reshape({-1, 4}).sizes(), (Shape{6, 4})); }),
      error("permute_wrong_rank", [] { zeros({2, 3}).permute({0}); }, {"permute", "f32[2, 3]"}),
      error("permute_repeated_dim", [] { zeros({2, 3}).permute({0, 0}); }, {"permute", "repeated"}),
      error("transpose_dim_out_of_range", [] { zeros({2, 3}).transpose(0, 2); }, {"transpose", "dim 2"}),
      error("narrow_past_end", [] { zeros({3}).narrow(0, 2, 2); }, {"narrow", "f32[3]"}),
      error("narrow_negative_length", [] { zeros({3}).narrow(0, 0, -1); }, {"narrow", "-1"}),
      error("select_out_of_range", [] { zeros({2, 3}).select(1, 3); }, {"select", "index 3", "f32[2, 3]"}),
      error("slice_zero_step", [] { zeros({4}).slice(0, 0, 4, 0); }, {"slice", "step"}),
      error("expand_incompatible", [] { zeros({2}).expand({3}); }, {"expand", "[3]"}),
      error("expand_fewer_dims", [] { zeros({2, 2}).expand({2}); }, {"expand", "[2]"}),
      error("squeeze_dim_out_of_range", [] { zeros({1, 2}).squeeze(2); }, {"squeeze", "dim 2"}),
      error("flatten_start_after_end", [] { zeros({2, 3, 4}).flatten(2, 1); }, {"flatten", "start_dim"}),
      // joins and splits
      error("cat_mismatched", [] { cat({zeros({2, 3}), zeros({2, 4})}, 0); }, {"cat", "[2, 3]", "[2, 4]"}),
      error("cat_empty_list", [] { cat({}, 0); }, {"cat"}),
      error("cat_dim_out_of_range", [] { cat({zeros({2}), zeros({2})}, 1); }, {"cat", "dim 1"}),
      error("stack_mismatched", [] { stack({zeros({2}), zeros({3})}); }, {"stack", "[2]", "[3]"}),
      error("split_zero_size", [] { split(zeros({4}), 0); }, {"split", "0"}),
      error("chunk_zero_chunks", [] { chunk(zeros({4}), 0); }, {"chunk", "0"}),
      // matmul
      error("matmul_inner_mismatch", [] { matmul(zeros({2, 3}), zeros({4, 5})); }, {"matmul", "f32[2, 3]", "f32[4, 5]"}),
      error("matmul_batch_mismatch", [] { matmul(zeros({2, 2, 3}), zeros({3, 3, 2})); }, {"matmul", "[2, 2, 3]", "[3, 3, 2]"}),
      error("matmul_scalar", [] { matmul(scalar_tensor(1.0), zeros({2})); }, {"matmul"}),
      // overflow of shapes, offsets and sizes
      error("empty_count_overflows", [] { empty({kBig, kBig}); }, {"empty", "overflow"}),
      error("zeros_count_overflows", [] { zeros({kMax, 2}); }, {"overflow", "[9223372036854775807, 2]"}),
      error("empty_bytes_overflow", [] { empty({int64_t(1) << 62}); }, {"empty", "overflow"}),
      error("zero_size_dim_strides_overflow", [] { zeros({0, kBig, kBig}); }, {"overflow"}),
      error("view_of_empty_overflows", [] { zeros({0}).view({kBig, kBig}); }, {"view", "overflow"}),
      error("view_of_empty_then_read", [] { zeros({0}).view({kBig, kBig}).select(0, 5).select(0, 5).item<float>(); },
            {"view"}),
      error("narrow_start_overflows", [] { zeros({3}).narrow(0, kMax, 2); }, {"narrow", "f32[3]"}),
      error("select_huge_index", [] { zeros({3}).select(0, kMax); }, {"select"}),
      error("expand_overflows", [] { zeros({1, 1}).expand({kBig, kBig}); }, {"expand", "overflow"}),
      error("reshape_overflows", [] { zeros({4}).reshape({int64_t(1) << 62, 8}); }, {"reshape"}),
      error("randn_count_overflows", [] { randn({kBig, kBig}); }, {"overflow"}),
      // out of memory names the tensor (2^45 f32 is 128 TiB, more than any machine's memory)
      error("out_of_memory_names_the_tensor", [] { zeros({int64_t(1) << 45}); },
            {"empty", "f32[35184372088832]", "cpu", "out of memory"}),
  };
}

}  // namespace kiln::robustness
