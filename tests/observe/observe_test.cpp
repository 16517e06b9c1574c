// The user's desk (observe/): the metrics logger's JSONL and CSV read back (nlohmann-json), its in-memory
// series, appending on resume; line plots read back as PNG (stb_image): their size, a white background,
// each series' color where its points are, a rising series drawn rising, lettering in the title band, and
// bad input as errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#define STB_IMAGE_IMPLEMENTATION
#include <stb/stb_image.h>
#pragma GCC diagnostic pop

#include <kiln/core/error.h>
#include <kiln/observe/metrics_logger.h>
#include <kiln/observe/metrics_reader.h>
#include <kiln/observe/plot.h>

namespace kiln::observe {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("kiln_observe_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::vector<std::string> lines(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

TEST(MetricsLogger, WritesJsonlAndLongCsvAndKeepsTheSeries) {
  TempDir dir;
  const fs::path run = dir.path / "runs" / "a";
  {
    MetricsLogger m(run.string());
    m.log(10, {{"train_loss", 2.5}, {"lr", 1e-3}});
    m.log(20, {{"train_loss", 2.0}, {"val_loss", NAN}});
    EXPECT_EQ(m.names(), (std::vector<std::string>{"train_loss", "lr", "val_loss"}));
    const auto s = m.series("train_loss");
    ASSERT_EQ(s.size(), 2u);
    EXPECT_EQ(s[1], (std::pair<int64_t, double>{20, 2.0}));
    EXPECT_TRUE(m.series("nothing").empty());
  }
  const auto jl = lines(run / "metrics.jsonl");
  ASSERT_EQ(jl.size(), 2u);
  const auto first = nlohmann::json::parse(jl[0]), second = nlohmann::json::parse(jl[1]);
  EXPECT_EQ(first["step"], 10);
  EXPECT_DOUBLE_EQ(first["lr"].get<double>(), 1e-3);
  EXPECT_TRUE(first["time"].get<double>() >= 0);
  EXPECT_TRUE(second["val_loss"].is_null());  // NaN is not JSON
  const auto csv = lines(run / "metrics.csv");
  ASSERT_EQ(csv.size(), 5u);
  EXPECT_EQ(csv[0], "step,time,name,value");
  EXPECT_EQ(csv[1].substr(0, 3), "10,");
  EXPECT_NE(csv[1].find(",train_loss,2.5"), std::string::npos) << csv[1];
  // a resumed run appends, without a second header
  {
    MetricsLogger m(run.string(), {.append = true});
    m.log(30, {{"train_loss", 1.5}});
  }
  EXPECT_EQ(lines(run / "metrics.jsonl").size(), 3u);
  const auto csv2 = lines(run / "metrics.csv");
  ASSERT_EQ(csv2.size(), 6u);
  EXPECT_EQ(csv2[0], "step,time,name,value");
  EXPECT_NE(csv2[5].find("30,"), std::string::npos);
}

TEST(MetricsLogger, BadNamesAndDirectoriesAreErrors) {
  TempDir dir;
  MetricsLogger m((dir.path / "r").string());
  EXPECT_THROW(m.log(1, {{"a,b", 1.0}}), Error);
  EXPECT_THROW(m.log(1, {{"step", 1.0}}), Error);
  EXPECT_THROW(MetricsLogger(""), Error);
  std::ofstream((dir.path / "file").string()) << "x";
  EXPECT_THROW(MetricsLogger((dir.path / "file" / "sub").string()), Error);
}

struct Image {
  int w = 0, h = 0;
  std::vector<unsigned char> rgb;
  explicit Image(const fs::path& p) {
    int n = 0;
    unsigned char* data = stbi_load(p.c_str(), &w, &h, &n, 3);
    if (data) rgb.assign(data, data + size_t(w) * h * 3), stbi_image_free(data);
  }
  bool is(int x, int y, int r, int g, int b) const {
    const unsigned char* p = &rgb[(size_t(y) * w + x) * 3];
    return p[0] == r && p[1] == g && p[2] == b;
  }
};

// What the logger wrote reads back record by record (a non-finite value as NaN); a line that is not a record
// is an error naming the file and the line.
TEST(MetricsReader, ReadsWhatTheLoggerWrote) {
  TempDir dir;
  {
    observe::MetricsLogger m(dir.path.string(), {.tensorboard = false});
    m.log(10, {{"loss", 2.5}, {"lr", 1e-3}});
    m.log(20, {{"loss", NAN}});
  }
  auto records = observe::read_metrics(dir.path.string());
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].step, 10);
  EXPECT_DOUBLE_EQ(records[0].values.at("lr"), 1e-3);
  EXPECT_TRUE(std::isnan(records[1].values.at("loss")));
  EXPECT_GE(records[1].time, records[0].time);
  auto loss = observe::metric_series(records, "loss");
  ASSERT_EQ(loss.size(), 2u);
  EXPECT_EQ(loss[0], std::make_pair(10.0, 2.5));
  EXPECT_TRUE(observe::metric_series(records, "lr", observe::MetricsAxis::time).size() == 1);
  {
    std::ofstream f(dir.path / "metrics.jsonl", std::ios::app);
    f << "{\"loss\": 1}\n";
  }
  try {
    observe::read_metrics((dir.path / "metrics.jsonl").string());
    FAIL() << "a record without step was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(observe::read_metrics((dir.path / "absent").string()), Error);
}

TEST(LinePlot, WritesAReadablePng) {
  TempDir dir;
  const fs::path png = dir.path / "loss.png";
  Series rising{"rising", {}}, falling{"falling", {}};
  for (int i = 0; i <= 100; ++i) {
    rising.points.emplace_back(i, 0.5 + 0.02 * i);
    falling.points.emplace_back(i, 2.5 - 0.015 * i);
  }
  save_line_plot(png.string(), {rising, falling}, {.title = "Loss", .x_label = "iteration", .y_label = "loss"});
  const Image img(png);
  ASSERT_EQ(img.w, 960);
  ASSERT_EQ(img.h, 600);
  EXPECT_FALSE(fs::exists(png.string() + ".tmp"));
  int white = 0, blue = 0, orange = 0, title_ink = 0;
  double blue_left_y = 0, blue_right_y = 0;
  int blue_left = 0, blue_right = 0;
  for (int y = 0; y < img.h; ++y)
    for (int x = 0; x < img.w; ++x) {
      white += img.is(x, y, 255, 255, 255);
      if (img.is(x, y, 31, 119, 180)) {
        ++blue;
        if (x < 300) blue_left_y += y, ++blue_left;
        if (x > 700) blue_right_y += y, ++blue_right;
      }
      orange += img.is(x, y, 255, 127, 14);
      title_ink += y < 40 && img.is(x, y, 40, 40, 40);
    }
  EXPECT_GT(white, img.w * img.h / 2);  // a white page
  EXPECT_GT(blue, 800);                 // both lines drawn (2 px wide, ~850 px long), and the legend's samples
  EXPECT_GT(orange, 800);
  EXPECT_GT(title_ink, 50);             // "Loss", lettered in the title band
  ASSERT_GT(blue_left, 0);
  ASSERT_GT(blue_right, 0);
  EXPECT_LT(blue_right_y / blue_right, blue_left_y / blue_left);  // rising: higher (smaller y) on the right
}

TEST(LinePlot, LogAxisMetricsPlotAndBadInput) {
  TempDir dir;
  Series s{"loss", {{1, 10.0}, {2, 1.0}, {3, 0.1}}};
  save_line_plot((dir.path / "log.png").string(), {s}, {.title = "t", .log_y = true});
  EXPECT_EQ(Image(dir.path / "log.png").w, 960);
  EXPECT_THROW(save_line_plot((dir.path / "bad.png").string(), {Series{"neg", {{1, -1.0}}}}, {.log_y = true}), Error);
  EXPECT_THROW(save_line_plot((dir.path / "empty.png").string(), {Series{"nan", {{1, NAN}}}}, {}), Error);
  EXPECT_THROW(save_line_plot((dir.path / "small.png").string(), {s}, {.width = 10}), Error);
  MetricsLogger m((dir.path / "run").string());
  for (int i = 0; i < 5; ++i) m.log(i, {{"train_loss", 3.0 - i}});
  save_metrics_plot(m, {"train_loss", "val_loss"}, (dir.path / "run" / "loss.png").string(), {.title = "run"});
  EXPECT_EQ(Image(dir.path / "run" / "loss.png").h, 600);
}

}  // namespace
}  // namespace kiln::observe
