#pragma once
// Helpers shared by the archive tests: scratch directories, tensors built from raw bytes, byte comparison.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <kiln/core/archive/archive.h>
#include <kiln/core/tensor.h>

namespace kiln::archive::test {

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("kiln_archive_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
             std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A contiguous CPU tensor whose bytes are exactly `bytes` (so NaN payloads and -0 survive construction).
template <class Bits>
Tensor tensor_from_bits(const std::vector<Bits>& bytes, const Shape& shape, DType dtype) {
  Tensor t = empty(shape, {.dtype = dtype});
  EXPECT_EQ(size_t(t.numel()) * t.element_size(), bytes.size() * sizeof(Bits));
  if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size() * sizeof(Bits));
  return t;
}

// The row-major bytes of any CPU tensor, whatever its strides.
inline std::vector<unsigned char> bytes_of(const Tensor& t) {
  Tensor c = t.contiguous();
  std::vector<unsigned char> out(size_t(c.numel()) * c.element_size());
  if (!out.empty()) std::memcpy(out.data(), c.raw_data(), out.size());
  return out;
}

inline std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_file(const std::string& path, const std::vector<char>& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), std::streamsize(data.size()));
}

// Files in `dir` whose name contains ".tmp." (left-overs of an interrupted save).
inline std::vector<std::string> temp_files(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().find(".tmp.") != std::string::npos) out.push_back(e.path().string());
  return out;
}

// Runs f, expects a kiln::Error and returns its message.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected kiln::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected kiln::Error, nothing was thrown";
  return "";
}

}  // namespace kiln::archive::test
