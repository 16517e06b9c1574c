#!/usr/bin/env bash
# Installs what is missing, builds Kiln and trains the sequence classifier (Fashion-MNIST images as
# sequences of rows) on the CPU (flags go to the trainer: --device cuda --amp bf16 on a GPU build; --data DIR
# for another copy of the idx files).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=OFF
cmake --build build -j"$(nproc)" --target seq_classifier
./build/examples/seq_classifier "$@"
