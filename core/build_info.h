#pragma once
// What this build of Kiln is: its version, build type and compiler, and which backends and fast paths it
// was compiled with (what `kiln_info` prints for a bug report; the runtime side, devices and library
// versions, is cuda/runtime.h's).
#include <string>

namespace kiln {

struct BuildInfo {
  std::string version;             // the project's, "0.1.0"
  std::string build_type;          // CMAKE_BUILD_TYPE
  std::string compiler;            // "GCC 12.2.0"
  bool cuda = false;               // the CUDA backend is compiled in
  std::string cuda_architectures;  // CMAKE_CUDA_ARCHITECTURES, "90"
  bool flash_attention_sm90 = false;  // the wgmma/TMA attention kernels (used on compute capability 9.0)
};
BuildInfo build_info();

}  // namespace kiln
