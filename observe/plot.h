#pragma once
// Line plots as PNG files (loss curves): axes with round-number ticks and their labels, a title, axis
// labels, one colored line per series and a legend. Pixels are drawn here; the PNG encoding is
// stb_image_write's and the lettering stb_easy_font's (Debian libstb-dev; docs/observability.md says why).
//
//   observe::save_line_plot("loss.png", {{"train", train_points}, {"val", val_points}},
//                           {.title = "char_gpt", .x_label = "iteration", .y_label = "loss"});
#include <string>
#include <utility>
#include <vector>

namespace kiln::observe {

class MetricsLogger;

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y); non-finite points are left out
};

struct PlotOptions {
  std::string title = "", x_label = "", y_label = "";
  int width = 960, height = 600;
  bool log_y = false;  // a log10 y axis (every plotted y must be positive)
};

// Writes the plot to `path` (atomically: a temporary file renamed). An error when no series has a point.
void save_line_plot(const std::string& path, const std::vector<Series>& series, const PlotOptions& options);

// The logger's series `names` (those that have points) against the step.
void save_metrics_plot(const MetricsLogger& metrics, const std::vector<std::string>& names, const std::string& path,
                       const PlotOptions& options);

}  // namespace kiln::observe
