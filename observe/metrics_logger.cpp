#include <kiln/observe/metrics_logger.h>

#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include <kiln/core/error.h>
#include <kiln/observe/tensorboard.h>

namespace kiln::observe {

namespace {
std::FILE* open_file(const std::filesystem::path& path, bool append, const char* header) {
  const bool existed = std::filesystem::exists(path) && std::filesystem::file_size(path) > 0;
  std::FILE* f = std::fopen(path.c_str(), append ? "a" : "w");
  KILN_CHECK(f != nullptr, "MetricsLogger: cannot open ", path.string(), " for writing");
  if (header && !(append && existed)) std::fputs(header, f);
  return f;
}
}  // namespace

MetricsLogger::MetricsLogger(std::string run_dir, const MetricsLoggerOptions& options)
    : run_dir_(std::move(run_dir)), start_(std::chrono::steady_clock::now()) {
  KILN_CHECK(!run_dir_.empty(), "MetricsLogger: the run directory is empty");
  std::error_code ec;
  std::filesystem::create_directories(run_dir_, ec);
  KILN_CHECK(!ec && std::filesystem::is_directory(run_dir_), "MetricsLogger: cannot create the run directory ",
             run_dir_, ": ", ec.message());
  const std::filesystem::path dir(run_dir_);
  if (options.jsonl) jsonl_ = open_file(dir / "metrics.jsonl", options.append, nullptr);
  if (options.csv) csv_ = open_file(dir / "metrics.csv", options.append, "step,time,name,value\n");
  if (options.tensorboard) tensorboard_ = std::make_unique<TensorBoardWriter>(run_dir_);
}

MetricsLogger::~MetricsLogger() {  // the TensorBoard writer closes its own file
  if (jsonl_) std::fclose(jsonl_);
  if (csv_) std::fclose(csv_);
}

double MetricsLogger::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void MetricsLogger::log(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  const double time = seconds();
  std::lock_guard<std::mutex> lock(mutex_);
  nlohmann::ordered_json record;
  record["step"] = step;
  record["time"] = time;
  for (const auto& [name, value] : values) {
    KILN_CHECK(!name.empty() && name != "step" && name != "time" && name.find_first_of(",\n\"") == std::string::npos,
               "MetricsLogger::log: invalid metric name '", name, "' (non-empty, not step or time, no comma, quote "
               "or newline)");
    if (std::isfinite(value)) record[name] = value;
    else record[name] = nullptr;
    if (csv_) std::fprintf(csv_, "%lld,%.6f,%s,%.9g\n", (long long)step, time, name.c_str(), value);
    auto [it, fresh] = series_.try_emplace(name);
    if (fresh) order_.push_back(name);
    it->second.emplace_back(step, value);
  }
  if (jsonl_) {
    std::fputs((record.dump() + "\n").c_str(), jsonl_);
    std::fflush(jsonl_);
  }
  if (csv_) std::fflush(csv_);
  if (tensorboard_) {
    std::vector<std::pair<std::string, double>> finite;
    for (const auto& [name, value] : values)
      if (std::isfinite(value)) finite.emplace_back(name, value);
    const double wall = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    tensorboard_->add_scalars(step, wall, finite);
  }
}

std::vector<std::pair<int64_t, double>> MetricsLogger::series(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = series_.find(name);
  return it == series_.end() ? std::vector<std::pair<int64_t, double>>{} : it->second;
}

std::vector<std::string> MetricsLogger::names() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return order_;
}

}  // namespace kiln::observe
