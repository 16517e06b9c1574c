// TensorBoard event files (observe/tensorboard.h), read back by a TFRecord + protobuf reader written here:
// every record's length and data CRCs check, the first event names the file version, the others carry the
// steps, tags and float values logged; CRC-32C against its published check value; MetricsLogger writes one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <kiln/observe/metrics_logger.h>
#include <kiln/observe/tensorboard.h>

namespace kiln::observe {
namespace {

namespace fs = std::filesystem;

struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::map<std::string, float> values;
};

struct Reader {  // the protobuf subset Event, Summary and Value use
  const std::string& b;
  size_t i = 0;
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const uint8_t c = uint8_t(b.at(i++));
      v |= uint64_t(c & 0x7F) << shift;
      if (!(c & 0x80)) return v;
    }
  }
  std::string bytes() {
    const size_t n = varint();
    std::string s = b.substr(i, n);
    i += n;
    return s;
  }
  template <class T>
  T fixed() {
    T v;
    std::memcpy(&v, b.data() + i, sizeof(T));
    i += sizeof(T);
    return v;
  }
};

Event parse_event(const std::string& bytes) {
  Event e;
  Reader r{bytes};
  while (r.i < bytes.size()) {
    const uint64_t k = r.varint();
    const int field = int(k >> 3);
    if (field == 1) e.wall_time = r.fixed<double>();
    else if (field == 2) e.step = int64_t(r.varint());
    else if (field == 3) e.file_version = r.bytes();
    else if (field == 5) {
      const std::string summary = r.bytes();
      Reader s{summary};
      while (s.i < summary.size()) {
        EXPECT_EQ(s.varint(), (1u << 3) | 2u);  // Summary.value
        const std::string value = s.bytes();
        Reader v{value};
        std::string tag;
        float x = 0;
        while (v.i < value.size()) {
          const uint64_t vk = v.varint();
          if ((vk >> 3) == 1) tag = v.bytes();
          else if ((vk >> 3) == 2) x = v.fixed<float>();
          else ADD_FAILURE() << "unexpected Value field " << (vk >> 3);
        }
        e.values[tag] = x;
      }
    } else {
      ADD_FAILURE() << "unexpected Event field " << field;
      break;
    }
  }
  return e;
}

std::vector<Event> read_events(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<Event> events;
  size_t i = 0;
  while (i < data.size()) {
    uint64_t n;
    uint32_t len_crc, data_crc;
    std::memcpy(&n, data.data() + i, 8);
    std::memcpy(&len_crc, data.data() + i + 8, 4);
    EXPECT_EQ(len_crc, TensorBoardWriter::masked_crc(data.data() + i, 8));
    const std::string bytes = data.substr(i + 12, n);
    std::memcpy(&data_crc, data.data() + i + 12 + n, 4);
    EXPECT_EQ(data_crc, TensorBoardWriter::masked_crc(bytes.data(), bytes.size()));
    events.push_back(parse_event(bytes));
    i += 12 + n + 4;
  }
  return events;
}

TEST(TensorBoard, Crc32cHasItsCheckValue) {
  EXPECT_EQ(TensorBoardWriter::crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value
}

TEST(TensorBoard, EventsReadBack) {
  const fs::path dir = fs::temp_directory_path() / ("kiln_tb_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string path;
  {
    TensorBoardWriter w(dir.string());
    path = w.path();
    w.add_scalars(10, 1000.5, {{"train_loss", 2.5}, {"lr", 1e-3}});
    w.add_scalars(20, 1001.5, {{"train_loss", 2.0}});
  }
  EXPECT_NE(fs::path(path).filename().string().find("events.out.tfevents."), std::string::npos);
  const std::vector<Event> events = read_events(path);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_EQ(events[1].step, 10);
  EXPECT_DOUBLE_EQ(events[1].wall_time, 1000.5);
  EXPECT_FLOAT_EQ(events[1].values.at("train_loss"), 2.5f);
  EXPECT_FLOAT_EQ(events[1].values.at("lr"), 1e-3f);
  EXPECT_EQ(events[2].step, 20);
  EXPECT_EQ(events[2].values.size(), 1u);
  // MetricsLogger writes one beside its JSONL and CSV, without non-finite values
  {
    MetricsLogger m((dir / "run").string());
    m.log(5, {{"loss", 1.25}, {"val", NAN}});
  }
  std::vector<fs::path> files;
  for (const auto& f : fs::directory_iterator(dir / "run"))
    if (f.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(f.path());
  ASSERT_EQ(files.size(), 1u);
  const auto logged = read_events(files[0]);
  ASSERT_EQ(logged.size(), 2u);
  EXPECT_FLOAT_EQ(logged[1].values.at("loss"), 1.25f);
  EXPECT_EQ(logged[1].values.count("val"), 0u);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln::observe
