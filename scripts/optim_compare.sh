#!/usr/bin/env bash
# The optimizer comparisons of docs/optim.md on the GPU machine, and the profiler's figures of
# docs/observability.md: (1) alone on GPU 0: Shampoo's root job for GPT-2 124M's blocks (kiln_shampoo_bench,
# beside torch.linalg.eigh) and gpt2_bench's step with AdamW (plus --trace: the profiler's overhead) and with
# Shampoo every 10 steps; (2) then, in parallel where there are two GPUs: char_gpt with AdamW and with Shampoo
# (val loss 1.50 in how many iterations and seconds; AdamW's run also --trace), and the Fashion-MNIST CNN with
# SGD + momentum, AdamW and K-FAC, two learning rates each (test accuracy 0.91 in how many epochs and seconds).
# Every run's metrics.jsonl goes into $OUT/optim_runs.tgz; `tools/kiln_plot` draws the curves afterwards.
# Needs build-gpu configured (scripts/gpu_check.sh or scripts/ddp_check.sh did) and .data carried.
# Usage: bash scripts/optim_compare.sh [perf|quality|all]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${OUT:-optim_logs}
build=build-gpu
mkdir -p "$out/runs"
cmake --build "$build" -j32 --target char_gpt fashion_mnist gpt2_bench kiln_shampoo_bench > "$out/build.log" 2>&1 ||
  { tail -30 "$out/build.log"; exit 1; }
export KILN_FASHION_MNIST_DIR=$PWD/.data/fashion-mnist
gpus=$(nvidia-smi -L | wc -l)
second=$(( gpus > 1 ? 1 : 0 ))

if [ "$what" != quality ]; then
  "$build/bench/kiln_shampoo_bench" > "$out/shampoo_bench.txt" 2>&1
  python3 bench/shampoo_torch.py > "$out/shampoo_torch.txt" 2>&1
  "$build/examples/gpt2_bench" --steps 30 --trace "$out/gpt2_trace.json" > "$out/gpt2_adamw.txt" 2> "$out/gpt2_adamw.err"
  "$build/examples/gpt2_bench" --steps 30 --shampoo 10 > "$out/gpt2_shampoo.txt" 2>&1
fi

if [ "$what" != perf ]; then
  char() {  # char NAME DEVICE FLAGS...
    local name=$1 dev=$2; shift 2
    "$build/examples/char_gpt" --data .data/tinyshakespeare.txt --device "$dev" --run-dir "$out/runs/$name" "$@" \
      > "$out/runs/$name.log" 2>&1
  }
  fashion() {
    local name=$1 dev=$2; shift 2
    "$build/examples/fashion_mnist" --model cnn --epochs 15 --data .data/fashion-mnist --device "$dev" --run-dir "$out/runs/$name" "$@" \
      > "$out/runs/$name.log" 2>&1
  }
  (
    char char_adamw cuda:0 --trace "$out/char_trace.json"
    char char_shampoo_lr1e-3 cuda:0 --optimizer shampoo
    char char_shampoo_lr2e-3 cuda:0 --optimizer shampoo --lr 2e-3 --min-lr 2e-4
  ) &
  (
    fashion fm_sgd_lr0.03 "cuda:$second" --optimizer sgd --lr 0.03
    fashion fm_sgd_lr0.1 "cuda:$second" --optimizer sgd --lr 0.1
    fashion fm_adamw_lr1e-3 "cuda:$second" --optimizer adamw --lr 1e-3
    fashion fm_adamw_lr3e-3 "cuda:$second" --optimizer adamw --lr 3e-3
    fashion fm_kfac_lr0.03 "cuda:$second" --optimizer kfac --lr 0.03 --kfac-damping 0.03
    fashion fm_kfac_lr0.1 "cuda:$second" --optimizer kfac --lr 0.1 --kfac-damping 0.03
  ) &
  wait
  tar czf "$out/optim_runs.tgz" -C "$out" runs
fi

echo "==== optim_compare summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $gpus GPUs)"
[ -f "$out/shampoo_bench.txt" ] && grep -h '^#' "$out/shampoo_bench.txt" | sed 's/^#/kiln /'
[ -f "$out/shampoo_torch.txt" ] && grep -h '^#' "$out/shampoo_torch.txt" | sed 's/^#/torch/'
for f in gpt2_adamw gpt2_shampoo; do [ -f "$out/$f.txt" ] && grep -h "RESULT\|TRACE" "$out/$f.txt" | sed "s/^/$f: /"; done
python3 - "$out/runs" <<'PY'
import json, os, sys
root = sys.argv[1]
if not os.path.isdir(root): sys.exit(0)
for name in sorted(os.listdir(root)):
    path = os.path.join(root, name, "metrics.jsonl")
    if not os.path.exists(path): continue
    recs = [json.loads(l) for l in open(path) if l.strip()]
    if name.startswith("char"):
        key, target, better = "val_loss", 1.50, lambda v: v <= 1.50
    else:
        key, target, better = "test_accuracy", 0.91, lambda v: v >= 0.91
    vals = [(r["step"], r["time"], r[key]) for r in recs if r.get(key) is not None]
    hit = next(((s, t) for s, t, v in vals if better(v)), None)
    best = (min if key == "val_loss" else max)(v for _, _, v in vals) if vals else float("nan")
    end = vals[-1][1] if vals else 0
    print(f"{name:24} {key} {target}: " + (f"at step {hit[0]} after {hit[1]:.1f} s" if hit else "not reached") +
          f"; best {best:.4f}; run {end:.1f} s")
PY
for f in "$out"/runs/char_adamw.log; do [ -f "$f" ] && grep -h "TRACE" "$f" | sed 's/^/char_gpt: /'; done
