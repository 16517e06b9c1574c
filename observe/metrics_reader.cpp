#include <kiln/observe/metrics_reader.h>

#include <filesystem>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include <kiln/core/error.h>

namespace kiln::observe {

std::vector<MetricsRecord> read_metrics(const std::string& path) {
  std::filesystem::path file = path;
  if (std::filesystem::is_directory(file)) file /= "metrics.jsonl";
  std::ifstream in(file);
  KILN_CHECK(in.good(), "read_metrics: cannot open ", file.string());
  std::vector<MetricsRecord> records;
  int64_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    KILN_CHECK(j.is_object() && j.contains("step") && j["step"].is_number_integer() && j.contains("time") &&
                   j["time"].is_number(),
               "read_metrics: ", file.string(), " line ", line_no, " is not a metrics record (a JSON object with "
               "an integer \"step\" and a number \"time\"): ", line.substr(0, 120));
    MetricsRecord r;
    r.step = j["step"].get<int64_t>();
    r.time = j["time"].get<double>();
    for (const auto& [name, value] : j.items()) {
      if (name == "step" || name == "time") continue;
      if (value.is_number()) r.values[name] = value.get<double>();
      else if (value.is_null()) r.values[name] = std::numeric_limits<double>::quiet_NaN();
    }
    records.push_back(std::move(r));
  }
  return records;
}

std::vector<std::pair<double, double>> metric_series(const std::vector<MetricsRecord>& records, const std::string& name,
                                                     MetricsAxis x) {
  std::vector<std::pair<double, double>> out;
  for (const MetricsRecord& r : records)
    if (auto it = r.values.find(name); it != r.values.end())
      out.emplace_back(x == MetricsAxis::step ? double(r.step) : r.time, it->second);
  return out;
}

}  // namespace kiln::observe
