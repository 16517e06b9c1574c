#pragma once
// CUDA device discovery. Safe to call in any build: without the CUDA backend it reports no devices.
namespace kiln::cuda {

bool is_available();
int device_count();

}  // namespace kiln::cuda
