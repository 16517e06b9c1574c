#pragma once
// Reading back what observe::MetricsLogger wrote: a run directory's metrics.jsonl (or any file of that form,
// one JSON object a line with "step", "time" and named numbers), for plots and comparisons of finished runs
// (tools/kiln_plot draws several runs' curves into one PNG).
//
//   auto records = observe::read_metrics("runs/char_gpt");       // or ".../metrics.jsonl"
//   auto val = observe::metric_series(records, "val_loss", observe::MetricsAxis::time);
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kiln::observe {

struct MetricsRecord {
  int64_t step = 0;
  double time = 0;                       // seconds since the logger was made
  std::map<std::string, double> values;  // a null (non-finite) value is NaN
};

// Every record of `path`: a run directory (its metrics.jsonl) or a .jsonl file. An error naming the file and
// line when it is missing or a line is not such a record.
std::vector<MetricsRecord> read_metrics(const std::string& path);

enum class MetricsAxis { step, time };
// (step or time, value) of every record holding `name`, in file order.
std::vector<std::pair<double, double>> metric_series(const std::vector<MetricsRecord>& records, const std::string& name,
                                                     MetricsAxis x = MetricsAxis::step);

}  // namespace kiln::observe
