// The NCCL group's watchdog (distributed/watchdog.h) on the host, with probes standing in for CUDA event
// queries: collectives that finish are retired; one that outlives the timeout, one whose launch never
// returns, one whose probe blocks (a query stuck behind a hung device) and an asynchronous error each end
// in on_failure, once, with a message naming the collective.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <kiln/core/error.h>
#include <kiln/distributed/watchdog.h>

namespace kiln::distributed {
namespace {

using namespace std::chrono_literals;

// Collects on_failure's calls; wait_for_failure gives up after a bound far above the timeouts used.
struct Failures {
  std::mutex mutex;
  std::condition_variable cv;
  std::string message;
  int calls = 0;
  std::function<void(const std::string&)> handler() {
    return [this](const std::string& m) {
      std::lock_guard<std::mutex> lock(mutex);
      message = m;
      ++calls;
      cv.notify_all();
    };
  }
  bool wait_for_failure(std::chrono::milliseconds bound = 10s) {
    std::unique_lock<std::mutex> lock(mutex);
    return cv.wait_for(lock, bound, [&] { return calls > 0; });
  }
};

CollectiveWatchdog::Options options(Failures& f, std::chrono::milliseconds timeout) {
  return {.timeout = timeout, .tick = 5ms, .poll_error = nullptr, .on_failure = f.handler()};
}

TEST(CollectiveWatchdog, RetiresCollectivesThatFinish) {
  Failures f;
  CollectiveWatchdog w(options(f, 300ms));
  std::atomic<bool> first_done{false};
  const uint64_t a = w.begin("all_reduce (sum) on the nccl group of 2 ranks (rank 0)");
  const uint64_t b = w.begin("broadcast on the nccl group of 2 ranks (rank 0)");
  w.launched(a, [&] { return first_done.load(); });
  w.launched(b, [] { return true; });
  EXPECT_EQ(w.in_flight(), 2u);
  first_done = true;  // in order: the second retires after the first
  for (int i = 0; i < 1000 && w.in_flight() > 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(w.in_flight(), 0u);
  std::this_thread::sleep_for(400ms);  // past the timeout: nothing is late
  EXPECT_EQ(f.calls, 0) << f.message;
}

TEST(CollectiveWatchdog, ACollectiveThatNeverFinishesFailsAfterTheTimeout) {
  Failures f;
  CollectiveWatchdog w(options(f, 100ms));
  const auto start = std::chrono::steady_clock::now();
  w.launched(w.begin("all_reduce (sum) on the nccl group of 2 ranks (rank 0)"), [] { return false; });
  ASSERT_TRUE(f.wait_for_failure());
  EXPECT_GE(std::chrono::steady_clock::now() - start, 100ms);
  EXPECT_EQ(f.message, "all_reduce (sum) on the nccl group of 2 ranks (rank 0) did not finish within 100 ms: a peer "
                       "died, or did not call it");
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(f.calls, 1);
}

// A launch that never returns (blocked inside NCCL while connecting to a dead peer): timed from begin().
TEST(CollectiveWatchdog, ALaunchThatNeverReturnsFailsToo) {
  Failures f;
  CollectiveWatchdog w(options(f, 100ms));
  w.begin("all_gather on the nccl group of 2 ranks (rank 1)");
  ASSERT_TRUE(f.wait_for_failure());
  EXPECT_NE(f.message.find("all_gather on the nccl group of 2 ranks (rank 1) did not finish within 100 ms"),
            std::string::npos)
      << f.message;
}

// The query itself blocks (as cudaEventQuery can behind a launch stuck on a full device queue): the
// monitor, which reads only host memory, still fires on time.
TEST(CollectiveWatchdog, AQueryThatBlocksDoesNotStopTheTimeout) {
  Failures f;
  std::mutex gate;
  std::unique_lock<std::mutex> closed(gate);
  {
    CollectiveWatchdog w(options(f, 100ms));
    w.launched(w.begin("barrier on the nccl group of 2 ranks (rank 0)"), [&] {
      std::lock_guard<std::mutex> wait_here(gate);  // blocks until the test opens the gate
      return false;
    });
    ASSERT_TRUE(f.wait_for_failure());
    EXPECT_NE(f.message.find("barrier on the nccl group of 2 ranks (rank 0) did not finish"), std::string::npos)
        << f.message;
    closed.unlock();  // let the stuck poller go, so the watchdog can stop
  }
}

// Releasing a finished collective's query may block too: it holds the last reference to its CUDA event, and
// destroying an event waits for the context a thread spinning in a synchronous copy holds (the NCCL kill test
// hung so on the H200: the poller blocked releasing the first collective's event while holding the
// watchdog's lock, so the monitor never looked). The release must not stop the timeout either.
TEST(CollectiveWatchdog, AReleaseThatBlocksDoesNotStopTheTimeout) {
  Failures f;
  auto gate = std::make_shared<std::mutex>();
  std::unique_lock<std::mutex> closed(*gate);
  struct BlocksWhenReleased {
    explicit BlocksWhenReleased(std::shared_ptr<std::mutex> g) : gate(std::move(g)) {}
    ~BlocksWhenReleased() { std::lock_guard<std::mutex> wait_here(*gate); }
    std::shared_ptr<std::mutex> gate;
  };
  {
    CollectiveWatchdog w(options(f, 200ms));
    std::atomic<bool> first_done{false};
    auto held = std::make_shared<BlocksWhenReleased>(gate);
    w.launched(w.begin("all_reduce (sum) on the nccl group of 2 ranks (rank 0)"),
               [held, &first_done] { return first_done.load(); });
    held.reset();  // the query now holds the only reference: retiring it blocks
    w.launched(w.begin("all_reduce (sum) on the nccl group of 2 ranks (rank 0) #2"), [] { return false; });
    first_done = true;  // both are in flight: the first finishes (as the kill test's did), the second never
    const bool fired = f.wait_for_failure(5s);
    closed.unlock();  // let the stuck release go, so the watchdog can stop
    ASSERT_TRUE(fired) << "the monitor did not fire while a retired query's release blocked";
    EXPECT_NE(f.message.find("#2 did not finish within 200 ms"), std::string::npos) << f.message;
  }
}

TEST(CollectiveWatchdog, AnAsynchronousErrorOrAFailedQueryFails) {
  {
    Failures f;
    std::atomic<bool> broken{false};
    auto o = options(f, 60s);
    o.poll_error = [&] { return broken ? std::string("remote process exited or there was a network error") : ""; };
    CollectiveWatchdog w(o);
    w.launched(w.begin("all_reduce (avg) on the nccl group of 2 ranks (rank 0)"), [] { return false; });
    std::this_thread::sleep_for(50ms);
    EXPECT_EQ(f.calls, 0);
    broken = true;
    ASSERT_TRUE(f.wait_for_failure());
    EXPECT_EQ(f.message, "all_reduce (avg) on the nccl group of 2 ranks (rank 0) failed: remote process exited or "
                         "there was a network error");
  }
  {
    Failures f;
    CollectiveWatchdog w(options(f, 60s));
    w.launched(w.begin("reduce_scatter (avg) on the nccl group of 2 ranks (rank 0)"),
               []() -> bool { throw Error("cudaEventQuery: an illegal memory access was encountered"); });
    ASSERT_TRUE(f.wait_for_failure());
    EXPECT_NE(f.message.find("reduce_scatter (avg) on the nccl group of 2 ranks (rank 0) failed: "), std::string::npos)
        << f.message;
    EXPECT_NE(f.message.find("illegal memory access"), std::string::npos) << f.message;
  }
}

TEST(CollectiveWatchdog, ACancelledLaunchIsForgotten) {
  Failures f;
  CollectiveWatchdog w(options(f, 50ms));
  w.cancel(w.begin("broadcast on the nccl group of 2 ranks (rank 0)"));
  EXPECT_EQ(w.in_flight(), 0u);
  std::this_thread::sleep_for(150ms);
  EXPECT_EQ(f.calls, 0) << f.message;
}

TEST(CollectiveWatchdog, BadOptionsAreAnError) {
  Failures f;
  EXPECT_THROW(CollectiveWatchdog(options(f, 0ms)), Error);
  EXPECT_THROW(CollectiveWatchdog({.timeout = 1s, .tick = 5ms, .poll_error = nullptr, .on_failure = nullptr}), Error);
}

}  // namespace
}  // namespace kiln::distributed
