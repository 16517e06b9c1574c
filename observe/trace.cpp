#include <kiln/observe/trace.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include <kiln/core/error.h>

namespace kiln::observe {

namespace {
int process_of(const profiler::Event& e) { return e.device < 0 ? 0 : 1 + e.device; }
}  // namespace

void save_chrome_trace(const profiler::Trace& trace, const std::string& path) {
  nlohmann::json events = nlohmann::json::array();
  std::set<int> processes{0};
  for (const profiler::Event& e : trace.events) {
    if (e.category == "counter") {  // a counter track (the memory timeline)
      events.push_back({{"name", e.name}, {"ph", "C"}, {"ts", double(e.start_ns) / 1e3}, {"pid", 0},
                        {"args", {{"value", e.value}}}});
      continue;
    }
    // GPU activity goes on its device's row; host events (ops on either device, ranges) on the host's
    const bool on_gpu = e.category == "kernel" || e.category == "memcpy";
    const int pid = on_gpu ? process_of(e) : 0;
    processes.insert(pid);
    nlohmann::json ev{{"name", e.name},
                      {"cat", e.category},
                      {"ph", "X"},
                      {"ts", double(e.start_ns) / 1e3},
                      {"dur", double(e.duration_ns) / 1e3},
                      {"pid", pid},
                      {"tid", e.thread}};
    if (!e.shapes.empty() || (!on_gpu && e.device >= 0)) {
      ev["args"] = nlohmann::json::object();
      if (!e.shapes.empty()) ev["args"]["shapes"] = e.shapes;
      if (!on_gpu && e.device >= 0) ev["args"]["device"] = "cuda:" + std::to_string(e.device);
    }
    events.push_back(std::move(ev));
  }
  for (int pid : processes)
    events.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", pid},
                      {"args", {{"name", pid == 0 ? std::string("host") : "cuda:" + std::to_string(pid - 1)}}}});
  const nlohmann::json doc{{"traceEvents", std::move(events)},
                           {"displayTimeUnit", "ms"},
                           {"otherData", {{"producer", "Kiln profiler"}, {"gpu_activity", trace.gpu_activity},
                                          {"gpu_note", trace.gpu_note}}}};
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    KILN_CHECK(out.good(), "save_chrome_trace: cannot write ", tmp);
    out << doc.dump() << "\n";
    KILN_CHECK(out.good(), "save_chrome_trace: writing ", tmp, " failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  KILN_CHECK(!ec, "save_chrome_trace: cannot rename ", tmp, " to ", path, ": ", ec.message());
}

std::string profile_table(const profiler::Trace& trace, int top) {
  struct Row {
    int64_t calls = 0, total = 0;
  };
  std::map<std::string, std::map<std::string, Row>> by_category;
  std::map<std::string, double> peaks;  // counters: their highest value
  for (const profiler::Event& e : trace.events) {
    if (e.category == "counter") {
      peaks[e.name] = std::max(peaks[e.name], e.value);
      continue;
    }
    if (e.category == "range" || e.category == "module") continue;
    Row& r = by_category[e.category][e.name];
    ++r.calls;
    r.total += e.duration_ns;
  }
  std::string out;
  char line[256];
  const double span = double(std::max<int64_t>(trace.duration_ns, 1));
  for (const char* category : {"op", "kernel", "memcpy"}) {
    auto it = by_category.find(category);
    if (it == by_category.end()) continue;
    std::vector<std::pair<std::string, Row>> rows(it->second.begin(), it->second.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.total > b.second.total; });
    std::snprintf(line, sizeof(line), "%-8s %-52s %8s %12s %12s %7s\n", category, "name", "calls", "total ms", "mean us",
                  "share");
    out += line;
    for (size_t i = 0; i < rows.size() && int(i) < top; ++i) {
      const auto& [name, r] = rows[i];
      std::string shown = name.size() > 52 ? name.substr(0, 49) + "..." : name;
      std::snprintf(line, sizeof(line), "%-8s %-52s %8lld %12.3f %12.2f %6.1f%%\n", "", shown.c_str(),
                    (long long)r.calls, double(r.total) / 1e6, double(r.total) / 1e3 / double(r.calls),
                    100.0 * double(r.total) / span);
      out += line;
    }
  }
  for (const auto& [name, peak] : peaks) {
    std::snprintf(line, sizeof(line), "peak %s: %.1f MiB\n", name.c_str(), peak / double(1 << 20));
    out += line;
  }
  if (!trace.gpu_activity) out += "(no GPU activity: " + trace.gpu_note + ")\n";
  return out;
}

}  // namespace kiln::observe
