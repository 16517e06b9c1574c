#pragma once
// A progress bar with an ETA for training loops (fashion_mnist's epochs, char_gpt's iterations,
// gpt2_bench's steps): on a terminal one line redrawn in place at most every 100 ms; into a file or pipe a
// line at each quarter and at the end, so logs stay short.
//
//   observe::ProgressBar bar("epoch 3/15", loader.size());
//   for (...) { ...; bar.update(i + 1, [&] { return "loss " + std::to_string(loss.item<double>()); }); }
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>

namespace kiln::observe {

class ProgressBar {
 public:
  // `terminal`: redraw in place (default: whether `out` is a terminal).
  ProgressBar(std::string label, int64_t total, std::FILE* out = stderr);
  ProgressBar(std::string label, int64_t total, std::FILE* out, bool terminal);

  // Records that `done` of `total` are done and draws when due. `details` (a loss, a rate) is called only
  // when a line is drawn: reading a loss may wait for the device.
  void update(int64_t done, const std::function<std::string()>& details = {});
  int64_t lines_drawn() const { return lines_; }

  // "42s", "3m05s", "1h02m"
  static std::string duration(double seconds);

 private:
  using Clock = std::chrono::steady_clock;
  std::string label_;
  int64_t total_;
  std::FILE* out_;
  bool terminal_;
  Clock::time_point start_, drawn_{};
  int64_t quarter_ = 0, lines_ = 0;
};

}  // namespace kiln::observe
