// The progress bar (observe/progress.h): into a file a line a quarter, the details asked only when a line is
// drawn, the ETA and the total time; on a terminal redrawn in place at most every 100 ms; durations.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include <kiln/core/error.h>
#include <kiln/observe/progress.h>

namespace kiln::observe {
namespace {

std::string read_all(std::FILE* f) {
  std::rewind(f);
  std::string s;
  for (int c; (c = std::fgetc(f)) != EOF;) s.push_back(char(c));
  return s;
}

TEST(ProgressBar, IntoAFileALineAQuarterAndDetailsOnlyWhenDrawn) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  std::string text;
  {
    ProgressBar bar("epoch 1/3", 100, f, /*terminal=*/false);
    int asked = 0;
    for (int i = 1; i <= 100; ++i) bar.update(i, [&] { return "loss " + std::to_string(++asked); });
    bar.update(100);  // the end is drawn once
    EXPECT_EQ(bar.lines_drawn(), 4);
    EXPECT_EQ(asked, 4);
    text = read_all(f);
  }
  std::fclose(f);  // after the bar, which holds it
  EXPECT_NE(text.find("epoch 1/3 [=======>                      ] 25/100 eta "), std::string::npos) << text;
  EXPECT_NE(text.find("100/100 in "), std::string::npos) << text;
  EXPECT_NE(text.find(" loss 4\n"), std::string::npos) << text;
  EXPECT_EQ(text.find('\r'), std::string::npos);
}

TEST(ProgressBar, OnATerminalRedrawsInPlaceAndEndsTheLine) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressBar bar("iter", 10, f, /*terminal=*/true);
    bar.update(1);
    bar.update(2);  // within 100 ms of the last: not drawn
    bar.update(10);
    const std::string text = read_all(f);
    EXPECT_EQ(bar.lines_drawn(), 2);
    EXPECT_EQ(text.substr(0, 4), "\r\033[K");
    EXPECT_EQ(text.back(), '\n');
    EXPECT_THROW(ProgressBar("x", 0, f, false), Error);
  }
  std::fclose(f);  // after the bars, which hold it
  EXPECT_EQ(ProgressBar::duration(42), "42s");
  EXPECT_EQ(ProgressBar::duration(185), "3m05s");
  EXPECT_EQ(ProgressBar::duration(3720), "1h02m");
}

}  // namespace
}  // namespace kiln::observe
