#pragma once
// Command-line pieces the example trainers share: a flag reader whose errors name the program and the
// flag, and the main() wrapper that prints the usage for --help and reports a kiln::Error.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <utility>

#include <kiln/core/error.h>

namespace kiln::examples {

// Walks argv flag by flag: `while (r.next()) { if (r.flag() == "--lr") lr = r.f64(); ... else r.unknown(); }`.
class ArgReader {
 public:
  ArgReader(std::string program, int argc, char** argv) : program_(std::move(program)), argc_(argc), argv_(argv) {}

  // Moves to the next flag; false when none is left.
  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    return true;
  }
  const std::string& flag() const { return flag_; }

  // The current flag's value: the next argument.
  std::string value() {
    KILN_CHECK(i_ + 1 < argc_, program_, ": ", flag_, " needs a value");
    return argv_[++i_];
  }
  // The value as a number, read in full ("12abc" is an error, not 12).
  int64_t i64() { return number([](const std::string& s, size_t* used) { return int64_t(std::stoll(s, used)); }); }
  double f64() { return number([](const std::string& s, size_t* used) { return std::stod(s, used); }); }

  // "A,B" as two integers (--sketch 1,64).
  std::pair<int64_t, int64_t> i64_pair() {
    const std::string v = value();
    const size_t comma = v.find(',');
    try {
      size_t used_a = 0, used_b = 0;
      if (comma != std::string::npos) {
        const std::string a = v.substr(0, comma), b = v.substr(comma + 1);
        const int64_t x = std::stoll(a, &used_a), y = std::stoll(b, &used_b);
        if (used_a == a.size() && used_b == b.size()) return {x, y};
      }
    } catch (const std::exception&) {
    }
    KILN_FAIL(program_, ": ", flag_, " expects two integers as A,B, got '", v, "'");
  }

  [[noreturn]] void unknown() const { KILN_FAIL(program_, ": unknown flag '", flag_, "' (--help lists them)"); }

 private:
  template <class Parse>
  auto number(Parse parse) -> decltype(parse(std::string(), nullptr)) {
    const std::string v = value();
    try {
      size_t used = 0;
      auto x = parse(v, &used);
      if (used == v.size()) return x;
    } catch (const std::exception&) {
    }
    KILN_FAIL(program_, ": ", flag_, " expects a number, got '", v, "'");
  }

  std::string program_;
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string flag_;
};

// An example's main(): parse the arguments (Args has a `help` member), print the usage for --help, else
// run; a kiln::Error is printed and exits with status 1.
template <class Args>
int example_main(int argc, char** argv, Args (*parse)(int, char**), void (*usage)(std::ostream&),
                 int (*run)(const Args&)) {
  try {
    const Args args = parse(argc, argv);
    if (args.help) {
      usage(std::cout);
      return 0;
    }
    return run(args);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace kiln::examples
