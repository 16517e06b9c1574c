#include <kiln/observe/tensorboard.h>

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <kiln/core/error.h>

namespace kiln::observe {

namespace {

// Protocol buffer wire format: a field key is (number << 3) | wire type; 0 varint, 1 64-bit, 2 length-
// delimited, 5 32-bit.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out.push_back(char(uint8_t(v)));
}
void key(std::string& out, int field, int wire) { varint(out, uint64_t(field) << 3 | uint64_t(wire)); }
void bytes_field(std::string& out, int field, const std::string& bytes) {
  key(out, field, 2);
  varint(out, bytes.size());
  out += bytes;
}
template <class T>
void fixed_field(std::string& out, int field, T value) {  // double (wire 1) or float (wire 5), little-endian
  key(out, field, sizeof(T) == 8 ? 1 : 5);
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  out.append(raw, sizeof(T));
}

// Event { double wall_time = 1; int64 step = 2; oneof { string file_version = 3; Summary summary = 5; } }
// Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
std::string event(double wall_time, int64_t step, const std::string* file_version,
                  const std::vector<std::pair<std::string, double>>* values) {
  std::string e;
  fixed_field(e, 1, wall_time);
  key(e, 2, 0);
  varint(e, uint64_t(step));
  if (file_version) bytes_field(e, 3, *file_version);
  if (values) {
    std::string summary;
    for (const auto& [tag, v] : *values) {
      std::string value;
      bytes_field(value, 1, tag);
      fixed_field(value, 2, float(v));
      bytes_field(summary, 1, value);
    }
    bytes_field(e, 5, summary);
  }
  return e;
}

std::array<uint32_t, 256> crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = c & 1 ? 0x82F63B78u ^ (c >> 1) : c >> 1;  // the reflected Castagnoli polynomial
    t[i] = c;
  }
  return t;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t TensorBoardWriter::crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = crc_table();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t TensorBoardWriter::masked_crc(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  KILN_CHECK(!ec && std::filesystem::is_directory(dir), "TensorBoardWriter: cannot create ", dir, ": ", ec.message());
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(int64_t(now_seconds())) + "." +
                                         host + ".kiln"))
              .string();
  file_ = std::fopen(path_.c_str(), "ab");
  KILN_CHECK(file_ != nullptr, "TensorBoardWriter: cannot open ", path_, " for writing");
  const std::string version = "brain.Event:2";
  write_record(event(now_seconds(), 0, &version, nullptr));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::write_record(const std::string& bytes) {
  char header[12];
  const uint64_t n = bytes.size();
  std::memcpy(header, &n, 8);  // little-endian hosts only (x86-64, aarch64)
  const uint32_t len_crc = masked_crc(header, 8);
  std::memcpy(header + 8, &len_crc, 4);
  const uint32_t data_crc = masked_crc(bytes.data(), bytes.size());
  std::fwrite(header, 1, 12, file_);
  std::fwrite(bytes.data(), 1, bytes.size(), file_);
  std::fwrite(&data_crc, 1, 4, file_);
  std::fflush(file_);
}

void TensorBoardWriter::add_scalars(int64_t step, double wall_time,
                                    const std::vector<std::pair<std::string, double>>& values) {
  write_record(event(wall_time, step, nullptr, &values));
}

}  // namespace kiln::observe
