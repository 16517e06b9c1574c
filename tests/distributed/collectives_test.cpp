// Every collective of the MPI group, in every dtype, against an expectation each rank computes for itself:
// rank r contributes values that are a function of (r, index), so the sum, the max and the gathered order
// are known without communication.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <vector>

#include <kiln/core/ops.h>

#include "collective_values.h"
#include "distributed_test_util.h"

namespace kiln::distributed {
namespace {

using testing::world;

const std::vector<DType> kDtypes = {DType::f32, DType::bf16, DType::f16, DType::i64};

// Rank r's value at index i: small integers, exact in every dtype (and their sums and means too).
double value(int r, int64_t i) { return double((i * 3 + r * 5) % 17) - 8.0; }
Tensor values_of(int r, int64_t n, DType t, int64_t offset = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = value(r, offset + i);
  return cast(from_vector(v, {n}), t);
}
std::vector<double> host(const Tensor& t) { return cast(t, DType::f64).to_vector<double>(); }

// Under ctest the job has the ranks it was started with (mpiexec -n 2), not a group of one.
TEST(Collectives, TheGroupHasEveryRank) {
  const auto& pg = world();
  if (const char* n = std::getenv("KILN_TEST_WORLD_SIZE")) {
    EXPECT_EQ(pg->size(), std::atoi(n));
  }
  EXPECT_GE(pg->rank(), 0);
  EXPECT_LT(pg->rank(), pg->size());
  EXPECT_GE(pg->local_rank(), 0);
  EXPECT_STREQ(pg->backend(), "mpi");
}

TEST(Collectives, AllReduceSumAvgMax) {
  const auto& pg = world();
  const int n = pg->size();
  const int64_t len = 1000;
  for (DType t : kDtypes)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      if (op == ReduceOp::avg && t == DType::i64) continue;
      SCOPED_TRACE(std::string(dtype_name(t)) + " " + reduce_op_name(op));
      Tensor x = values_of(pg->rank(), len, t);
      pg->all_reduce(x, op);
      EXPECT_EQ(x.dtype(), t);
      const std::vector<double> got = host(x);
      for (int64_t i = 0; i < len; ++i) {
        double sum = 0, mx = -1e9;
        for (int r = 0; r < n; ++r) sum += value(r, i), mx = std::max(mx, value(r, i));
        const double want = op == ReduceOp::sum ? sum : op == ReduceOp::max ? mx : sum / n;
        // exact but for the rounding of the mean to the dtype
        const double tol = op == ReduceOp::avg && t != DType::f32 ? std::abs(want) * 1e-2 : 0.0;
        ASSERT_NEAR(got[size_t(i)], want, tol) << "element " << i;
      }
    }
}

TEST(Collectives, BroadcastFromEveryRoot) {
  const auto& pg = world();
  for (DType t : kDtypes)
    for (int root = 0; root < pg->size(); ++root) {
      Tensor x = values_of(pg->rank(), 77, t);
      pg->broadcast(x, root);
      EXPECT_EQ(host(x), host(values_of(root, 77, t))) << dtype_name(t) << " root " << root;
    }
}

TEST(Collectives, AllGatherPutsRanksInOrder) {
  const auto& pg = world();
  const int64_t len = 33;
  for (DType t : kDtypes) {
    Tensor out = empty({pg->size() * len}, {.dtype = t});
    pg->all_gather(out, values_of(pg->rank(), len, t));
    std::vector<double> want;
    for (int r = 0; r < pg->size(); ++r)
      for (double v : host(values_of(r, len, t))) want.push_back(v);
    EXPECT_EQ(host(out), want) << dtype_name(t);
  }
}

// In place: the input is this rank's slice of the output; any other overlap is an error.
TEST(Collectives, AllGatherInPlace) {
  const auto& pg = world();
  const int64_t len = 21;
  for (DType t : kDtypes) {
    Tensor out = zeros({pg->size() * len}, {.dtype = t});
    out.narrow(0, pg->rank() * len, len).copy_(values_of(pg->rank(), len, t));
    pg->all_gather(out, out.narrow(0, pg->rank() * len, len));
    std::vector<double> want;
    for (int r = 0; r < pg->size(); ++r)
      for (double v : host(values_of(r, len, t))) want.push_back(v);
    EXPECT_EQ(host(out), want) << dtype_name(t);
  }
  if (pg->size() > 1) {
    Tensor out = zeros({pg->size() * len});
    const int64_t other = (pg->rank() + 1) % pg->size();
    EXPECT_THROW(pg->all_gather(out, out.narrow(0, other * len, len)), Error);
  }
}

// In place: the output is this rank's slice of the input (ZeroAdamW's gradient shard); any other overlap
// is an error.
TEST(Collectives, ReduceScatterInPlace) {
  const auto& pg = world();
  const int n = pg->size();
  const int64_t len = 19;
  for (DType t : kDtypes) testing::expect_reduce_scatter_in_place(*pg, len, t);
  if (n > 1) {
    Tensor in = zeros({n * len});
    const int64_t other = (pg->rank() + 1) % n;
    EXPECT_THROW(pg->reduce_scatter(in.narrow(0, other * len, len), in), Error);
  }
}

TEST(Collectives, ReduceScatterGivesEachRankItsSlice) {
  const auto& pg = world();
  const int n = pg->size();
  const int64_t len = 40;  // per rank
  for (DType t : kDtypes)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      if (op == ReduceOp::avg && t == DType::i64) continue;
      Tensor out = empty({len}, {.dtype = t});
      pg->reduce_scatter(out, values_of(pg->rank(), n * len, t), op);
      const std::vector<double> got = host(out);
      for (int64_t i = 0; i < len; ++i) {
        const int64_t g = pg->rank() * len + i;
        double sum = 0, mx = -1e9;
        for (int r = 0; r < n; ++r) sum += value(r, g), mx = std::max(mx, value(r, g));
        const double want = op == ReduceOp::sum ? sum : op == ReduceOp::max ? mx : sum / n;
        const double tol = op == ReduceOp::avg && t != DType::f32 ? std::abs(want) * 1e-2 : 0.0;
        ASSERT_NEAR(got[size_t(i)], want, tol) << dtype_name(t) << " " << reduce_op_name(op) << " element " << i;
      }
    }
}

TEST(Collectives, AsyncWorkCompletesAndBarrierPasses) {
  const auto& pg = world();
  Tensor a = values_of(pg->rank(), 10, DType::f32), b = values_of(pg->rank(), 10, DType::f32);
  auto wa = pg->all_reduce_async(a, ReduceOp::sum);
  auto wb = pg->all_reduce_async(b, ReduceOp::max);
  wb->wait();
  wa->wait();
  EXPECT_TRUE(wa->is_completed());
  EXPECT_EQ(host(a)[0], [&] {
    double s = 0;
    for (int r = 0; r < pg->size(); ++r) s += value(r, 0);
    return s;
  }());
  pg->barrier();
}

TEST(Collectives, BadUseIsAClearError) {
  const auto& pg = world();
  EXPECT_THROW(pg->all_reduce(ones({4, 4}).t()), Error);                           // not contiguous
  EXPECT_THROW(pg->all_reduce(ones({4}, {.dtype = DType::f64})), Error);           // f64
  EXPECT_THROW(pg->all_reduce(ones({4}, {.dtype = DType::i64}), ReduceOp::avg), Error);
  EXPECT_THROW(pg->broadcast(ones({4}), pg->size()), Error);                       // no such root
  EXPECT_THROW(pg->all_gather(ones({3}), ones({2})), Error);                       // output not size x input
  EXPECT_THROW(pg->reduce_scatter(ones({3}), ones({3 * pg->size() + 1})), Error);
  try {
    pg->all_reduce(ones({2}, {.dtype = DType::f64}));
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("all_reduce"), std::string::npos) << msg;
    EXPECT_NE(msg.find("mpi group of " + std::to_string(pg->size())), std::string::npos) << msg;
    EXPECT_NE(msg.find("f64"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace kiln::distributed
