#!/usr/bin/env bash
# The optimizer comparisons of docs/optim.md on the GPU machine, and the profiler's figures of
# docs/observability.md: (1) alone on GPU 0: Shampoo's root job for GPT-2 124M's blocks (kiln_shampoo_bench,
# beside torch.linalg.eigh) and gpt2_bench's step with AdamW (plus --trace: the profiler's overhead) and with
# Shampoo every 10 steps (its defaults, and warm TF32 roots after 500 steps, beside AdamW after 500 steps too);
# (2) char_gpt with AdamW and with Shampoo (val loss 1.50 in how many iterations and seconds; AdamW's run also
# --trace); (3) the Fashion-MNIST CNN's time to test accuracy 0.91: SGD + momentum,
# AdamW (batch 128 and 256, 5-epoch cosine schedules) and K-FAC (batch 128 over 2 and 3 epochs, batch 256
# over 3), each with seeds 0, 1, 2,
# one run at a time, every run stopped at the first epoch that reaches 0.91 (--target-accuracy). (2) and (3)
# run side by side where there are two GPUs, one after the other on one.
# Every run's metrics.jsonl goes into $OUT/optim_runs.tgz; `tools/kiln_plot` draws the curves afterwards.
# Needs build-gpu configured (scripts/gpu_check.sh or scripts/ddp_check.sh did) and .data carried.
# Usage: bash scripts/optim_compare.sh [perf|quality|char|fashion|all]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case "$what" in perf | quality | char | fashion | all) ;; *) echo "usage: $0 [perf|quality|char|fashion|all]" >&2; exit 2 ;; esac
out=${OUT:-optim_logs}
build=build-gpu
mkdir -p "$out/runs"
cmake --build "$build" -j32 --target char_gpt fashion_mnist gpt2_bench kiln_shampoo_bench > "$out/build.log" 2>&1 ||
  { tail -30 "$out/build.log"; exit 1; }
export KILN_FASHION_MNIST_DIR=$PWD/.data/fashion-mnist
gpus=$(nvidia-smi -L | wc -l)
second=$(( gpus > 1 ? 1 : 0 ))

if [ "$what" = perf ] || [ "$what" = all ]; then
  "$build/bench/kiln_shampoo_bench" > "$out/shampoo_bench.txt" 2>&1
  python3 bench/shampoo_torch.py > "$out/shampoo_torch.txt" 2>&1
  "$build/examples/gpt2_bench" --steps 30 --step-ms --trace "$out/gpt2_trace.json" > "$out/gpt2_adamw.txt" 2> "$out/gpt2_adamw.err"
  "$build/examples/gpt2_bench" --steps 30 --shampoo 10 > "$out/gpt2_shampoo.txt" 2>&1
  # AdamW after the same 500 warm-up steps as the tuned Shampoo runs below: the H200 holds ~1.83 GHz for the
  # first seconds of a run and ~1.67 GHz at its 700 W limit after that, 2.6-3.6% on AdamW's step (session
  # 37, docs/optim.md), so the ratio compares two steps at the same steady clock
  "$build/examples/gpt2_bench" --warmup 500 --steps 30 --step-ms > "$out/gpt2_adamw_w500.txt" 2>&1
  # GPT-2's cheapest Shampoo step so far (session 30, docs/optim.md): TF32 products, warm-started roots with
  # their products on TF32, β2 0.999; timed after 500 steps, once the factors move slowly enough for their
  # bases to be kept (char_gpt's Newton settings, session 29, cost 63-108 ms a step here)
  "$build/examples/gpt2_bench" --warmup 500 --steps 30 --step-ms --shampoo 10 --shampoo-tf32 --shampoo-beta2 0.999 \
    --shampoo-warm --shampoo-root-tf32 > "$out/gpt2_shampoo_tuned.txt" 2>&1
  # the same with bf16 statistics and preconditioning products (session 31: 1.22x AdamW against 1.28x, H200)
  "$build/examples/gpt2_bench" --warmup 500 --steps 30 --step-ms --shampoo 10 --shampoo-bf16 --shampoo-beta2 0.999 \
    --shampoo-warm --shampoo-root-tf32 > "$out/gpt2_shampoo_bf16.txt" 2>&1
fi

char() {  # char NAME DEVICE FLAGS...
  local name=$1 dev=$2; shift 2
  "$build/examples/char_gpt" --data .data/tinyshakespeare.txt --device "$dev" --run-dir "$out/runs/$name" "$@" \
    > "$out/runs/$name.log" 2>&1
}
# char_gpt: AdamW at its defaults against Shampoo at the settings session 29's sweep found fastest to 1.50
# (docs/optim.md), seeds 1337 (the default), 2 and 3; the default schedule (5000 iterations) stopped after
# 2000, evaluated every 50 iterations so that the first evaluation at 1.50 is within 50 of the crossing
# (the evaluations change no training batch; `train_seconds` leaves their time out).
char_runs() {
  local seed
  set -- --iters 2000 --lr-decay-iters 5000 --eval-interval 50
  # (bf16 products since session 37: as few iterations to 1.50 as TF32's on seeds 1337, 2 and 3, and ~0.1-0.2
  # ms an iteration less)
  local shampoo="--optimizer shampoo --shampoo-frequency 50 --shampoo-bf16 --shampoo-newton-tf32"
  shampoo+=" --shampoo-max-dim 512 --shampoo-epsilon 1e-6"
  char char_adamw cuda:0 "$@" --trace "$out/char_trace.json"
  # shellcheck disable=SC2086  # the flags split into words
  char char_shampoo cuda:0 "$@" $shampoo
  for seed in 2 3; do
    char "char_adamw_s$seed" cuda:0 "$@" --seed "$seed"
    # shellcheck disable=SC2086
    char "char_shampoo_s$seed" cuda:0 "$@" $shampoo --seed "$seed"
  done
}
# Each optimizer at the settings a sweep (docs/optim.md) found fastest to 0.91; SGD and K-FAC with weight
# decay 5e-4 (L2 through SGD), K-FAC's curvature every 10 steps and eigenbases every 100.
fashion_runs() {  # fashion_runs DEVICE
  local dev=$1 seed name
  local kfac="--optimizer kfac --weight-decay 5e-4 --kfac-damping 0.1 --kfac-factor-steps 10 --kfac-inv-steps 100"
  local -a configs=(
    "sgd_b128_e5|--optimizer sgd --weight-decay 5e-4 --lr 0.05 --epochs 5"
    "adamw_b128_e5|--optimizer adamw --lr 2e-3 --epochs 5"
    "adamw_b256_e5|--optimizer adamw --lr 3e-3 --epochs 5 --batch-size 256"
    "kfac_b128_e2|$kfac --lr 0.1 --epochs 2"
    "kfac_b128_e3|$kfac --lr 0.1 --epochs 3"
    "kfac_b256_e3|$kfac --lr 0.2 --epochs 3 --batch-size 256")
  for seed in 0 1 2; do
    for config in "${configs[@]}"; do
      name="fm_${config%%|*}_s$seed"
      # shellcheck disable=SC2086  # the flags split into words
      "$build/examples/fashion_mnist" --model cnn --data .data/fashion-mnist --device "$dev" --seed "$seed" \
        --target-accuracy 0.91 --gpu-monitor 0 --run-dir "$out/runs/$name" ${config#*|} > "$out/runs/$name.log" 2>&1
    done
  done
}
if [ "$what" = quality ] || [ "$what" = all ]; then
  if [ "$second" = 1 ]; then
    char_runs & fashion_runs cuda:1 & wait
  else
    char_runs; fashion_runs cuda:0
  fi
elif [ "$what" = char ]; then
  char_runs
elif [ "$what" = fashion ]; then
  fashion_runs cuda:0
fi
[ -d "$out/runs" ] && tar czf "$out/optim_runs.tgz" -C "$out" runs

echo "==== optim_compare summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $gpus GPUs)"
[ -f "$out/shampoo_bench.txt" ] && grep -h '^#' "$out/shampoo_bench.txt" | sed 's/^#/kiln /'
[ -f "$out/shampoo_torch.txt" ] && grep -h '^#' "$out/shampoo_torch.txt" | sed 's/^#/torch/'
for f in gpt2_adamw gpt2_shampoo gpt2_adamw_w500 gpt2_shampoo_tuned gpt2_shampoo_bf16; do [ -f "$out/$f.txt" ] && grep -h "RESULT\|TRACE\|STEP_MS" "$out/$f.txt" | sed "s/^/$f: /"; done
python3 - "$out/runs" <<'PY'
import json, os, re, sys
root = sys.argv[1]
if not os.path.isdir(root): sys.exit(0)
summary = {}
for name in sorted(os.listdir(root)):
    path = os.path.join(root, name, "metrics.jsonl")
    if not os.path.exists(path): continue
    recs = [json.loads(l) for l in open(path) if l.strip()]
    if name.startswith("char"):
        key, target, better = "val_loss", 1.50, lambda v: v <= 1.50
    else:
        key, target, better = "test_accuracy", 0.91, lambda v: v >= 0.91
    clock = "seconds" if all("seconds" in r for r in recs if r.get(key) is not None) else "time"
    vals = [(r["step"], r[clock], r[key], r.get("train_seconds")) for r in recs if r.get(key) is not None]
    first = next((x for x in vals if better(x[2])), None)
    hit, train = (first[:2], first[3]) if first else (None, None)
    best = (min if key == "val_loss" else max)(x[2] for x in vals) if vals else float("nan")
    end = vals[-1][1] if vals else 0
    print(f"{name:24} {key} {target}: " + (f"at step {hit[0]} after {hit[1]:.1f} s" if hit else "not reached") +
          (f" ({train:.2f} s of training)" if hit and train is not None else "") +
          f"; best {best:.4f}; run {end:.1f} s")
    if name.startswith("fm_"):
        summary.setdefault(re.sub(r"_s\d+$", "", name), []).append(hit)
for config, hits in summary.items():  # the Fashion-MNIST configurations over their seeds
    reached = sorted(h for h in hits if h)
    med = reached[len(hits) // 2] if len(reached) == len(hits) else None
    print(f"{config:24} 0.91 reached by {len(reached)} of {len(hits)} seeds; epochs " +
          " ".join(str(h[0]) if h else "-" for h in hits) + "; seconds " +
          " ".join(f"{h[1]:.2f}" if h else "-" for h in hits) +
          (f"; median epoch {med[0]}, {sorted(h[1] for h in reached)[len(hits) // 2]:.2f} s" if med else ""))
PY
for f in "$out"/runs/char_adamw.log; do [ -f "$f" ] && grep -h "TRACE" "$f" | sed 's/^/char_gpt: /'; done
