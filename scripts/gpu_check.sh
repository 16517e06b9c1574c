#!/usr/bin/env bash
# The GPU machine's check: build with CUDA (sm_90), run every test including the `gpu` label, run the GPU
# tests under compute-sanitizer memcheck, run the benchmarks with their PyTorch references, and print a
# short summary last. Full logs go to $OUT (or ./gpu_check_logs). Usage: bash scripts/gpu_check.sh [--no-bench]
# (LABEL=gpu: only the ctest label gpu, the CPU tests being CI's)
# The GPU machine has neither nlohmann-json nor stb: run scripts/vendor_headers.sh here first and carry
# .deps (with .data): run(command=..., carry=[".deps", ".data"]).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check_logs}
mkdir -p "$out"
bench=1
[ "${1:-}" = "--no-bench" ] && bench=0
summary=()
step() {  # step NAME LOGFILE COMMAND...: runs, records pass/fail
  local name=$1 log=$2
  shift 2
  local t0=$(date +%s)
  if "$@" >"$out/$log" 2>&1; then summary+=("PASS  $name ($(( $(date +%s) - t0 )) s)")
  else summary+=("FAIL  $name ($(( $(date +%s) - t0 )) s, see $log)"); tail -40 "$out/$log"; fi
}

# Data the GPU machine lacks travels in the ignored .data/ folder (carry it).
[ -d .data/fashion-mnist ] && export KILN_FASHION_MNIST_DIR=$PWD/.data/fashion-mnist
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
step configure configure.log cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_BUILD_BENCH=ON -DKILN_BUILD_TESTS=ON -DKILN_PROFILER=ON
step build build.log cmake --build build-gpu -j16
step "ctest (${LABEL:-all labels})" ctest.log bash -c "cd build-gpu && ctest -j8 ${LABEL:+-L $LABEL} --output-on-failure --timeout 900"
if [ -x build-gpu/tests/kiln_cuda_tests ]; then
  # The leak checks once more, to keep their figures (ctest shows only failing tests' output).
  step "memory flat over 100 iterations" memory_flat.log build-gpu/tests/kiln_cuda_tests --gtest_filter=CudaMemoryFlat.*
  # The out-of-memory test provokes a failing cudaMalloc on purpose, which memcheck reports as an API error;
  # the memory-flat loops (300 training-sized iterations) check allocator counts, which memcheck cannot add to.
  # Six gtest shards side by side (one GPU, ~2 minutes on an H100 for ~160 tests; one process after another
  # ran past a session's device time); memcheck.log holds each shard's log in turn.
  memcheck_shards() {
    local n=6 i rc=0
    for i in $(seq 0 $((n - 1))); do
      GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i compute-sanitizer --tool memcheck --error-exitcode 1 \
        build-gpu/tests/kiln_cuda_tests --gtest_filter=-*OutOfMemory*:CudaMemoryFlat.* > "$out/memcheck_$i.log" 2>&1 &
    done
    for i in $(seq 0 $((n - 1))); do wait -n || rc=1; done
    for i in $(seq 0 $((n - 1))); do echo "== shard $i"; cat "$out/memcheck_$i.log"; rm -f "$out/memcheck_$i.log"; done
    return $rc
  }
  step "compute-sanitizer memcheck" memcheck.log memcheck_shards
fi
if [ $bench = 1 ] && [ -x scripts/run_benchmarks.sh ]; then
  step benchmarks bench.log bash scripts/run_benchmarks.sh build-gpu
fi

echo "==== gpu_check summary ($(cat "$out/gpu.txt"))"
grep -E "tests passed|tests failed" "$out/ctest.log" | tail -1
grep -E "ERROR SUMMARY" "$out/memcheck.log" 2>/dev/null | sort | uniq -c
grep -E "allocated .* MiB over" "$out/memory_flat.log" 2>/dev/null
[ -f "$out/bench_table.txt" ] && cat "$out/bench_table.txt"
# the attention rows the transformer issue's bar names (the whole table: bench_attention_table.txt)
[ -f "$out/bench_attention_table.txt" ] && grep -E "d128_n4096|d64_n1024_causal" "$out/bench_attention_table.txt"
printf '%s\n' "${summary[@]}"
! printf '%s\n' "${summary[@]}" | grep -q '^FAIL'
