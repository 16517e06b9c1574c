// CPU results must not depend on the number of threads: a run resumed on a machine with another core
// count (or another OMP_NUM_THREADS) continues bit for bit. Eigen's own threading chose its K blocking
// from the thread count, so f32 matmul results moved with it.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/parallel.h>
#include <kiln/core/random.h>

namespace kiln {
namespace {

// The bytes fn() produces with 1 thread and with 3 threads.
void expect_same_bits_for_any_thread_count(const std::function<Tensor()>& fn, const char* what) {
  const int saved = get_num_threads();
  set_num_threads(1);
  Tensor one = fn().contiguous();
  set_num_threads(3);
  Tensor three = fn().contiguous();
  set_num_threads(saved);
  ASSERT_EQ(one.sizes(), three.sizes());
  EXPECT_EQ(std::memcmp(one.raw_data(), three.raw_data(), size_t(one.numel()) * one.element_size()), 0) << what;
}

TEST(ThreadCount, MatmulAndReductionsGiveTheSameBits) {
  manual_seed(11);
  Tensor a = randn({300, 517}), b = randn({517, 611}), batch_a = randn({3, 129, 250}), batch_b = randn({3, 250, 300});
  Tensor big = randn({1000, 1000});
  expect_same_bits_for_any_thread_count([&] { return matmul(a, b); }, "f32 matmul");
  expect_same_bits_for_any_thread_count([&] { return matmul(b.t(), a.t()); }, "f32 matmul of transposes");
  expect_same_bits_for_any_thread_count([&] { return matmul(batch_a, batch_b); }, "batched f32 matmul");
  expect_same_bits_for_any_thread_count([&] { return matmul(a.to(DType::f64), b.to(DType::f64)); }, "f64 matmul");
  expect_same_bits_for_any_thread_count([&] { return sum(big); }, "sum of everything");
  expect_same_bits_for_any_thread_count([&] { return sum(big, {0}); }, "column sums");
  expect_same_bits_for_any_thread_count([&] { return var(big, {1}); }, "row variances");
  expect_same_bits_for_any_thread_count([&] { return softmax(big, 1); }, "softmax");
}

TEST(ThreadCount, SetNumThreadsRefusesZero) {
  EXPECT_THROW(set_num_threads(0), Error);
  const int saved = get_num_threads();
  set_num_threads(2);
  EXPECT_EQ(get_num_threads(), 2);
  set_num_threads(saved);
}

}  // namespace
}  // namespace kiln
