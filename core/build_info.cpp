#include <kiln/core/build_info.h>

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif
#ifndef KILN_BUILD_TYPE
#define KILN_BUILD_TYPE ""
#endif
#ifndef KILN_CUDA_ARCHITECTURES
#define KILN_CUDA_ARCHITECTURES ""
#endif

namespace kiln {

BuildInfo build_info() {
  BuildInfo b;
  b.version = KILN_VERSION;
  b.build_type = KILN_BUILD_TYPE;
#if defined(__clang__)
  b.compiler = "Clang " __clang_version__;
#elif defined(__GNUC__)
  b.compiler = "GCC " + std::to_string(__GNUC__) + "." + std::to_string(__GNUC_MINOR__) + "." +
               std::to_string(__GNUC_PATCHLEVEL__);
#endif
#ifdef KILN_WITH_CUDA
  b.cuda = true;
  b.cuda_architectures = KILN_CUDA_ARCHITECTURES;
#endif
#ifdef KILN_WITH_SM90A
  b.flash_attention_sm90 = true;
#endif
  return b;
}

}  // namespace kiln
