#pragma once
// kiln::Error: every failure the user can cause is reported by throwing this, never by exit()/abort().
// The message names the op and the shapes, dtypes and devices involved.
#include <sstream>
#include <stdexcept>
#include <string>

namespace kiln {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace kiln

// KILN_CHECK(cond, "op: ", ...) throws kiln::Error with the streamed message when cond is false.
#define KILN_CHECK(cond, ...)                                                        \
  do {                                                                               \
    if (!(cond)) ::kiln::detail::throw_error(__FILE__, __LINE__, ::kiln::detail::concat(__VA_ARGS__)); \
  } while (0)
#define KILN_FAIL(...) ::kiln::detail::throw_error(__FILE__, __LINE__, ::kiln::detail::concat(__VA_ARGS__))
