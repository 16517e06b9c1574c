#!/usr/bin/env bash
# The shakespeare-char run on one GPU, Kiln beside PyTorch in the same call: builds char_gpt (in $BUILD,
# default build-gpu, examples on), trains it (5000 iterations, bf16), then bench/char_gpt_torch.py (eager;
# TORCH_COMPILE=1 adds a torch.compile run), and prints both RESULT lines. Extra arguments go to both
# programs (e.g. --iters 500). The data: --data FILE, $KILN_SHAKESPEARE, ../shared/data/tinyshakespeare.txt
# or .data/tinyshakespeare.txt. Full logs under $OUT (default char_gpt_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build-gpu}
out=${OUT:-char_gpt_logs}
mkdir -p "$out"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DKILN_BUILD_EXAMPLES=ON > "$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target char_gpt > "$out/build.log" 2>&1 || { grep -E 'error|FAILED' "$out/build.log" | head -20; exit 1; }

"$build/examples/char_gpt" --device cuda "$@" > "$out/kiln.txt" 2> "$out/kiln.err"
grep -E '^iter' "$out/kiln.txt" | tail -4; tail -2 "$out/kiln.err"
python3 bench/char_gpt_torch.py "$@" > "$out/torch.txt" 2>&1; grep -E '^iter' "$out/torch.txt" | tail -2
if [ "${TORCH_COMPILE:-0}" = 1 ]; then
  python3 bench/char_gpt_torch.py --compile "$@" > "$out/torch_compile.txt" 2>&1
fi
echo "kiln          $(grep '^RESULT' "$out/kiln.txt")"
echo "torch eager   $(grep '^RESULT' "$out/torch.txt")"
[ -f "$out/torch_compile.txt" ] && echo "torch compile $(grep '^RESULT' "$out/torch_compile.txt")"
exit 0
