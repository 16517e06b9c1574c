#!/usr/bin/env bash
# The multi-GPU machine's check of distributed/ (nvidia-h200-x2/x4/x8 or the H100 kinds; NCCL_NVLS_ENABLE=0),
# on all N GPUs it has: builds what it needs, runs the NCCL collective tests and the NCCL kill test on 2
# ranks (ctest, label gpu) and the kill test on N ranks, the all-reduce bus bandwidth of 1 MiB .. 1 GiB
# against NCCL's own on 2 and on N GPUs, a checkpoint saved on N ranks resumed on N, N/2, ..., 1
# (tests/distributed/resume/run.sh: the same losses), and scripts/ddp_scaling.sh (GPT-2 124M tokens/s on 1,
# 2, 4, ... N GPUs, Kiln DDP and ZeRO-1 and PyTorch compiled DDP; WHICH=kiln|torch picks one side, SCALING=0
# none). The bf16-on-the-wire and SM carve-out rows of 2 GPUs are scripts/ddp_bench.sh's. Logs go to $OUT
# (or ./ddp_check_logs); a summary is printed last. Usage: bash scripts/ddp_check.sh
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
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
sizes="1 4 16 64 256 1024"  # MiB
nvidia-smi -L > "$out/gpu.txt" 2>&1; nvidia-smi topo -m >> "$out/gpu.txt" 2>&1
step configure configure.log cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_BUILD_BENCH=ON -DKILN_BUILD_EXAMPLES=ON
step "build (benchmarks)" build.log cmake --build build-gpu -j"$(nproc)" --target gpt2_bench char_gpt kiln_allreduce_bench
step "build (tests)" build_tests.log cmake --build build-gpu -j"$(nproc)" --target kiln_nccl_tests kiln_distributed_failure
step "NCCL tests and kill test (2 ranks)" ctest.log bash -c "cd build-gpu && ctest -R 'distributed_(nccl|failure_nccl)' --output-on-failure --timeout 120"
[ "$n" -gt 2 ] && step "NCCL kill test ($n ranks)" kill_$n.log bash tests/distributed/failure/nccl_run.sh \
  build-gpu/tests/kiln_distributed_failure "$n"
for g in $(printf '%s\n' 2 "$n" | sort -un); do
  step "all-reduce bf16 $g GPUs" "allreduce_$g.log" timeout 180 scripts/kilnrun --nproc-per-node "$g" \
    build-gpu/bench/kiln_allreduce_bench $sizes
done
step "resume on $n..1 GPUs" resume.log env OUT="$out" bash tests/distributed/resume/run.sh kilnrun \
  build-gpu/examples/char_gpt "$n" 1e-4 -- --device cuda --amp none
[ "${SCALING:-1}" != 0 ] && step "scaling (${WHICH:-all})" scaling.log env OUT="$out" bash scripts/ddp_scaling.sh build-gpu
echo "==== ddp_check summary"
cat "$out/gpu.txt"
grep -E "tests passed|tests failed|Passed|Failed" "$out/ctest.log" | tail -4
grep -E "MPI" "$out/configure.log"
[ -f "$out/kill_$n.log" ] && grep -E "^rank|kilnrun:|PASS|FAIL" "$out/kill_$n.log"
for g in $(printf '%s\n' 2 "$n" | sort -un); do sed -n 's/^\[rank 0\] //p' "$out/allreduce_$g.log" | grep "^# " | grep -v "^# allreduce "; done
cat "$out/resume.log"
[ -f "$out/scaling.log" ] && tail -12 "$out/scaling.log"
printf '%s\n' "${summary[@]}"
! printf '%s\n' "${summary[@]}" | grep -q '^FAIL'
