#!/usr/bin/env bash
# Data-parallel scaling of GPT-2 124M (B16 a GPU, T1024, bf16) over 1, 2, 4, 8 GPUs of this machine (those
# it has), NCCL_NVLS_ENABLE=0: Kiln's gpt2_bench with DDP and with ZeRO-1 (--zero), and PyTorch's compiled
# DDP (torchrun bench/gpt2_torch.py --modes compile), each size in turn. One log a run in $OUT (or .):
# scale_<kiln|zero|torch>_<N>.log; bench/ddp_scaling_table.py turns a folder of them into the table
# (tokens/s, scaling against 1 GPU, Kiln / torch, peak memory a GPU and what ZeRO-1's sharding predicts),
# printed last. The runs of one part can come from another call on the same kind of machine: WHICH=kiln
# runs Kiln's only, WHICH=torch PyTorch's only (default: both). With several GPUs, Kiln's 2-GPU DDP run
# and its 1-GPU run also write Chrome traces of 3 steps (one_gpu_trace.json, ddp_trace.json; for
# bench/trace_diff.py).
# Usage: bash scripts/ddp_scaling.sh [build-dir] [N ...]    (STEPS=k timed steps, default 30; WARMUP=k
# untimed steps before them, default 3: a few hundred time every size at the clock an H200 holds at its
# power limit instead of the higher one of a run's first seconds, docs/performance.md)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
shift $(( $# > 0 ? 1 : 0 ))
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
sizes=("$@")
if [ ${#sizes[@]} -eq 0 ]; then
  for s in 1 2 4 8; do [ "$s" -le "$gpus" ] && sizes+=("$s"); done
fi
out=${OUT:-.}
which=${WHICH:-all}
steps=${STEPS:-30}
warmup=${WARMUP:-3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# run NAME TIMEOUT COMMAND...: its output to $out/scale_NAME.log (a run past its time leaves its log)
run() { local name=$1 limit=$2; shift 2; echo "== $name: $*" > "$out/scale_$name.log"
        timeout "$limit" "$@" >> "$out/scale_$name.log" 2>&1 || echo "== exit status $?" >> "$out/scale_$name.log"; }
port=29400
for n in "${sizes[@]}"; do
  port=$(( port + 7 ))
  launch=(scripts/kilnrun --nproc-per-node "$n" --master-port "$port")
  if [ "$which" != torch ]; then
    trace=()
    [ "$n" -eq 1 ] && [ "$gpus" -gt 1 ] && trace=(--trace "$out/one_gpu_trace.json")
    [ "$n" -eq 2 ] && trace=(--timeline --trace "$out/ddp_trace.json")
    # every size with its step captured as a CUDA graph (the default; DDP's and ZeRO-1's collectives are
    # captured with it), so the ratio measures the data parallelism
    if [ "$n" -eq 1 ]; then run "kiln_$n" 180 "$build/examples/gpt2_bench" --warmup "$warmup" --steps "$steps" "${trace[@]}"
    else
      run "kiln_$n" 180 "${launch[@]}" "$build/examples/gpt2_bench" --warmup "$warmup" --steps "$steps" "${trace[@]}"
      run "zero_$n" 180 "${launch[@]}" --master-port $(( port + 1 )) "$build/examples/gpt2_bench" --warmup "$warmup" --steps "$steps" --zero
    fi
  fi
  if [ "$which" != kiln ]; then
    if [ "$n" -eq 1 ]; then run "torch_$n" 300 python3 bench/gpt2_torch.py --modes compile --warmup "$warmup" --steps "$steps"
    else run "torch_$n" 300 torchrun --nproc-per-node "$n" --master-port $(( port + 2 )) bench/gpt2_torch.py \
      --modes compile --warmup "$warmup" --steps "$steps"
    fi
  fi
done
python3 bench/ddp_scaling_table.py "$out"
