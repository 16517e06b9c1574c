#pragma once
// GPU tests carry the ctest label `gpu` and skip where there is no CUDA device.
#include <gtest/gtest.h>

#include <kiln/cuda/runtime.h>

#define KILN_REQUIRE_GPU()                                          \
  do {                                                              \
    if (!::kiln::cuda::is_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)
