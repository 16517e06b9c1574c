#!/usr/bin/env bash
# Kiln DDP's GPT-2 124M tokens/s on N GPUs under NCCL settings and bucket sizes, beside the 1-GPU figure
# of the same call (scaling efficiency): which knob closes the gap. Each variant is one gpt2_bench run
# under scripts/kilnrun; its log goes to $OUT (or .) as tune_<k>.log.
# Usage: bash scripts/ddp_tune.sh [build-dir] [N]     (STEPS=k timed steps, default 30)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
n=${2:-2}
out=${OUT:-.}
steps=${STEPS:-30}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# label | environment (VAR=value ...) | gpt2_bench flags
variants=(
  "default||"
  "NCCL_PROTO=Simple|NCCL_PROTO=Simple|"
  "NCCL_MAX_NCHANNELS=8|NCCL_MAX_NCHANNELS=8|"
  "NCCL_MAX_NCHANNELS=4|NCCL_MAX_NCHANNELS=4|"
  "Simple, 4 channels|NCCL_PROTO=Simple NCCL_MAX_NCHANNELS=4|"
  "buckets 50 MB|| --bucket-mb 50"
  "buckets 100 MB|| --bucket-mb 100"
  "buckets 12 MB|| --bucket-mb 12"
  "comm bf16, 4 channels|NCCL_MAX_NCHANNELS=4| --comm-bf16"
)
tps() { grep -o "RESULT tokens_per_second=[0-9]*" "$1" | tail -1 | cut -d= -f2; }
timeout 180 "$build/examples/gpt2_bench" --steps "$steps" --no-cuda-graph > "$out/tune_1gpu.log" 2>&1  # as DDP runs
one=$(tps "$out/tune_1gpu.log")
printf '%-28s %12s %9s\n' "GPT-2 124M, $n GPUs" "tokens/s" "scaling"
printf '%-28s %12s %9s\n' "1 GPU" "${one:-?}" ""
k=0
for v in "${variants[@]}"; do
  IFS='|' read -r label envs flags <<< "$v"
  k=$(( k + 1 ))
  # shellcheck disable=SC2086
  timeout 180 env $envs scripts/kilnrun --nproc-per-node "$n" --master-port $(( 29300 + k )) \
    "$build/examples/gpt2_bench" --steps "$steps" $flags > "$out/tune_$k.log" 2>&1
  t=$(tps "$out/tune_$k.log")
  eff=$([ -n "$t" ] && [ -n "$one" ] && python3 -c "print(f'{100*$t/($n*$one):.1f}%')")
  printf '%-28s %12s %9s\n' "$label" "${t:-failed}" "${eff:-}"
done
