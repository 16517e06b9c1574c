#!/usr/bin/env bash
# Installs what is missing, builds Kiln without CUDA and runs the whole test suite (tests labelled `gpu`
# skip themselves without a GPU); then, when nvcc is installed, checks that the CUDA backend compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=OFF
cmake --build build -j"$jobs"
(cd build && ctest -j"$jobs" --output-on-failure --timeout 600)

nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || nvcc=/usr/local/cuda/bin/nvcc
if [ -n "$nvcc" ]; then
  echo "== CUDA compile check (sm_90) with $nvcc"
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_BUILD_TESTS=OFF -DKILN_BUILD_EXAMPLES=OFF
  cmake --build build-cuda -j"$jobs"
  echo "== CUDA build compiled"
else
  echo "== nvcc not found: CUDA compile check skipped"
fi
