#!/usr/bin/env bash
# Data-parallel GPT-2 124M on this machine's GPUs (the issue's bar: nvidia-h200-x2, NCCL_NVLS_ENABLE=0):
# Kiln's gpt2_bench on 1 GPU and on N GPUs (scripts/kilnrun), PyTorch DDP eager and compiled on N GPUs
# (torchrun, bench/gpt2_torch.py) in the same call, and the scaling efficiencies. Needs a build with
# benchmarks and examples in $1 (default build-gpu). Usage: bash scripts/ddp_bench.sh [build-dir] [N]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
n=${2:-2}
export NCCL_NVLS_ENABLE=0
steps=${STEPS:-20}
result() { grep -o "tokens_per_second=[0-9]*" | tail -1 | cut -d= -f2; }
k1=$("$build/examples/gpt2_bench" --steps "$steps" 2>/dev/null | result)
kn=$(scripts/kilnrun --nproc-per-node "$n" "$build/examples/gpt2_bench" --steps "$steps" 2>/dev/null | result)
t1e=$(python3 bench/gpt2_torch.py --modes eager --steps "$steps" 2>/dev/null | result)
t1c=$(python3 bench/gpt2_torch.py --modes compile --steps "$steps" 2>/dev/null | result)
tne=$(torchrun --nproc-per-node "$n" bench/gpt2_torch.py --modes eager --steps "$steps" 2>/dev/null | result)
tnc=$(torchrun --nproc-per-node "$n" bench/gpt2_torch.py --modes compile --steps "$steps" 2>/dev/null | result)
python3 - "$n" "$k1" "$kn" "$t1e" "$tne" "$t1c" "$tnc" <<'PY'
import sys
n = int(sys.argv[1])
k1, kn, t1e, tne, t1c, tnc = (float(x or 0) for x in sys.argv[2:])
def eff(one, many): return f"{100 * many / (n * one):.1f}%" if one else "-"
print(f"{'':24}{'1 GPU':>12}{f'{n} GPUs':>12}{'scaling':>10}")
for name, one, many in [("kiln", k1, kn), ("torch DDP eager", t1e, tne), ("torch DDP compile", t1c, tnc)]:
    print(f"{name:24}{one:12.0f}{many:12.0f}{eff(one, many):>10}")
if tnc: print(f"kiln {n} GPUs / torch compiled DDP: {kn / tnc:.3f}x")
PY
