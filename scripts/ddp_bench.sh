#!/usr/bin/env bash
# Data-parallel GPT-2 124M on this machine's GPUs (the issue's bar: 2 GPUs, NCCL_NVLS_ENABLE=0): Kiln's
# gpt2_bench on 1 GPU, on N GPUs with DDP (scripts/kilnrun) and with ZeRO-1 (--zero), then PyTorch DDP
# compiled and eager on N GPUs and on 1 (torchrun, bench/gpt2_torch.py) in the same call; prints tokens/s,
# peak memory per GPU, the scaling efficiencies, and the DDP timeline of one step (all-reduces against
# backward; rank 0's Chrome trace of 3 steps in ddp_trace.json). Needs a build with examples in $1 (default
# build-gpu). Raw outputs go to $OUT (or .).
# Usage: bash scripts/ddp_bench.sh [build-dir] [N]   (STEPS=k timed steps, default 30; QUICK=1: only the
# bar's rows, Kiln's DDP variants against PyTorch's compiled DDP, no ZeRO-1, eager, bf16 or tuning rows)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
n=${2:-2}
out=${OUT:-.}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
steps=${STEPS:-30}
field() { grep -o "$1=[0-9.]*" | tail -1 | cut -d= -f2; }
# run NAME TIMEOUT COMMAND...: its output to $out/ddp_NAME.log
run() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" > "$out/ddp_$name.log" 2>&1; }
# the 1-GPU baseline with its step as one CUDA graph, as the DDP steps run (their collectives captured too)
run kiln_1 120 "$build/examples/gpt2_bench" --steps "$steps" --trace "$out/one_gpu_trace.json"
run kiln_n 120 scripts/kilnrun --nproc-per-node "$n" "$build/examples/gpt2_bench" --steps "$steps" --timeline \
  --trace "$out/ddp_trace.json"  # rank 0's kernels and NCCL's beside them (CUPTI), for where the time goes
quick=${QUICK:-0}
[ "$quick" = 1 ] || run kiln_zero 120 scripts/kilnrun --nproc-per-node "$n" "$build/examples/gpt2_bench" --steps "$steps" --zero
# AdamW of the other buckets beside the last bucket's all-reduce (DistributedDataParallelOptions::overlap_optimizer_step)
run kiln_n_overlap 120 scripts/kilnrun --nproc-per-node "$n" "$build/examples/gpt2_bench" --steps "$steps" --overlap-step
# AdamW inside backward, each bucket's after its all-reduce (DistributedDataParallel::set_step_in_backward)
run kiln_n_inbwd 120 scripts/kilnrun --nproc-per-node "$n" "$build/examples/gpt2_bench" --steps "$steps" --step-in-backward
run torch_n_compile 240 torchrun --nproc-per-node "$n" bench/gpt2_torch.py --modes compile --steps "$steps"
if [ "$quick" = 1 ]; then
  run torch_1 240 python3 bench/gpt2_torch.py --modes compile --steps "$steps"
else
  run torch_n_eager 120 torchrun --nproc-per-node "$n" bench/gpt2_torch.py --modes eager --steps "$steps"
  run torch_1 240 python3 bench/gpt2_torch.py --modes eager,compile --steps "$steps"
  # the gradients all-reduced as bf16 (half the bytes), in both
  run kiln_n_bf16 120 scripts/kilnrun --nproc-per-node "$n" "$build/examples/gpt2_bench" --steps "$steps" --comm-bf16
  run torch_n_compile_bf16 240 torchrun --nproc-per-node "$n" bench/gpt2_torch.py --modes compile --steps "$steps" --comm-bf16
  # GEMMs planned for fewer SMs while the all-reduces run (--sm-carveout), f32 and bf16 on the wire
  carveouts=${CARVEOUTS:-8 16 32}
  for c in $carveouts; do
    run "kiln_n_carve$c" 120 scripts/kilnrun --nproc-per-node "$n" "$build/examples/gpt2_bench" --steps "$steps" --sm-carveout "$c"
    run "kiln_n_bf16_carve$c" 120 scripts/kilnrun --nproc-per-node "$n" "$build/examples/gpt2_bench" --steps "$steps" \
      --sm-carveout "$c" --comm-bf16
  done
  # NCCL's Simple protocol forced for the ~20 MiB buckets (the trace's kernel is named RING_LL; LL moves half
  # the bandwidth on more SMs)
  run kiln_n_simple 120 env NCCL_PROTO=Simple scripts/kilnrun --nproc-per-node "$n" "$build/examples/gpt2_bench" \
    --steps "$steps"
fi
grep -h "^# torch" "$out"/ddp_torch_*.log | head -1
tps() { grep "${2:-RESULT}" "$out/ddp_$1.log" | field tokens_per_second; }
mem() { grep "${2:-RESULT}" "$out/ddp_$1.log" | field peak_gib; }
python3 - "$n" "$(tps kiln_1)" "$(tps kiln_n)" "$(tps kiln_zero)" "$(tps torch_1 'RESULT eager')" \
  "$(tps torch_n_eager)" "$(tps torch_1 'RESULT compile')" "$(tps torch_n_compile)" \
  "$(mem kiln_1)" "$(mem kiln_n)" "$(mem kiln_zero)" "$(mem torch_n_eager)" "$(mem torch_n_compile)" \
  "$(tps kiln_n_bf16)" "$(tps torch_n_compile_bf16)" "$(tps kiln_n_overlap)" "$(mem kiln_n_overlap)" \
  "$(tps kiln_n_inbwd)" "$(mem kiln_n_inbwd)" <<'PY'
import sys
n = int(sys.argv[1])
k1, kn, kz, t1e, tne, t1c, tnc, m1, mn, mz, mte, mtc, kb, tcb, ko, mo, ki, mi = (float(x or 0) for x in sys.argv[2:])
def eff(one, many): return f"{100 * many / (n * one):.1f}%" if one and many else "-"
print(f"{'tokens/s (GPT-2 124M, B16 T1024 bf16 a GPU)':46}{'1 GPU':>10}{f'{n} GPUs':>10}{'scaling':>9}{'peak GiB/GPU':>14}")
for name, one, many, mem in [("kiln DDP", k1, kn, mn), ("kiln DDP --overlap-step", k1, ko, mo),
                             ("kiln DDP --step-in-backward", k1, ki, mi), ("kiln ZeRO-1", k1, kz, mz),
                             ("torch DDP eager", t1e, tne, mte), ("torch DDP compiled", t1c, tnc, mtc)]:
    print(f"{name:46}{one:10.0f}{many:10.0f}{eff(one, many):>9}{mem:14.2f}")
if tnc: print(f"kiln DDP {n} GPUs / torch compiled DDP {n} GPUs: {kn / tnc:.3f}x" + (f", with --overlap-step {ko / tnc:.3f}x" if ko else "")
              + (f", with --step-in-backward {ki / tnc:.3f}x" if ki else ""))
if kb or tcb:
    print(f"{'with bf16 gradients on the wire':46}{'':10}{'':10}{'':9}")
    print(f"{'  kiln DDP --comm-bf16':46}{k1:10.0f}{kb:10.0f}{eff(k1, kb):>9}")
    print(f"{'  torch compiled DDP + bf16_compress_hook':46}{t1c:10.0f}{tcb:10.0f}{eff(t1c, tcb):>9}")
    if tcb: print(f"  kiln / torch, both bf16 on the wire: {kb / tcb:.3f}x")
print(f"ZeRO-1 saves {mn - mz:.2f} GiB a GPU against DDP (kiln 1 GPU: {m1:.2f} GiB)")
PY
k1=$(tps kiln_1)
t=$(tps kiln_n_simple)
[ -n "$t" ] && [ -n "$k1" ] && python3 -c "print(f'kiln DDP NCCL_PROTO=Simple: {$t:.0f} tokens/s, scaling {100*$t/($n*$k1):.1f}%')"
for c in ${carveouts:-}; do
  for w in "" _bf16; do
    t=$(tps "kiln_n${w}_carve$c")
    [ -n "$t" ] && [ -n "$k1" ] && python3 -c "print(f'kiln DDP${w:+ --comm-bf16} --sm-carveout $c: {$t:.0f} tokens/s, scaling {100*$t/($n*$k1):.1f}%')"
  done
done
sed -n '/DDP timeline/,/backward ended/p' "$out/ddp_kiln_n.log"
# which kernels take longer on 2 GPUs than on 1 (rank 0's 3 traced steps against the single GPU's)
python3 bench/trace_diff.py "$out/one_gpu_trace.json" "$out/ddp_trace.json" 3 25 | tee "$out/ddp_trace_diff.txt"
