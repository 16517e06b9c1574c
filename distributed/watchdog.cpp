#include <kiln/distributed/watchdog.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <utility>

#include <kiln/core/error.h>

namespace kiln::distributed {

CollectiveWatchdog::CollectiveWatchdog(Options options) : options_(std::move(options)) {
  KILN_CHECK(options_.timeout.count() > 0 && options_.tick.count() > 0,
             "CollectiveWatchdog: the timeout and the tick must be positive");
  KILN_CHECK(options_.on_failure != nullptr, "CollectiveWatchdog: no on_failure");
  const char* debug = std::getenv("KILN_WATCHDOG_DEBUG");
  debug_ = debug && std::strcmp(debug, "0") != 0 && *debug;
  poller_ = std::thread([this] { poll(); });
  monitor_ = std::thread([this] { monitor(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  poller_.join();
  monitor_.join();
}

void CollectiveWatchdog::trace(const char* event, uint64_t ticket, const std::string& what) const {
  if (!debug_) return;
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  std::fprintf(stderr, "[watchdog %.3f] %s #%llu %s\n", t, event, (unsigned long long)ticket, what.c_str());
  std::fflush(stderr);
}

uint64_t CollectiveWatchdog::begin(std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  trace("begin", next_ticket_, what);
  entries_.push_back({next_ticket_, std::move(what), std::chrono::steady_clock::now() + options_.timeout, nullptr});
  return next_ticket_++;
}

void CollectiveWatchdog::launched(uint64_t ticket, std::function<bool()> is_done) {
  std::lock_guard<std::mutex> lock(mutex_);
  trace("launched", ticket);
  for (Entry& e : entries_)
    if (e.ticket == ticket) e.is_done = std::move(is_done);
}

void CollectiveWatchdog::cancel(uint64_t ticket) {
  std::deque<Entry> cancelled;  // released after the lock (see poll)
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->ticket == ticket) {
      cancelled.push_back(std::move(*it));
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

size_t CollectiveWatchdog::in_flight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

// Retires the oldest collectives as they finish and asks for asynchronous errors. Every query runs with
// the lock released: it may block. So does every release of a query: the last reference to a collective's
// CUDA event may be the query's, and destroying an event waits for the device's context, which a thread
// spinning in a synchronous copy holds (on the H200 the NCCL kill test hung so: the retired collective's
// event was released under this lock, and the monitor never got it).
void CollectiveWatchdog::poll() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, options_.tick);
    while (!stopping_ && error_.empty() && !entries_.empty() && entries_.front().is_done) {
      const uint64_t ticket = entries_.front().ticket;
      std::function<bool()> is_done = entries_.front().is_done;
      lock.unlock();
      bool done = false;
      std::string error;
      try {
        if (ticket != last_queried_) trace("query", ticket);  // once a collective, not every tick
        last_queried_ = ticket;
        done = is_done();
      } catch (const std::exception& e) {
        error = e.what();
      }
      is_done = nullptr;  // released unlocked
      lock.lock();
      if (!error.empty()) error_ = entries_.empty() ? error : entries_.front().what + " failed: " + error;
      if (!done) break;
      trace("retired", ticket);
      Entry retired;
      if (!entries_.empty() && entries_.front().ticket == ticket) {
        retired = std::move(entries_.front());
        entries_.pop_front();
      }
      lock.unlock();
      retired = Entry{};  // its query, and the CUDA event it may hold last, released unlocked
      lock.lock();
    }
    if (stopping_ || !error_.empty() || !options_.poll_error) continue;
    lock.unlock();
    const std::string async = options_.poll_error();
    lock.lock();
    if (!async.empty() && error_.empty())
      error_ = (entries_.empty() ? std::string("a collective") : entries_.front().what) + " failed: " + async;
  }
}

// Looks at host memory only: the poller's error, or the oldest collective's deadline.
void CollectiveWatchdog::monitor() {
  std::unique_lock<std::mutex> lock(mutex_);
  int64_t ticks = 0;
  while (!stopping_) {
    wake_.wait_for(lock, options_.tick);
    if (debug_ && ++ticks % 10 == 0 && !entries_.empty())  // a heartbeat: the oldest collective's time left
      trace("monitor: oldest", entries_.front().ticket,
            "due in " + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                           entries_.front().deadline - std::chrono::steady_clock::now()).count()) +
                " ms");
    std::string message = error_;
    if (message.empty() && !entries_.empty() && std::chrono::steady_clock::now() > entries_.front().deadline)
      message = entries_.front().what + " did not finish within " + std::to_string(options_.timeout.count()) +
                " ms: a peer died, or did not call it";
    if (message.empty()) continue;
    trace("failure", entries_.empty() ? 0 : entries_.front().ticket, message);
    lock.unlock();
    options_.on_failure(message);
    return;
  }
}

}  // namespace kiln::distributed
