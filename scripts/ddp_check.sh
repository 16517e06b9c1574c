#!/usr/bin/env bash
# The multi-GPU machine's check of distributed/ (nvidia-h200-x2 or nvidia-h100-x2; NCCL_NVLS_ENABLE=0):
# builds what it needs, runs the NCCL collective tests and the NCCL kill test (ctest, label gpu), the
# all-reduce bandwidth against NCCL's own, and scripts/ddp_bench.sh (Kiln and PyTorch DDP, ZeRO-1, the
# timeline). Logs go to $OUT (or ./ddp_check_logs); a summary is printed last. Usage: bash scripts/ddp_check.sh
# The GPU machine has neither nlohmann-json nor stb: run scripts/vendor_headers.sh here first and carry
# .deps (with .data): run(command=..., carry=[".deps", ".data"]).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-ddp_check_logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
summary=()
step() {  # step NAME LOGFILE COMMAND...
  local name=$1 log=$2
  shift 2
  local t0=$(date +%s)
  if "$@" >"$out/$log" 2>&1; then summary+=("PASS  $name ($(( $(date +%s) - t0 )) s)")
  else summary+=("FAIL  $name ($(( $(date +%s) - t0 )) s, see $log)"); tail -30 "$out/$log"; fi
}
nvidia-smi -L > "$out/gpu.txt" 2>&1; nvidia-smi topo -m >> "$out/gpu.txt" 2>&1
step configure configure.log cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_BUILD_BENCH=ON -DKILN_BUILD_EXAMPLES=ON
step "build (benchmarks)" build.log cmake --build build-gpu -j32 --target gpt2_bench kiln_allreduce_bench
step "build (tests)" build_tests.log cmake --build build-gpu -j32 --target kiln_nccl_tests kiln_distributed_failure
step "NCCL tests and kill test" ctest.log bash -c "cd build-gpu && ctest -R 'distributed_(nccl|failure_nccl)' --output-on-failure --timeout 120"
step "all-reduce 256 MiB bf16" allreduce.log timeout 120 scripts/kilnrun --nproc-per-node 2 build-gpu/bench/kiln_allreduce_bench
step "ddp bench" ddp_bench.log env OUT="$out" bash scripts/ddp_bench.sh build-gpu 2
echo "==== ddp_check summary"
cat "$out/gpu.txt"
grep -E "tests passed|tests failed|Passed|Failed" "$out/ctest.log" | tail -4
grep -E "MPI" "$out/configure.log"
grep -E "BENCH|GB/s" "$out/allreduce.log"
cat "$out/ddp_bench.log"
printf '%s\n' "${summary[@]}"
! printf '%s\n' "${summary[@]}" | grep -q '^FAIL'
