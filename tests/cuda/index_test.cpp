// CUDA index_select, gather, index_add and scatter_add against the CPU reference, every dtype.
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include <kiln/cuda/runtime.h>

#include "cuda_compare.h"
#include "cuda_test_util.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

const DType kAll[] = {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::boolean};

Tensor values(const Shape& shape, DType t) {
  if (t == DType::boolean) return gt(randn(shape), full({}, 0.5));
  if (t == DType::i32 || t == DType::i64) return cast(mul(randn(shape, {.dtype = DType::f64}), 1000.0), t);
  return rand_cpu(shape, t);
}

// Sums of repeated indices happen in another order on the GPU: allow rounding for f16/bf16.
void expect_same(const Tensor& ref, const Tensor& got, const std::string& what, bool sums) {
  if (!is_floating(ref.dtype()) || !sums) expect_close(ref, got, what, 0.0);
  else expect_close(ref, got, what, -1, 1.0);
}

}  // namespace

TEST(CudaIndex, IndexSelectAllDtypesAndDims) {
  KILN_REQUIRE_GPU();
  manual_seed(41);
  for (DType t : kAll) {
    Tensor x = values({50, 37, 3}, t);
    for (int64_t dim : {0, 1, 2}) {
      Tensor idx = randint(0, x.size(dim), {23});  // repeats included
      expect_same(index_select(x, dim, idx), index_select(x.to(gpu()), dim, idx.to(gpu())),
                  "index_select " + name(t) + " dim " + std::to_string(dim), false);
    }
    // non-contiguous source and i32 indices
    Tensor xt = x.transpose(0, 1);
    Tensor idx32 = cast(randint(0, 50, {9}), DType::i32);
    expect_same(index_select(xt, 1, idx32), index_select(x.to(gpu()).transpose(0, 1), 1, idx32.to(gpu())),
                "index_select of a transposed view " + name(t), false);
  }
  // embedding-sized: 16-byte rows, > 1M elements out
  Tensor table = rand_cpu({5000, 768}, DType::bf16);
  Tensor ids = randint(0, 5000, {2048});
  expect_same(index_select(table, 0, ids), index_select(table.to(gpu()), 0, ids.to(gpu())), "embedding lookup", false);
}

TEST(CudaIndex, GatherAllDtypes) {
  KILN_REQUIRE_GPU();
  manual_seed(42);
  for (DType t : kAll) {
    Tensor x = values({20, 31, 6}, t);
    for (int64_t dim : {0, 1, 2}) {
      Shape ishape = x.sizes();
      ishape[size_t(dim)] = 11;
      Tensor idx = randint(0, x.size(dim), ishape);
      expect_same(gather(x, dim, idx), gather(x.to(gpu()), dim, idx.to(gpu())),
                  "gather " + name(t) + " dim " + std::to_string(dim), false);
    }
  }
  Tensor big = rand_cpu({1000, 1500}, DType::f32);
  Tensor idx = randint(0, 1500, {1000, 1200});
  expect_same(gather(big, 1, idx), gather(big.to(gpu()), 1, idx.to(gpu())), "gather > 1M", false);
}

TEST(CudaIndex, IndexAddAllDtypesWithRepeats) {
  KILN_REQUIRE_GPU();
  manual_seed(43);
  for (DType t : kAll) {
    Tensor a = values({30, 17, 5}, t);
    for (int64_t dim : {0, 1, 2}) {
      Tensor idx = randint(0, a.size(dim), {40});  // many repeats
      Shape sshape = a.sizes();
      sshape[size_t(dim)] = 40;
      Tensor src = values(sshape, t);
      expect_same(index_add(a, dim, idx, src), index_add(a.to(gpu()), dim, idx.to(gpu()), src.to(gpu())),
                  "index_add " + name(t) + " dim " + std::to_string(dim), true);
    }
  }
  // whole rows of float4s (the row kernels): several outer slices, rows of 2 and of 300 float4s
  for (int64_t inner : {8, 1200}) {
    Tensor a3 = rand_cpu({3, 30, inner}, DType::f32), s3 = rand_cpu({3, 40, inner}, DType::f32);
    Tensor i3 = randint(0, 30, {40});
    expect_same(index_add(a3, 1, i3, s3), index_add(a3.to(gpu()), 1, i3.to(gpu()), s3.to(gpu())),
                "index_add f32 rows of " + std::to_string(inner) + ", outer 3", true);
    expect_same(index_select(a3, 1, i3), index_select(a3.to(gpu()), 1, i3.to(gpu())),
                "index_select f32 rows of " + std::to_string(inner) + ", outer 3", false);
  }
  Tensor a = rand_cpu({5000, 768}, DType::f32), src = rand_cpu({2048, 768}, DType::f32);
  Tensor idx = randint(0, 5000, {2048});
  expect_same(index_add(a, 0, idx, src), index_add(a.to(gpu()), 0, idx.to(gpu()), src.to(gpu())),
              "index_add embedding backward > 1M", true);
}

TEST(CudaIndex, ScatterAddAllDtypes) {
  KILN_REQUIRE_GPU();
  manual_seed(44);
  for (DType t : kAll) {
    Tensor a = values({12, 9, 7}, t);
    for (int64_t dim : {0, 1, 2}) {
      Shape ishape = a.sizes();
      ishape[size_t(dim)] = 15;
      Tensor idx = randint(0, a.size(dim), ishape);
      Tensor src = values(ishape, t);
      expect_same(scatter_add(a, dim, idx, src), scatter_add(a.to(gpu()), dim, idx.to(gpu()), src.to(gpu())),
                  "scatter_add " + name(t) + " dim " + std::to_string(dim), true);
    }
  }
}

TEST(CudaIndex, BackwardOfSelectAndGather) {
  KILN_REQUIRE_GPU();
  manual_seed(45);
  // index_select's backward is index_add into zeros; gather's is scatter_add into zeros
  Tensor x = randn({40, 16});
  Tensor idx = randint(0, 40, {70});
  Tensor g = randn({70, 16});
  Tensor xc = x.detach(), xg = x.to(gpu()).detach();
  xc.requires_grad_(true);
  xg.requires_grad_(true);
  index_select(xc, 0, idx).backward(g);
  index_select(xg, 0, idx.to(gpu())).backward(g.to(gpu()));
  expect_close(xc.grad(), xg.grad(), "index_select backward", 1e-5, 1.0);
  Tensor gidx = randint(0, 16, {40, 25});
  Tensor gg = randn({40, 25});
  Tensor yc = x.detach(), yg = x.to(gpu()).detach();
  yc.requires_grad_(true);
  yg.requires_grad_(true);
  gather(yc, 1, gidx).backward(gg);
  gather(yg, 1, gidx.to(gpu())).backward(gg.to(gpu()));
  expect_close(yc.grad(), yg.grad(), "gather backward", 1e-5, 1.0);
}

TEST(CudaIndex, OutOfRangeIndicesAreErrors) {
  KILN_REQUIRE_GPU();
  Tensor x = randn({10, 4}).to(gpu());
  Tensor bad = from_vector<int64_t>({0, 3, 10}, {3}).to(gpu());
  Tensor neg = from_vector<int64_t>({0, -1, 2}, {3}).to(gpu());
  // bad indices are reported at the next synchronization: force one inside each EXPECT_THROW
  EXPECT_THROW(index_select(x, 0, bad).cpu(), Error);
  EXPECT_THROW(index_select(x, 0, neg).cpu(), Error);
  EXPECT_THROW({ index_add(x, 0, bad, randn({3, 4}).to(gpu())); cuda::synchronize(); }, Error);
  Tensor gbad = from_vector<int64_t>({0, 1, 2, 4, 0, 1, 2, 3}, {2, 4}).to(gpu());
  Tensor x2 = randn({2, 4}).to(gpu());
  EXPECT_THROW(gather(x2, 1, gbad).cpu(), Error);
  EXPECT_THROW({ scatter_add(x2, 1, gbad, randn({2, 4}).to(gpu())); cuda::synchronize(); }, Error);
  EXPECT_THROW(index_add(x, 0, from_vector<int64_t>({1}, {1}), randn({1, 4}).to(gpu())), Error);  // index on the CPU
  // still usable
  Tensor ok = index_select(x, 0, from_vector<int64_t>({9, 0}, {2}).to(gpu()));
  EXPECT_EQ(ok.cpu().to_vector<float>().size(), 8u);
}

TEST(CudaIndex, BadIndexIsReportedAtTheNextSynchronizationThenCleared) {
  KILN_REQUIRE_GPU();
  Tensor x = randn({10, 4}).to(gpu());
  Tensor bad = from_vector<int64_t>({0, 3, 10}, {3}).to(gpu());
  Tensor y;
  EXPECT_NO_THROW(y = index_select(x, 0, bad));  // no synchronization per call
  Tensor other = add(x, x);                     // unrelated work queued after it
  try {
    cuda::synchronize();
    ADD_FAILURE() << "expected the deferred index error";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("index_select"), std::string::npos) << what;
    EXPECT_NE(what.find("index 10"), std::string::npos) << what;
    EXPECT_NE(what.find("[0, 10)"), std::string::npos) << what;
  }
  // cleared: the next synchronization and copies are clean
  EXPECT_NO_THROW(cuda::synchronize());
  EXPECT_EQ(other.cpu().to_vector<float>().size(), 40u);
  // the first error wins until it is reported
  gather(randn({2, 4}).to(gpu()), 1, from_vector<int64_t>({0, 1, 2, 5, 0, 1, 2, 3}, {2, 4}).to(gpu()));
  index_select(x, 0, bad);
  try {
    cuda::synchronize();
    ADD_FAILURE() << "expected the deferred gather error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gather: index 5"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(cuda::synchronize());
}

TEST(CudaIndex, SyncCheckReportsABadIndexAtTheLaunch) {
  KILN_REQUIRE_GPU();
  Tensor x = randn({10, 4}).to(gpu());
  Tensor bad = from_vector<int64_t>({0, -3}, {2}).to(gpu());
  bool was = cuda::sync_check();
  cuda::set_sync_check(true);
  EXPECT_THROW(index_select(x, 0, bad), Error);
  cuda::set_sync_check(was);
  EXPECT_NO_THROW(cuda::synchronize());
}
