#include <kiln/core/device.h>
#include <kiln/core/error.h>

namespace kiln {

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    try {
      size_t used = 0;
      int i = std::stoi(s.substr(5), &used);
      if (used == s.size() - 5 && i >= 0) return cuda(i);
    } catch (const std::exception&) {
    }
  }
  KILN_FAIL("Device::parse: expected 'cpu', 'cuda' or 'cuda:N', got '", s, "'");
}

}  // namespace kiln
