#!/usr/bin/env bash
# Runs Kiln's kernel benchmarks and the PyTorch references on the same GPU in one call and prints the
# table (also written to $OUT/bench_table.txt). Argument: the build dir holding bench/kiln_bench.
set -uo pipefail
build=${1:-build-gpu}
out=${OUT:-gpu_check_logs}
mkdir -p "$out"
"$build/bench/kiln_bench" > "$out/bench_kiln.txt" 2>&1
python3 "$(dirname "$0")/../bench/torch_bench.py" > "$out/bench_torch.txt" 2>&1
python3 "$(dirname "$0")/../bench/make_table.py" "$out/bench_kiln.txt" "$out/bench_torch.txt" | tee "$out/bench_table.txt"
