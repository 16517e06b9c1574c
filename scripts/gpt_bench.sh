#!/usr/bin/env bash
# GPT-2 124M training throughput on one GPU, Kiln beside PyTorch in the same call: builds gpt2_bench (in
# $BUILD, default build-gpu, examples on), runs it without and with --grad-checkpoint, then
# bench/gpt2_torch.py (eager and torch.compile), and prints a table of tokens/s, MFU, peak memory and step
# time. Extra arguments go to both programs (e.g. --batch-size 8 --steps 5). Full logs under $OUT (default
# gpt_bench_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build-gpu}
out=${OUT:-gpt_bench_logs}
mkdir -p "$out"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DKILN_BUILD_EXAMPLES=ON > "$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target gpt2_bench > "$out/build.log" 2>&1 || { grep -E 'error|FAILED' "$out/build.log" | head -20; exit 1; }

"$build/examples/gpt2_bench" "$@" > "$out/kiln.txt" 2> "$out/kiln.err"; tail -3 "$out/kiln.err"
"$build/examples/gpt2_bench" --grad-checkpoint "$@" > "$out/kiln_ckpt.txt" 2> "$out/kiln_ckpt.err"; tail -3 "$out/kiln_ckpt.err"
python3 bench/gpt2_torch.py "$@" > "$out/torch.txt" 2>&1; grep -v '^RESULT' "$out/torch.txt" | tail -5

field() { sed -n "s/.*$1=\([^ ]*\).*/\1/p" | head -1; }
row() {  # name, a RESULT line
  printf '%-26s %12s %8s %9s %9s\n' "$1" "$(echo "$2" | field tokens_per_second)" "$(echo "$2" | field mfu)" \
    "$(echo "$2" | field peak_gib)" "$(echo "$2" | field step_ms)"
}
{
  printf '%-26s %12s %8s %9s %9s\n' "GPT-2 124M" "tokens/s" "MFU" "peak GiB" "step ms"
  row "kiln" "$(grep '^RESULT' "$out/kiln.txt")"
  row "kiln --grad-checkpoint" "$(grep '^RESULT' "$out/kiln_ckpt.txt")"
  row "torch eager" "$(grep '^RESULT eager' "$out/torch.txt")"
  row "torch compile" "$(grep '^RESULT compile' "$out/torch.txt")"
} | tee "$out/table.txt"
