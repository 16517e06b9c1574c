#pragma once
// The guard of a device group's collectives against hangs (the NCCL group's; torch's ProcessGroupNCCL
// watchdog): each collective is registered before its launch and retired once done; when the oldest one
// outlives the timeout, or the communicator reports an asynchronous error, on_failure runs once (the group
// prints the error, aborts its communicator and ends the process).
//
// Two threads, because a hung device can hang the calls that look at it: the poller asks each launched
// collective whether it is done (a CUDA event query) and the communicator for asynchronous errors, calls
// that can block behind a launch stuck on a full device queue; the monitor reads only host memory, so it
// fires on time while the poller is stuck (PyTorch adds a heartbeat monitor to its watchdog for the same
// reason). A launch that blocks inside the library (connecting to a dead peer) is timed too: the clock
// starts at begin(), before the launch.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace kiln::distributed {

class CollectiveWatchdog {
 public:
  struct Options {
    std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // per collective, from begin()
    std::chrono::milliseconds tick{100};                         // how often both threads look
    // The communicator's asynchronous error, "" while there is none (asked by the poller; may be empty).
    std::function<std::string()> poll_error;
    // Runs once, on the monitor thread, with "<what> did not finish within <timeout> ms: a peer died, or did
    // not call it" or "<what> failed: <error>". The NCCL group's ends the process; if it returns, the
    // watchdog looks no further.
    std::function<void(const std::string& message)> on_failure;
  };

  explicit CollectiveWatchdog(Options options);
  ~CollectiveWatchdog();  // stops both threads
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  // Before a collective's launch: from now on it is timed. `what` names it in the failure message.
  uint64_t begin(std::string what);
  // Its launch returned: from now on the poller asks `is_done` (an exception from it counts as the
  // collective's failure, with its message).
  void launched(uint64_t ticket, std::function<bool()> is_done);
  // Its launch raised an error: it is forgotten.
  void cancel(uint64_t ticket);
  size_t in_flight() const;  // begun and not yet seen done

 private:
  struct Entry {
    uint64_t ticket;
    std::string what;
    std::chrono::steady_clock::time_point deadline;
    std::function<bool()> is_done;  // empty until launched
  };
  void poll();
  void monitor();
  // KILN_WATCHDOG_DEBUG=1: each collective's begin, launch and retirement and each failure on stderr, with
  // the thread that saw it (for a hang the watchdog did not end)
  void trace(const char* event, uint64_t ticket, const std::string& what = "") const;

  Options options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Entry> entries_;  // in launch order, which is completion order on the group's one stream
  uint64_t next_ticket_ = 0;
  std::string error_;          // set by the poller: an asynchronous error or a failed query
  bool stopping_ = false;
  bool debug_ = false;
  uint64_t last_queried_ = UINT64_MAX;  // the poller's, for the trace
  std::thread poller_, monitor_;
};

}  // namespace kiln::distributed
