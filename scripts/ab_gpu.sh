#!/usr/bin/env bash
# A/B on one GPU: this tree against an older commit's source in .old/ (made here with
# `git archive <rev> | tar -x -C .old`, and carried to the GPU machine), both built and run in one call, so
# a change's effect on speed is measured on the same GPU at the same time. Stages (run them in order):
#   build   configure and build both (benchmarks and examples, no tests) in build-old and build-new
#   bench   gpt2_bench --steps 20 old, new, old, new; kiln_bench (the kernel table) the same, and with
#           ATTN=1 kiln_attention_bench once each; prints new/old per row (best of the runs)
#   char    char_gpt's full run, old then new (needs .data/tinyshakespeare.txt)
# Logs under $OUT (default ab_logs). Usage: bash scripts/ab_gpu.sh build && bash scripts/ab_gpu.sh bench
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d .old ] || { echo "ab_gpu: no .old/ (git archive <rev> | tar -x -C .old)"; exit 1; }
out=${OUT:-ab_logs}; mkdir -p "$out"
stage=${1:-build}
export KILN_SHAKESPEARE=$PWD/.data/tinyshakespeare.txt
conf() { cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
           -DKILN_BUILD_BENCH=ON -DKILN_BUILD_TESTS=OFF -DKILN_BUILD_EXAMPLES=ON > "$out/conf_$(basename $2).log" 2>&1 || { tail -20 "$out/conf_$(basename $2).log"; exit 1; }; }
if [ "$stage" = build ]; then
  t0=$(date +%s)
  conf .old build-old
  conf . build-new
  cmake --build build-old -j16 --target kiln_bench kiln_attention_bench gpt2_bench char_gpt > "$out/build_old.log" 2>&1 || { grep -E "error|FAILED" "$out/build_old.log" | head; exit 1; }
  echo "old built $(( $(date +%s) - t0 )) s"
  cmake --build build-new -j16 --target kiln_bench kiln_attention_bench gpt2_bench char_gpt > "$out/build_new.log" 2>&1 || { grep -E "error|FAILED" "$out/build_new.log" | head; exit 1; }
  echo "new built $(( $(date +%s) - t0 )) s"
fi
if [ "$stage" = bench ]; then
  nvidia-smi --query-gpu=name --format=csv,noheader
  for round in 1 2; do
    for v in old new; do
      build-$v/examples/gpt2_bench --steps 20 > "$out/gpt2_${v}_$round.txt" 2> "$out/gpt2_${v}_$round.err"
      echo "gpt2 $v $round: $(grep RESULT "$out/gpt2_${v}_$round.txt")"
    done
  done
  for round in 1 2; do
    for v in old new; do build-$v/bench/kiln_bench > "$out/kern_${v}_$round.txt" 2>&1; done
  done
  if [ "${ATTN:-0}" = 1 ]; then
    for v in old new; do build-$v/bench/kiln_attention_bench > "$out/kern_${v}_attn.txt" 2>&1; done
  fi
  python3 bench/ab_rows.py "$out" kern_old kern_new old new
fi
if [ "$stage" = char ]; then
  for v in old new; do
    build-$v/examples/char_gpt --device cuda --sample 0 > "$out/char_$v.txt" 2> "$out/char_$v.err"
    echo "char $v: $(grep RESULT "$out/char_$v.txt")"
  done
fi
