// The Loader: reproducible shuffling and a bounded prefetch queue filled by one background thread.
//
// The worker builds batches in epoch order and pushes them into a queue of at most `prefetch` batches;
// the iterator pops them. So at most prefetch + 1 batches exist at once (queued ones plus the one in use),
// and a consumer slower than the loader never lets memory grow. An exception in the worker (a dataset
// error) travels through the queue and is rethrown by the iterator at the batch where it happened.
// Destroying the iterator (the end of the loop, a break, an exception) stops the worker and joins it.
#include <kiln/core/data/data.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/random.h>
#include <kiln/cuda/runtime.h>

namespace kiln::data {

struct Loader::Run {
  struct Item {
    Batch batch;
    std::exception_ptr error;
  };

  Run(const Dataset& dataset, std::vector<int64_t> order, int64_t batch_size, int64_t num_batches, int64_t prefetch,
      bool pin)
      : dataset_(dataset), order_(std::move(order)), batch_size_(batch_size), num_batches_(num_batches),
        prefetch_(prefetch), pin_(pin) {
    if (prefetch_ > 0 && num_batches_ > 0) worker_ = std::thread([this] { work(); });
  }

  ~Run() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    space_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  int64_t num_batches() const { return num_batches_; }

  // Batch number b (0-based), in order; b counts up by one per call.
  Batch next(int64_t b) {
    if (prefetch_ == 0) return make(b);
    Item item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [&] { return !queue_.empty(); });
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    space_.notify_one();
    if (item.error) std::rethrow_exception(item.error);
    return std::move(item.batch);
  }

 private:
  Batch make(int64_t b) const {
    auto first = order_.begin() + b * batch_size_;
    auto last = order_.begin() + std::min<int64_t>((b + 1) * batch_size_, int64_t(order_.size()));
    Batch batch = dataset_.get_batch(std::vector<int64_t>(first, last));
    if (pin_) {
      batch.x = cuda::pin_memory(batch.x);
      batch.y = cuda::pin_memory(batch.y);
    }
    return batch;
  }

  void work() {
    NoGradGuard no_grad;  // grad mode is per thread; batches never belong to a graph
    for (int64_t b = 0; b < num_batches_; ++b) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        space_.wait(lock, [&] { return stop_ || int64_t(queue_.size()) < prefetch_; });
        if (stop_) return;
      }
      Item item;
      try {
        item.batch = make(b);
      } catch (...) {
        item.error = std::current_exception();
      }
      bool failed = item.error != nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.push_back(std::move(item));
      }
      ready_.notify_one();
      if (failed) return;  // the consumer rethrows and stops there
    }
  }

  const Dataset& dataset_;
  const std::vector<int64_t> order_;
  const int64_t batch_size_, num_batches_, prefetch_;
  const bool pin_;
  std::mutex mutex_;
  std::condition_variable space_, ready_;
  std::deque<Item> queue_;
  bool stop_ = false;
  std::thread worker_;  // last: starts after everything it uses exists
};

Loader::Loader(const Dataset& dataset, LoaderOptions options) : dataset_(&dataset), options_(options) {
  KILN_CHECK(options_.batch_size > 0, "Loader: batch_size must be positive, got ", options_.batch_size);
  KILN_CHECK(options_.prefetch >= 0, "Loader: prefetch must be >= 0, got ", options_.prefetch);
  KILN_CHECK(!options_.pin_memory || cuda::is_available(), "Loader: pin_memory needs a CUDA device");
  KILN_CHECK(options_.num_replicas >= 1 && options_.rank >= 0 && options_.rank < options_.num_replicas,
             "Loader: rank ", options_.rank, " is not a replica of ", options_.num_replicas);
  if (options_.seed) {
    seed_ = *options_.seed;
  } else {
    Generator& g = default_generator();
    seed_ = uint64_t(g.next_u32()) << 32 | g.next_u32();
  }
}

int64_t Loader::replica_size() const {
  const int64_t n = dataset_->size(), r = options_.num_replicas;
  return options_.drop_uneven ? n / r : (n + r - 1) / r;
}

int64_t Loader::size() const {
  int64_t n = replica_size(), b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

void Loader::set_epoch(int64_t epoch) {
  KILN_CHECK(epoch >= 0, "Loader: epoch must be >= 0, got ", epoch);
  epoch_ = epoch;
}

std::vector<int64_t> Loader::order(int64_t epoch) const {
  std::vector<int64_t> order(size_t(dataset_->size()));
  std::iota(order.begin(), order.end(), int64_t(0));
  if (!options_.shuffle) return order;
  // Each epoch owns 2^40 Philox blocks of the seed's stream: the order is a function of (seed, epoch)
  // alone, whatever was drawn for earlier epochs.
  Generator g(seed_);
  g.set_state({seed_, uint64_t(epoch) << 40});
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[g.random_below(i)]);  // Fisher-Yates
  return order;
}

std::vector<int64_t> Loader::replica_order(int64_t epoch) const {
  std::vector<int64_t> all = order(epoch);
  if (options_.num_replicas == 1) return all;
  const int64_t per_replica = replica_size(), r = options_.num_replicas;
  std::vector<int64_t> mine;
  mine.reserve(size_t(per_replica));
  // element k of the padded order is all[k mod n]: the start repeated to fill the last round
  for (int64_t i = 0; i < per_replica; ++i) mine.push_back(all[size_t((i * r + options_.rank) % int64_t(all.size()))]);
  return mine;
}

Loader::Iterator Loader::begin() {
  int64_t epoch = epoch_++;
  auto run = std::make_unique<Run>(*dataset_, replica_order(epoch), options_.batch_size, size(), options_.prefetch,
                                    options_.pin_memory);
  return Iterator(std::move(run));
}

Loader::Iterator::Iterator() = default;
Loader::Iterator::Iterator(Iterator&&) noexcept = default;
Loader::Iterator& Loader::Iterator::operator=(Iterator&&) noexcept = default;
Loader::Iterator::~Iterator() = default;

Loader::Iterator::Iterator(std::unique_ptr<Run> run) : run_(std::move(run)) {
  index_ = -1;
  fetch();
}

Loader::Iterator& Loader::Iterator::operator++() {
  KILN_CHECK(!done_, "Loader: iterator incremented past the end of the epoch");
  fetch();
  return *this;
}

void Loader::Iterator::fetch() {
  ++index_;
  done_ = index_ >= run_->num_batches();
  current_ = Batch{};  // release the previous batch before waiting for the next
  if (done_) {
    run_.reset();  // the worker has finished; join it now rather than when the iterator dies
    return;
  }
  try {
    current_ = run_->next(index_);
  } catch (...) {
    done_ = true;
    run_.reset();
    throw;
  }
}

}  // namespace kiln::data
