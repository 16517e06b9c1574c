#!/usr/bin/env bash
# Installs what is missing, builds Kiln and trains the Fashion-MNIST MLP (pass --model cnn for the CNN;
# any other flags go to the trainer).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=OFF
cmake --build build -j"$(nproc)" --target fashion_mnist
./build/examples/fashion_mnist --data /usr/share/datasets/fashion-mnist "$@"
