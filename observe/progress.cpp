#include <kiln/observe/progress.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include <kiln/core/error.h>

namespace kiln::observe {

ProgressBar::ProgressBar(std::string label, int64_t total, std::FILE* out)
    : ProgressBar(std::move(label), total, out, out != nullptr && ::isatty(::fileno(out)) != 0) {}

ProgressBar::ProgressBar(std::string label, int64_t total, std::FILE* out, bool terminal)
    : label_(std::move(label)), total_(total), out_(out), terminal_(terminal), start_(Clock::now()) {
  KILN_CHECK(total >= 1, "ProgressBar: the total must be at least 1, got ", total);
  KILN_CHECK(out != nullptr, "ProgressBar: no output stream");
}

std::string ProgressBar::duration(double seconds) {
  const int64_t s = std::max<int64_t>(0, std::llround(seconds));
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof(buf), "%llds", (long long)s);
  else if (s < 3600) std::snprintf(buf, sizeof(buf), "%lldm%02llds", (long long)(s / 60), (long long)(s % 60));
  else std::snprintf(buf, sizeof(buf), "%lldh%02lldm", (long long)(s / 3600), (long long)(s % 3600 / 60));
  return buf;
}

void ProgressBar::update(int64_t done, const std::function<std::string()>& details) {
  done = std::clamp<int64_t>(done, 0, total_);
  const auto now = Clock::now();
  const bool last = done == total_;
  if (terminal_) {
    if (!last && now - drawn_ < std::chrono::milliseconds(100)) return;
  } else {
    const int64_t quarter = done * 4 / total_;
    if (!last && quarter == quarter_) return;
    if (last && quarter_ == 4) return;  // the end was drawn already
    quarter_ = quarter;
  }
  drawn_ = now;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = done > 0 ? elapsed * double(total_ - done) / double(done) : 0.0;
  constexpr int kWidth = 30;
  const int filled = int(kWidth * done / total_);
  std::string bar(size_t(filled), '=');
  if (filled < kWidth) bar += '>' + std::string(size_t(kWidth - filled - 1), ' ');
  const std::string extra = details ? details() : std::string();
  std::fprintf(out_, "%s%s [%s] %lld/%lld %s%s%s%s", terminal_ ? "\r\033[K" : "", label_.c_str(), bar.c_str(),
               (long long)done, (long long)total_, last ? ("in " + duration(elapsed)).c_str() : ("eta " + duration(eta)).c_str(),
               extra.empty() ? "" : " ", extra.c_str(), terminal_ && !last ? "" : "\n");
  std::fflush(out_);
  ++lines_;
}

}  // namespace kiln::observe
