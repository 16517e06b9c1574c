// kiln_plot: several training runs' curves of one metric in one PNG, read from what observe::MetricsLogger
// wrote (a run directory or its metrics.jsonl), against the step or the wall time; for comparisons such as
// docs/optim.md's optimizer curves.
//
//   $ kiln_plot curves.png --metric val_loss --x time --title "char_gpt" --hline 1.5 \
//       runs/adamw=AdamW runs/shampoo=Shampoo
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include <kiln/core/error.h>
#include <kiln/observe/metrics_reader.h>
#include <kiln/observe/plot.h>

using namespace kiln;

namespace {

void usage(std::ostream& os) {
  os << "usage: kiln_plot OUT.png --metric NAME [--x step|time] [--title T] [--y-label L] [--log-y] [--hline Y]\n"
        "                 RUN[=LABEL] ...\n"
        "  RUN: a run directory (its metrics.jsonl) or a metrics .jsonl file; LABEL: its legend entry (the path)\n"
        "  --x time: seconds since the run's logger was made; --hline Y: a horizontal reference line at Y (a target)\n";
}

double parse_number(const std::string& flag, const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  KILN_CHECK(end && *end == '\0' && !s.empty(), "kiln_plot: ", flag, " needs a number, got '", s, "'");
  return v;
}

int run(int argc, char** argv) {
  std::string out, metric, x_axis = "step", title, y_label;
  bool log_y = false;
  std::vector<double> hlines;
  std::vector<std::pair<std::string, std::string>> runs;  // (path, label)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      KILN_CHECK(i + 1 < argc, "kiln_plot: ", a, " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage(std::cout);
      return 0;
    } else if (a == "--metric") metric = value();
    else if (a == "--x") x_axis = value();
    else if (a == "--title") title = value();
    else if (a == "--y-label") y_label = value();
    else if (a == "--log-y") log_y = true;
    else if (a == "--hline") hlines.push_back(parse_number(a, value()));
    else if (a.rfind("--", 0) == 0) KILN_FAIL("kiln_plot: unknown option '", a, "' (--help lists them)");
    else if (out.empty()) out = a;
    else {
      const size_t eq = a.find('=');
      runs.emplace_back(a.substr(0, eq), eq == std::string::npos ? a : a.substr(eq + 1));
    }
  }
  KILN_CHECK(!out.empty() && !metric.empty() && !runs.empty(),
             "kiln_plot: needs an output PNG, --metric and at least one run (--help)");
  KILN_CHECK(x_axis == "step" || x_axis == "time", "kiln_plot: --x must be step or time, got '", x_axis, "'");
  const auto axis = x_axis == "time" ? observe::MetricsAxis::time : observe::MetricsAxis::step;
  std::vector<observe::Series> series;
  double x_min = 0, x_max = 0;
  bool any = false;
  for (const auto& [path, label] : runs) {
    observe::Series s{label, observe::metric_series(observe::read_metrics(path), metric, axis)};
    KILN_CHECK(!s.points.empty(), "kiln_plot: ", path, " has no '", metric, "' values");
    for (const auto& [x, y] : s.points) {
      x_min = any ? std::min(x_min, x) : x, x_max = any ? std::max(x_max, x) : x;
      any = true;
    }
    series.push_back(std::move(s));
  }
  for (double y : hlines) {
    char name[64];
    std::snprintf(name, sizeof(name), "%g", y);
    series.push_back({name, {{x_min, y}, {x_max, y}}});
  }
  observe::save_line_plot(out, series, {.title = title, .x_label = x_axis == "time" ? "seconds" : "step",
                                        .y_label = y_label.empty() ? metric : y_label, .log_y = log_y});
  std::printf("wrote %s (%zu runs of %s)\n", out.c_str(), runs.size(), metric.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
