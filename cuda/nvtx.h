#pragma once
// An NVTX range for the lifetime of a scope, named after the op, so profiles show which op launched
// which kernels.
#include <nvtx3/nvToolsExt.h>

namespace kiln::cuda {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace kiln::cuda
