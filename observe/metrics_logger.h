#pragma once
// A training run's metrics on disk, as PyTorch users keep them (TensorBoard's scalars, a CSV): one record per
// log() call, the step, the seconds since the logger was made and named values (loss, lr, tokens/s, grad
// norm, loss scale, memory, ...), appended to the run directory's metrics.jsonl (one JSON object a line) and
// metrics.csv (long form: step,time,name,value, so that a value first logged late needs no new column), and
// kept in memory for plotting (observe/plot.h); with tensorboard (default) also as a TensorBoard event file
// (observe/tensorboard.h), so that `tensorboard --logdir runs` plots them.
//
//   observe::MetricsLogger metrics("runs/char_gpt");
//   metrics.log(iter, {{"train_loss", loss}, {"lr", lr}});
//   observe::save_metrics_plot(metrics, {"train_loss", "val_loss"}, "runs/char_gpt/loss.png", {...});
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace kiln::observe {

class TensorBoardWriter;

struct MetricsLoggerOptions {
  bool jsonl = true;
  bool csv = true;
  bool tensorboard = true;
  bool append = false;  // keep what the files hold (a resumed run) instead of starting them anew
};

class MetricsLogger {
 public:
  // Creates run_dir (and its parents) and opens its metrics files.
  explicit MetricsLogger(std::string run_dir, const MetricsLoggerOptions& options = {});
  ~MetricsLogger();
  MetricsLogger(const MetricsLogger&) = delete;
  MetricsLogger& operator=(const MetricsLogger&) = delete;

  // One record; each line is flushed, so a run that dies keeps what it logged. Non-finite values are
  // written as null (JSON) / nan (CSV).
  void log(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // Every value logged under `name` in this process, as (step, value).
  std::vector<std::pair<int64_t, double>> series(const std::string& name) const;
  std::vector<std::string> names() const;  // in the order first logged
  const std::string& run_dir() const { return run_dir_; }
  double seconds() const;                  // since construction

 private:
  std::string run_dir_;
  std::FILE* jsonl_ = nullptr;
  std::FILE* csv_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::chrono::steady_clock::time_point start_;
  mutable std::mutex mutex_;
  std::map<std::string, std::vector<std::pair<int64_t, double>>> series_;
  std::vector<std::string> order_;
};

}  // namespace kiln::observe
