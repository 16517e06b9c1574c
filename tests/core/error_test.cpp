// User errors throw kiln::Error with a message that names the op and what was wrong.
#include <gtest/gtest.h>

#include <kiln/core/ops.h>

#include "core_test_util.h"

using namespace kiln;

TEST(Errors, BroadcastMismatchNamesBothShapes) {
  Tensor a = zeros({2, 3}), b = zeros({4});
  EXPECT_KILN_ERROR(add(a, b), "add", "[2, 3]", "[4]");
  EXPECT_KILN_ERROR(a * zeros({3, 3}), "mul", "[2, 3]", "[3, 3]");
  EXPECT_KILN_ERROR(where(zeros({2}, {.dtype = DType::boolean}), a, a), "where");
}

TEST(Errors, MatmulInnerDimMismatchNamesBothTensors) {
  Tensor a = zeros({2, 3}), b = zeros({4, 5});
  EXPECT_KILN_ERROR(matmul(a, b), "matmul", "f32[2, 3]", "f32[4, 5]");
  EXPECT_KILN_ERROR(matmul(zeros({3}), zeros({4})), "matmul", "[3]", "[4]");
  EXPECT_KILN_ERROR(matmul(zeros({2, 2, 3}), zeros({3, 2, 2})), "matmul");  // batch dims 2 vs 3
  EXPECT_KILN_ERROR(matmul(scalar_tensor(1.0), zeros({2})), "matmul");
  EXPECT_KILN_ERROR(matmul(zeros({2, 2}, {.dtype = DType::i64}), zeros({2, 2}, {.dtype = DType::i64})), "matmul");
}

TEST(Errors, DimOutOfRange) {
  Tensor a = zeros({2, 3});
  EXPECT_KILN_ERROR(sum(a, {2}), "sum", "dim 2");
  EXPECT_KILN_ERROR(sum(a, {-3}), "sum", "dim -3");
  EXPECT_KILN_ERROR(softmax(a, 2), "softmax", "dim 2");
  EXPECT_KILN_ERROR(a.size(5), "dim 5");
  EXPECT_KILN_ERROR(a.transpose(0, 2), "transpose");
  EXPECT_KILN_ERROR(a.narrow(3, 0, 1), "narrow");
  EXPECT_KILN_ERROR(cat({a, a}, 2), "cat");
  EXPECT_KILN_ERROR(argmax(a, -3), "argmax");
  EXPECT_KILN_ERROR(index_select(a, 2, from_vector<int64_t>({0}, {1})), "index_select");
  EXPECT_KILN_ERROR(gather(a, 2, zeros({2, 3}, {.dtype = DType::i64})), "gather");
}

TEST(Errors, IndexOutOfRange) {
  Tensor a = zeros({2, 3});
  EXPECT_KILN_ERROR(index_select(a, 0, from_vector<int64_t>({0, 2}, {2})), "index_select", "index 2");
  EXPECT_KILN_ERROR(index_select(a, 1, from_vector<int64_t>({-1}, {1})), "index_select", "-1");
  EXPECT_KILN_ERROR(gather(a, 1, from_vector<int64_t>({0, 3, 0, 0, 0, 0}, {2, 3})), "gather", "index 3");
  EXPECT_KILN_ERROR(scatter_add(a, 0, from_vector<int64_t>({0, 0, 5, 0, 0, 0}, {2, 3}), ones({2, 3})), "scatter_add", "5");
  EXPECT_KILN_ERROR(index_add(a, 0, from_vector<int64_t>({7}, {1}), ones({1, 3})), "index_add", "7");
  EXPECT_KILN_ERROR(index_select(a, 0, zeros({1})), "index_select", "i32 or i64");
  EXPECT_KILN_ERROR(gather(a, 1, zeros({2}, {.dtype = DType::i64})), "gather");
  EXPECT_KILN_ERROR(index_add(a, 0, from_vector<int64_t>({0}, {1}), ones({2, 3})), "index_add");
}

TEST(Errors, ItemNeedsOneElement) {
  EXPECT_KILN_ERROR(zeros({2}).item<float>(), "item", "[2]");
  EXPECT_KILN_ERROR(zeros({0}).item<float>(), "item");
  EXPECT_EQ(zeros({1, 1}).item<float>(), 0.0f);
}

TEST(Errors, RequiresGradOnIntegerTensor) {
  Tensor i = zeros({2}, {.dtype = DType::i64});
  EXPECT_KILN_ERROR(i.requires_grad_(), "requires_grad_", "i64");
  EXPECT_KILN_ERROR(zeros({2}, {.dtype = DType::i32, .requires_grad = true}), "requires_grad_");
  EXPECT_KILN_ERROR(zeros({2}, {.dtype = DType::boolean}).requires_grad_(true), "requires_grad_");
  EXPECT_NO_THROW(i.requires_grad_(false));
}

TEST(Errors, ShapesAndArguments) {
  EXPECT_KILN_ERROR(zeros({-1}), "negative");
  EXPECT_KILN_ERROR(tensor({1, 2, 3}, {2, 2}), "from_vector");
  EXPECT_KILN_ERROR(zeros({2, 3}).data_ptr<double>(), "data_ptr");
  EXPECT_KILN_ERROR(arange(0.0, 1.0, 0.0), "arange");
  EXPECT_KILN_ERROR(Tensor().sizes(), "undefined");
  EXPECT_KILN_ERROR(mean(zeros({2}, {.dtype = DType::i32})), "mean");
  EXPECT_KILN_ERROR(softmax(zeros({2}, {.dtype = DType::i64}), 0), "softmax");
}
