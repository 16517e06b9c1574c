#!/usr/bin/env bash
# A/B of a run-time switch within one build, on one GPU in one call: the attention bench rows and GPT-2's
# step, each run alternately without (A) and with (B) the switch, two rounds. The switch is an environment
# setting (ENV_B, e.g. KILN_FLASH_ATTENTION_SM90=0) and/or extra gpt2_bench flags (FLAGS_B, e.g.
# --step-in-backward; FLAGS for both). Needs a build with benchmarks and examples in $1 (default build-gpu).
# Prints best-of-rounds ms per attention row with B/A, and each gpt2_bench RESULT line.
# Usage: ENV_B="KILN_FLASH_ATTENTION_SM90=0" FLAGS_B="" ROWS="d64_n1024 d128_n4096" bash scripts/ab_env.sh [build]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=${OUT:-ab_env_logs}; mkdir -p "$out"
rows=${ROWS:-d64_n1024 d128_n4096}
env_b=${ENV_B:-}
flags_b=${FLAGS_B:-}
flags=${FLAGS:-}
run_as() {  # run_as A|B COMMAND...: the command with B's environment when B
  if [ "$1" = B ] && [ -n "$env_b" ]; then shift; env $env_b "$@"; else shift; "$@"; fi
}
for round in 1 2; do
  for v in A B; do
    for r in $rows; do run_as "$v" "$build/bench/kiln_attention_bench" "$r"; done > "$out/attn_${v}_$round.txt" 2>&1
  done
done
for round in 1 2; do
  for v in A B; do
    extra=$flags; [ "$v" = B ] && extra="$flags $flags_b"
    # shellcheck disable=SC2086  # the flags are words
    run_as "$v" "$build/examples/gpt2_bench" --steps "${STEPS:-30}" $extra > "$out/gpt2_${v}_$round.txt" 2>&1
    echo "gpt2 $v $round: $(grep RESULT "$out/gpt2_${v}_$round.txt")"
  done
done
python3 bench/ab_rows.py "$out" attn_A attn_B A B
