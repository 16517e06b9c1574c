#include <kiln/observe/plot.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STBI_WRITE_NO_STDIO_FILE_OPEN_WIDE
#include <stb/stb_easy_font.h>
#include <stb/stb_image_write.h>
#pragma GCC diagnostic pop

#include <kiln/core/error.h>
#include <kiln/observe/metrics_logger.h>

namespace kiln::observe {

namespace {

using Color = std::array<uint8_t, 3>;
constexpr Color kWhite{255, 255, 255}, kInk{40, 40, 40}, kGrid{225, 225, 225};
constexpr std::array<Color, 6> kPalette{{{31, 119, 180}, {255, 127, 14}, {44, 160, 44}, {214, 39, 40},
                                        {148, 103, 189}, {140, 86, 75}}};

// An RGB image with the few primitives a line plot needs.
class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), rgb_(size_t(w) * size_t(h) * 3, 255) {}
  int width() const { return w_; }
  int height() const { return h_; }
  const uint8_t* data() const { return rgb_.data(); }

  void fill(int x0, int y0, int x1, int y1, Color c) {  // [x0, x1) x [y0, y1)
    x0 = std::max(x0, 0), y0 = std::max(y0, 0), x1 = std::min(x1, w_), y1 = std::min(y1, h_);
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x) std::copy(c.begin(), c.end(), rgb_.begin() + (size_t(y) * w_ + x) * 3);
  }
  // Bresenham's line with a square brush of `thickness` pixels
  void line(int x0, int y0, int x1, int y1, Color c, int thickness = 1) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    const int lo = -(thickness - 1) / 2, hi = thickness / 2 + 1;
    while (true) {
      fill(x0 + lo, y0 + lo, x0 + hi, y0 + hi, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) err += dy, x0 += sx;
      if (e2 <= dx) err += dx, y0 += sy;
    }
  }
  // stb_easy_font's glyphs (axis-aligned quads, about 7 px high at scale 1) scaled up; `up` turns the text
  // to read bottom to top, starting at (x, y)
  void text(int x, int y, const std::string& s, Color c, int scale = 2, bool up = false) {
    std::vector<char> str(s.begin(), s.end());
    str.push_back('\0');
    std::vector<char> buffer(64 * 1024);
    const int quads = stb_easy_font_print(0, 0, str.data(), nullptr, buffer.data(), int(buffer.size()));
    const float* v = reinterpret_cast<const float*>(buffer.data());  // 4 vertices a quad, 16 bytes each
    for (int q = 0; q < quads; ++q) {
      float x_lo = 1e9f, x_hi = -1e9f, y_lo = 1e9f, y_hi = -1e9f;
      for (int k = 0; k < 4; ++k) {
        const float* p = v + (q * 4 + k) * 4;
        x_lo = std::min(x_lo, p[0]), x_hi = std::max(x_hi, p[0]), y_lo = std::min(y_lo, p[1]), y_hi = std::max(y_hi, p[1]);
      }
      if (!up) fill(x + int(x_lo * scale), y + int(y_lo * scale), x + int(x_hi * scale), y + int(y_hi * scale), c);
      else fill(x + int(y_lo * scale), y - int(x_hi * scale), x + int(y_hi * scale), y - int(x_lo * scale), c);
    }
  }
  static int text_width(const std::string& s, int scale = 2) {
    std::vector<char> str(s.begin(), s.end());
    str.push_back('\0');
    return stb_easy_font_width(str.data()) * scale;
  }

 private:
  int w_, h_;
  std::vector<uint8_t> rgb_;
};

// Round-number ticks (1, 2 or 5 times a power of ten) covering [lo, hi], about `target` of them.
std::vector<double> ticks(double lo, double hi, int target = 6) {
  const double raw = (hi - lo) / target, power = std::pow(10.0, std::floor(std::log10(raw)));
  const double unit = raw / power;
  const double step = (unit < 1.5 ? 1 : unit < 3.5 ? 2 : unit < 7.5 ? 5 : 10) * power;
  std::vector<double> out;
  for (double t = std::ceil(lo / step - 1e-9) * step; t <= hi + 1e-9 * step; t += step)
    out.push_back(std::abs(t) < 1e-12 * step ? 0.0 : t);
  return out;
}

std::string label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

}  // namespace

void save_line_plot(const std::string& path, const std::vector<Series>& series, const PlotOptions& options) {
  KILN_CHECK(options.width >= 200 && options.height >= 150, "save_line_plot: the image must be at least 200 x 150, got ",
             options.width, " x ", options.height);
  // the points to draw, in plot space (log10 of y for a log axis)
  std::vector<std::vector<std::pair<double, double>>> pts(series.size());
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo, y_lo = x_lo, y_hi = -x_lo;
  for (size_t s = 0; s < series.size(); ++s)
    for (auto [x, y] : series[s].points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      if (options.log_y) {
        KILN_CHECK(y > 0, "save_line_plot: series '", series[s].name, "' has y = ", y, " on a log axis");
        y = std::log10(y);
      }
      pts[s].emplace_back(x, y);
      x_lo = std::min(x_lo, x), x_hi = std::max(x_hi, x), y_lo = std::min(y_lo, y), y_hi = std::max(y_hi, y);
    }
  KILN_CHECK(std::isfinite(x_lo), "save_line_plot: no series has a finite point to draw (", path, ")");
  if (x_hi == x_lo) x_lo -= 1, x_hi += 1;
  if (y_hi == y_lo) y_lo -= 0.5, y_hi += 0.5;
  const double pad = 0.04 * (y_hi - y_lo);
  y_lo -= pad, y_hi += pad;

  Canvas c(options.width, options.height);
  const int left = 100, right = c.width() - 30, top = 56, bottom = c.height() - 70;
  auto px = [&](double x) { return left + int(std::lround((x - x_lo) / (x_hi - x_lo) * (right - left))); };
  auto py = [&](double y) { return bottom - int(std::lround((y - y_lo) / (y_hi - y_lo) * (bottom - top))); };
  // grid, ticks and their labels
  for (double t : ticks(x_lo, x_hi)) {
    const int x = px(t);
    c.line(x, top, x, bottom, kGrid);
    c.line(x, bottom, x, bottom + 6, kInk);
    const std::string l = label(t);
    c.text(x - Canvas::text_width(l) / 2, bottom + 12, l, kInk);
  }
  for (double t : ticks(y_lo, y_hi)) {
    const int y = py(t);
    c.line(left, y, right, y, kGrid);
    c.line(left - 6, y, left, y, kInk);
    const std::string l = label(options.log_y ? std::pow(10.0, t) : t);
    c.text(left - 12 - Canvas::text_width(l), y - 7, l, kInk);
  }
  c.line(left, top, left, bottom, kInk, 2);
  c.line(left, bottom, right, bottom, kInk, 2);
  // the series
  for (size_t s = 0; s < pts.size(); ++s) {
    const Color color = kPalette[s % kPalette.size()];
    for (size_t i = 0; i < pts[s].size(); ++i) {
      const int x = px(pts[s][i].first), y = py(pts[s][i].second);
      if (i == 0) c.fill(x - 1, y - 1, x + 2, y + 2, color);
      else c.line(px(pts[s][i - 1].first), py(pts[s][i - 1].second), x, y, color, 2);
    }
  }
  // title, axis labels, legend
  c.text((c.width() - Canvas::text_width(options.title, 3)) / 2, 12, options.title, kInk, 3);
  c.text((left + right - Canvas::text_width(options.x_label)) / 2, c.height() - 28, options.x_label, kInk);
  c.text(14, (top + bottom + Canvas::text_width(options.y_label + (options.log_y ? " (log)" : ""))) / 2,
         options.y_label + (options.log_y ? " (log)" : ""), kInk, 2, /*up=*/true);
  int widest = 0;
  for (const Series& s : series) widest = std::max(widest, Canvas::text_width(s.name));
  // the legend in the corner whose box covers the least of the curves (sampled along their segments;
  // top right, then top left, bottom right, bottom left on a tie)
  const int row = 22, box_w = widest + 56 + 2, box_h = row * int(series.size()) + 10;
  const std::array<std::pair<int, int>, 4> corners{{{right - widest - 56, top + 10},
                                                    {left + 16, top + 10},
                                                    {right - widest - 56, bottom - box_h},
                                                    {left + 16, bottom - box_h}}};
  int lx = corners[0].first, ly = corners[0].second;
  int64_t fewest = std::numeric_limits<int64_t>::max();
  for (const auto& [cx, cy] : corners) {
    int64_t covered = 0;
    auto inside = [&](int x, int y) { return x >= cx - 8 && x <= cx - 8 + box_w && y >= cy - 8 && y <= cy - 8 + box_h; };
    for (const auto& p : pts) {
      if (p.size() == 1) covered += 32 * inside(px(p[0].first), py(p[0].second));  // a lone point, as a segment
      for (size_t i = 1; i < p.size(); ++i)
        for (int k = 0; k <= 32; ++k) {
          const double t = k / 32.0;
          const int x = px(p[i - 1].first + t * (p[i].first - p[i - 1].first));
          const int y = py(p[i - 1].second + t * (p[i].second - p[i - 1].second));
          covered += inside(x, y);
        }
    }
    if (covered < fewest) fewest = covered, lx = cx, ly = cy;
  }
  c.fill(lx - 8, ly - 8, std::min(right - 6, lx - 8 + box_w), ly + row * int(series.size()) + 2, kWhite);
  for (size_t s = 0; s < series.size(); ++s) {
    const Color color = kPalette[s % kPalette.size()];
    const int y = ly + row * int(s) + 7;
    c.line(lx, y, lx + 28, y, color, 3);
    c.text(lx + 38, y - 7, series[s].name, kInk);
  }

  const std::string tmp = path + ".tmp";
  KILN_CHECK(stbi_write_png(tmp.c_str(), c.width(), c.height(), 3, c.data(), c.width() * 3) != 0,
             "save_line_plot: cannot write ", tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  KILN_CHECK(!ec, "save_line_plot: cannot rename ", tmp, " to ", path, ": ", ec.message());
}

void save_metrics_plot(const MetricsLogger& metrics, const std::vector<std::string>& names, const std::string& path,
                       const PlotOptions& options) {
  std::vector<Series> series;
  for (const std::string& name : names) {
    Series s{name, {}};
    for (auto [step, value] : metrics.series(name)) s.points.emplace_back(double(step), value);
    if (!s.points.empty()) series.push_back(std::move(s));
  }
  save_line_plot(path, series, options);
}

}  // namespace kiln::observe
