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
# Attention: the fused flash-attention kernels beside PyTorch's scaled_dot_product_attention.
"$build/bench/kiln_attention_bench" > "$out/bench_attention_kiln.txt" 2>&1
python3 "$(dirname "$0")/../bench/attention_torch.py" > "$out/bench_attention_torch.txt" 2>&1
python3 "$(dirname "$0")/../bench/make_table.py" "$out/bench_attention_kiln.txt" "$out/bench_attention_torch.txt" | tee "$out/bench_attention_table.txt"
grep -h '^#' "$out/bench_attention_kiln.txt" | sed 's/^#/kiln /'
grep -h '^#' "$out/bench_attention_torch.txt" | sed 's/^#/torch/'
# Sketched layers: SKLinear and Kiln's dense linear beside PyTorch's batched-matmul form and F.linear.
"$build/bench/kiln_sketched_bench" > "$out/bench_sketched_kiln.txt" 2>&1
python3 "$(dirname "$0")/../bench/sketched_torch.py" > "$out/bench_sketched_torch.txt" 2>&1
python3 "$(dirname "$0")/../bench/make_table.py" "$out/bench_sketched_kiln.txt" "$out/bench_sketched_torch.txt" | tee "$out/bench_sketched_table.txt"
# Random-feature attention against flash attention (causal, long sequences; time and peak memory).
"$build/bench/kiln_performer_bench" > "$out/bench_performer.txt" 2>&1
grep -h '^#' "$out/bench_performer.txt"
# Shampoo's root job for GPT-2 124M's blocks, beside PyTorch's eigh of the same matrices.
"$build/bench/kiln_shampoo_bench" > "$out/bench_shampoo_kiln.txt" 2>&1
python3 "$(dirname "$0")/../bench/shampoo_torch.py" > "$out/bench_shampoo_torch.txt" 2>&1
grep -h '^#' "$out/bench_shampoo_kiln.txt" | sed 's/^#/kiln /'
grep -h '^#' "$out/bench_shampoo_torch.txt" | sed 's/^#/torch/'
# FP8 GEMM (scaled_mm, cuBLASLt) against bf16, beside torch._scaled_mm; FP8 TFLOP/s against 1979.
"$build/bench/kiln_fp8_bench" > "$out/bench_fp8_kiln.txt" 2>&1
python3 "$(dirname "$0")/../bench/fp8_torch.py" > "$out/bench_fp8_torch.txt" 2>&1
python3 "$(dirname "$0")/../bench/make_table.py" "$out/bench_fp8_kiln.txt" "$out/bench_fp8_torch.txt" | tee "$out/bench_fp8_table.txt"
grep -h '^#' "$out/bench_fp8_kiln.txt" | sed 's/^#/kiln /'
grep -h '^#' "$out/bench_fp8_torch.txt" | sed 's/^#/torch/'

