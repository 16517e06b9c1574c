// Device discovery for builds without the CUDA backend (KILN_CUDA=OFF): there are no CUDA devices.
#ifndef KILN_WITH_CUDA
#include <kiln/cuda/runtime.h>

namespace kiln::cuda {
int device_count() { return 0; }
bool is_available() { return false; }
}  // namespace kiln::cuda
#endif
