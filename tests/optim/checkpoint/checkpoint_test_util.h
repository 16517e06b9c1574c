#pragma once
// Shared pieces of the checkpoint tests: a small MLP with dropout, a scratch directory per test, file
// helpers.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

#include <kiln/nn/dropout.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/module.h>

namespace kiln::test {

// hidden and extra let a test build a model that does not match a saved one.
struct Mlp : nn::Module {
  nn::Linear fc1, fc2;
  nn::Dropout drop{0.3};
  explicit Mlp(int64_t hidden = 16) : fc1(4, hidden), fc2(hidden, 3) {
    register_module("fc1", fc1);
    register_module("drop", drop);
    register_module("fc2", fc2);
  }
  Tensor forward(const Tensor& x) override { return fc2(drop(nn::functional::relu(fc1(x)))); }
};

// Mlp with fc1 of another width and one more layer.
struct WiderMlp : nn::Module {
  nn::Linear fc1{4, 20}, fc2{20, 3}, fc3{3, 3};
  WiderMlp() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    register_module("fc3", fc3);
  }
  Tensor forward(const Tensor& x) override { return fc3(fc2(nn::functional::relu(fc1(x)))); }
};

// A fresh, empty directory named after the running test, removed afterwards.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            (std::string("kiln_ckpt_") + info->test_suite_name() + "_" + info->name() + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path_)) out.push_back(e.path().filename().string());
    return out;
  }

 private:
  std::filesystem::path path_;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// Detached copies of every parameter's values, to check that a failed load changed nothing.
inline std::vector<std::vector<float>> snapshot(const nn::Module& m) {
  std::vector<std::vector<float>> out;
  for (const auto& p : m.parameters()) out.push_back(p.to_vector<float>());
  return out;
}

}  // namespace kiln::test
