// Loader: batching, reproducible shuffling, drop_last, the prefetch thread and early exits.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include <kiln/core/data/data.h>
#include <kiln/core/random.h>

namespace kiln::data {
namespace {

// Example i is x = i, y = 2i; records which threads built batches and can be slowed down or made to fail.
class IndexDataset : public Dataset {
 public:
  explicit IndexDataset(int64_t n, int fail_at = -1, int delay_ms = 0) : n_(n), fail_at_(fail_at), delay_ms_(delay_ms) {}
  int64_t size() const override { return n_; }
  Batch get_batch(const std::vector<int64_t>& indices) const override {
    if (delay_ms_) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      threads_.insert(std::this_thread::get_id());
    }
    ++calls_;
    Tensor x = empty({int64_t(indices.size())}, {.dtype = DType::i64});
    Tensor y = empty({int64_t(indices.size())}, {.dtype = DType::i64});
    for (size_t i = 0; i < indices.size(); ++i) {
      KILN_CHECK(indices[i] != fail_at_, "IndexDataset: example ", indices[i], " is broken");
      x.data_ptr<int64_t>()[i] = indices[i];
      y.data_ptr<int64_t>()[i] = 2 * indices[i];
    }
    return {x, y};
  }
  std::set<std::thread::id> threads() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return threads_;
  }
  mutable std::atomic<int> calls_{0};

 private:
  int64_t n_;
  int64_t fail_at_;
  int delay_ms_;
  mutable std::mutex mutex_;
  mutable std::set<std::thread::id> threads_;
};

// One epoch's indices, batch by batch.
std::vector<std::vector<int64_t>> epoch_batches(Loader& loader) {
  std::vector<std::vector<int64_t>> out;
  for (auto [x, y] : loader) {  // structured bindings on Batch
    std::vector<int64_t> ids(x.data_ptr<int64_t>(), x.data_ptr<int64_t>() + x.numel());
    for (int64_t i = 0; i < y.numel(); ++i) EXPECT_EQ(y.data_ptr<int64_t>()[i], 2 * ids[size_t(i)]);
    out.push_back(std::move(ids));
  }
  return out;
}

std::vector<int64_t> flatten(const std::vector<std::vector<int64_t>>& batches) {
  std::vector<int64_t> all;
  for (const auto& b : batches) all.insert(all.end(), b.begin(), b.end());
  return all;
}

TEST(Loader, SequentialBatchesWithoutShuffle) {
  IndexDataset ds(10);
  Loader loader(ds, {.batch_size = 4});
  EXPECT_EQ(loader.size(), 3);
  auto batches = epoch_batches(loader);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0], (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(batches[2], (std::vector<int64_t>{8, 9}));  // the last batch is smaller
}

TEST(Loader, ShuffleCoversEveryIndexOncePerEpoch) {
  IndexDataset ds(1000);
  for (int64_t prefetch : {0, 1, 3}) {
    SCOPED_TRACE(prefetch);
    Loader loader(ds, {.batch_size = 64, .shuffle = true, .seed = 7, .prefetch = prefetch});
    for (int epoch = 0; epoch < 3; ++epoch) {
      auto all = flatten(epoch_batches(loader));
      ASSERT_EQ(all.size(), 1000u);
      std::vector<int64_t> sorted = all;
      std::sort(sorted.begin(), sorted.end());
      for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[size_t(i)], i);
      EXPECT_NE(all, sorted) << "shuffled";
    }
  }
}

// Replicas (DistributedSampler): every rank a disjoint share of the same epoch order, padded by repeating
// its start (or cut with drop_uneven) so that the shares are equal.
TEST(Loader, ReplicasSplitEachEpochsOrder) {
  IndexDataset ds(10);
  for (bool drop : {false, true}) {
    std::vector<int64_t> seen;
    Loader whole(ds, {.batch_size = 3, .shuffle = true, .seed = 9});
    const std::vector<int64_t> order = whole.order(0);
    for (int64_t rank = 0; rank < 3; ++rank) {
      Loader loader(ds, {.batch_size = 3, .shuffle = true, .seed = 9, .num_replicas = 3, .rank = rank,
                         .drop_uneven = drop});
      EXPECT_EQ(loader.replica_size(), drop ? 3 : 4);
      EXPECT_EQ(loader.size(), drop ? 1 : 2);
      auto mine = flatten(epoch_batches(loader));
      ASSERT_EQ(int64_t(mine.size()), loader.replica_size());
      for (size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(mine[i], order[(i * 3 + size_t(rank)) % 10]);
      seen.insert(seen.end(), mine.begin(), mine.end());
    }
    std::sort(seen.begin(), seen.end());
    if (drop) {
      EXPECT_EQ(seen.size(), 9u);
      EXPECT_EQ(std::unique(seen.begin(), seen.end()), seen.end()) << "disjoint shares";
    } else {
      EXPECT_EQ(seen.size(), 12u);  // 10 and the first 2 again
      EXPECT_EQ(std::unique(seen.begin(), seen.end()) - seen.begin(), 10) << "every index";
    }
  }
  EXPECT_THROW(Loader(ds, {.num_replicas = 2, .rank = 2}), Error);
}

TEST(Loader, OrderDependsOnSeedAndEpochOnly) {
  IndexDataset ds(500);
  Loader a(ds, {.batch_size = 50, .shuffle = true, .seed = 42});
  Loader b(ds, {.batch_size = 32, .shuffle = true, .seed = 42, .prefetch = 0});
  auto a0 = flatten(epoch_batches(a)), a1 = flatten(epoch_batches(a));
  EXPECT_NE(a0, a1) << "a new epoch, a new order";
  EXPECT_EQ(flatten(epoch_batches(b)), a0) << "same seed and epoch, same order (batch size does not matter)";
  EXPECT_EQ(a.epoch(), 2);

  // Resuming at epoch 1 reproduces epoch 1, whatever ran before.
  Loader resumed(ds, {.batch_size = 50, .shuffle = true, .seed = 42});
  resumed.set_epoch(1);
  EXPECT_EQ(flatten(epoch_batches(resumed)), a1);
  EXPECT_EQ(resumed.order(0), a0);

  Loader other(ds, {.batch_size = 50, .shuffle = true, .seed = 43});
  EXPECT_NE(flatten(epoch_batches(other)), a0);
}

TEST(Loader, UnsetSeedComesFromTheDefaultGenerator) {
  IndexDataset ds(100);
  manual_seed(5);
  Loader a(ds, {.batch_size = 10, .shuffle = true});
  Loader b(ds, {.batch_size = 10, .shuffle = true});
  manual_seed(5);
  Loader c(ds, {.batch_size = 10, .shuffle = true});
  EXPECT_NE(a.seed(), b.seed()) << "a loader made per epoch still gets a new order";
  EXPECT_EQ(a.seed(), c.seed()) << "reproducible after manual_seed";
  EXPECT_EQ(flatten(epoch_batches(a)), flatten(epoch_batches(c)));
}

TEST(Loader, DropLast) {
  IndexDataset ds(10);
  Loader loader(ds, {.batch_size = 4, .shuffle = true, .drop_last = true, .seed = 1});
  EXPECT_EQ(loader.size(), 2);
  auto batches = epoch_batches(loader);
  ASSERT_EQ(batches.size(), 2u);
  for (const auto& b : batches) EXPECT_EQ(b.size(), 4u);
  auto all = flatten(batches);
  EXPECT_EQ(std::set<int64_t>(all.begin(), all.end()).size(), 8u);

  Loader exact(ds, {.batch_size = 5, .drop_last = true});
  EXPECT_EQ(epoch_batches(exact).size(), 2u);
  Loader too_big(ds, {.batch_size = 11, .drop_last = true});
  EXPECT_EQ(too_big.size(), 0);
  EXPECT_TRUE(epoch_batches(too_big).empty());
}

TEST(Loader, EmptyDatasetAndBadOptions) {
  IndexDataset empty_ds(0);
  Loader loader(empty_ds, {.batch_size = 4});
  EXPECT_EQ(loader.size(), 0);
  EXPECT_TRUE(epoch_batches(loader).empty());
  IndexDataset ds(4);
  EXPECT_THROW(Loader(ds, {.batch_size = 0}), Error);
  EXPECT_THROW(Loader(ds, {.prefetch = -1}), Error);
  EXPECT_THROW(loader.set_epoch(-1), Error);
}

TEST(Loader, PrefetchRunsOnAnotherThread) {
  IndexDataset ds(40);
  Loader loader(ds, {.batch_size = 4, .prefetch = 2});
  epoch_batches(loader);
  auto threads = ds.threads();
  EXPECT_EQ(threads.count(std::this_thread::get_id()), 0u);
  EXPECT_EQ(threads.size(), 1u);

  IndexDataset sync_ds(40);
  Loader sync(sync_ds, {.batch_size = 4, .prefetch = 0});
  epoch_batches(sync);
  EXPECT_EQ(sync_ds.threads(), std::set<std::thread::id>{std::this_thread::get_id()});
}

TEST(Loader, PrefetchOverlapsWithTheConsumer) {
  // 10 batches of 20 ms each, consumed with 20 ms of "training" each: overlapped ~200 ms, serial ~400 ms.
  IndexDataset ds(10, -1, 20);
  Loader loader(ds, {.batch_size = 1, .prefetch = 2});
  auto start = std::chrono::steady_clock::now();
  for (auto [x, y] : loader) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(ms, 350.0);
}

TEST(Loader, BreakingOutEarlyStopsTheWorker) {
  IndexDataset ds(100000, -1, 1);
  Loader loader(ds, {.batch_size = 1, .shuffle = true, .seed = 3, .prefetch = 4});
  auto start = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < 20; ++epoch) {
    int seen = 0;
    for (auto [x, y] : loader) {
      if (++seen == 3) break;
    }
    EXPECT_EQ(seen, 3);
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(s, 5.0);
  // The worker stopped: at most prefetch + a batch in flight beyond what was consumed, per epoch.
  EXPECT_LE(ds.calls_.load(), 20 * (3 + 4 + 1));

  // An iterator abandoned mid-epoch (never reaching the end) also shuts down cleanly.
  auto it = loader.begin();
  ++it;
  EXPECT_EQ(it.index(), 1);
}

TEST(Loader, DatasetErrorsReachTheCaller) {
  for (int64_t prefetch : {0, 2}) {
    SCOPED_TRACE(prefetch);
    IndexDataset ds(20, /*fail_at=*/9);
    Loader loader(ds, {.batch_size = 4, .prefetch = prefetch});
    int batches = 0;
    try {
      for (auto [x, y] : loader) {
        (void)x;
        ++batches;
      }
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("example 9 is broken"), std::string::npos);
    }
    EXPECT_EQ(batches, 2);  // batches 0 and 1 arrived; batch 2 holds example 9
    EXPECT_THROW(epoch_batches(loader), Error);  // the next epoch reaches the broken example too
  }
}

TEST(Loader, TensorDatasetRows) {
  Tensor x = arange(0.0, 12.0, 1.0).reshape({6, 2});
  Tensor y = arange(int64_t(6));
  TensorDataset ds(x, y);
  EXPECT_EQ(ds.size(), 6);
  Batch b = ds.get_batch({4, 1});
  EXPECT_EQ(b.x.shape(), (Shape{2, 2}));
  EXPECT_EQ(b.x.to_vector<float>(), (std::vector<float>{8, 9, 2, 3}));
  EXPECT_EQ(b.y.to_vector<int64_t>(), (std::vector<int64_t>{4, 1}));
  EXPECT_THROW(ds.get_batch({6}), Error);
  EXPECT_THROW(TensorDataset(x, arange(int64_t(5))), Error);
  Loader loader(ds, {.batch_size = 4, .shuffle = true, .seed = 0});
  int64_t rows = 0;
  for (auto [bx, by] : loader) rows += bx.size(0);
  EXPECT_EQ(rows, 6);
}

}  // namespace
}  // namespace kiln::data
