#!/usr/bin/env bash
# Installs what is missing and tests Kiln. When nvcc is installed, first builds with the CUDA backend
# (sm_90), including tests, examples and benchmarks, and runs the tests labelled `gpu` (they skip
# themselves where there is no GPU and run for real on the GPU machine: scripts/gpu_check.sh). Then builds
# without CUDA (-DKILN_CUDA=OFF) and runs the whole test suite, whose summary ends the output.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
jobs=$(nproc)

nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || nvcc=/usr/local/cuda/bin/nvcc
if [ -n "$nvcc" ]; then
  echo "== CUDA build (sm_90) with $nvcc"
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_BUILD_TESTS=ON -DKILN_BUILD_EXAMPLES=ON -DKILN_BUILD_BENCH=ON
  cmake --build build-cuda -j"$jobs"
  (cd build-cuda && ctest -L gpu -j"$jobs" --output-on-failure --timeout 600)
  echo "== CUDA build compiled; gpu tests ran (skipped without a GPU)"
else
  echo "== nvcc not found: CUDA build skipped"
fi

echo "== CPU-only build and the whole test suite"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=OFF
cmake --build build -j"$jobs"
(cd build && ctest -j"$jobs" --output-on-failure --timeout 600)
