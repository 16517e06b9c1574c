#include <kiln/core/error.h>

namespace kiln::detail {

void throw_error(const char* file, int line, const std::string& msg) {
  // The source location helps us; the message is written for the user and comes first.
  std::string f(file);
  auto slash = f.find_last_of('/');
  if (slash != std::string::npos) {
    auto prev = f.find_last_of('/', slash - 1);
    if (prev != std::string::npos) f = f.substr(prev + 1);
  }
  throw Error(msg + " [" + f + ":" + std::to_string(line) + "]");
}

}  // namespace kiln::detail
