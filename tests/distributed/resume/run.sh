#!/usr/bin/env bash
# A data-parallel checkpoint resumes at another world size with the same losses (char_gpt, --dropout 0):
#   1. N ranks train from scratch to iteration 10 and save (batch B a rank: a global batch of N·B windows);
#   2. N ranks train the same run uninterrupted to iteration 12 (--print-loss: the global batch's loss);
#   3. the checkpoint of 1. resumes to iteration 12 on N ranks, on N/2 ranks with batch 2B, ..., and on 1 rank
#      with batch N·B: iterations 10 and 11 (the first loss shows the weights, the second the optimizer state
#      and the schedule) must match the uninterrupted run's to within TOL (relative; the ranks sum their
#      batches' losses and gradients in another order). Prints a table.
# Usage: run.sh LAUNCH CHAR_GPT [N] [TOL] [-- extra char_gpt flags]
#   LAUNCH: "mpi:MPIEXEC" (CPU ranks; CI) or "kilnrun" (one GPU a rank: pass --device cuda in the flags)
# The text is generated (no data file needed); OUT (if set) keeps the logs.
set -uo pipefail
launch=$1 program=$2 n=${3:-2} tol=${4:-1e-5}
shift 4 2>/dev/null || shift $#
[ "${1:-}" = "--" ] && shift
extra=("$@")
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=${OUT:-$work}
fail() { echo "FAIL: $*"; exit 1; }

for i in $(seq 1 4000); do echo "the quick brown fox $i jumps over the lazy dog $(( i * 7 % 13 )), said she."; done \
  > "$work/text.txt"
batch=$(( 16 / n ))
[ $(( batch * n )) -eq 16 ] || fail "N=$n does not divide the global batch of 16"
common=(--data "$work/text.txt" --eval-interval 10 --eval-iters 1 --n-layer 2 --n-head 2 --n-embd 32 --block-size 32
        --dropout 0 --lr-decay-iters 100 --warmup-iters 2 --sample 0 --run-dir none --gpu-monitor 0 "${extra[@]}")
# start RANKS LOG ARGS...: char_gpt on RANKS ranks (1: one plain process)
start() {
  local ranks=$1 log=$2
  shift 2
  if [ "$ranks" -eq 1 ]; then timeout 300 "$program" "$@" > "$out/$log" 2>&1
  elif [ "${launch%%:*}" = mpi ]; then
    timeout 300 "${launch#mpi:}" -n "$ranks" --oversubscribe "$program" "$@" > "$out/$log" 2>&1
  else timeout 300 "$here/../../../scripts/kilnrun" --nproc-per-node "$ranks" --master-port $(( 29600 + RANDOM % 300 )) \
      "$program" "$@" > "$out/$log" 2>&1
  fi || { tail -20 "$out/$log"; fail "$log: char_gpt on $ranks rank(s) failed"; }
}
# loss LOG ITER: the printed global loss at ITER
loss() { sed -n "s/^\(\[rank 0\] \)\{0,1\}iter $2 loss \([0-9.eE+-]*\)$/\2/p" "$out/$1" | tail -1; }

start "$n" saved.log "${common[@]}" --batch-size "$batch" --iters 10 --checkpoint "$work/ck.h5"
start "$n" straight.log "${common[@]}" --batch-size "$batch" --iters 12 --print-loss
ref10=$(loss straight.log 10) ref11=$(loss straight.log 11)
[ -n "$ref10" ] && [ -n "$ref11" ] || fail "the uninterrupted run printed no loss at iterations 10 and 11"
printf '%-34s %12s %12s\n' "run (global batch 16)" "iter 10" "iter 11"
printf '%-34s %12s %12s\n' "$n ranks uninterrupted" "$ref10" "$ref11"
bad=""
for (( ranks = n; ranks >= 1; ranks /= 2 )); do
  cp "$work/ck.h5" "$work/ck$ranks.h5"
  start "$ranks" "resumed$ranks.log" "${common[@]}" --batch-size $(( 16 / ranks )) --iters 12 --checkpoint "$work/ck$ranks.h5" \
    --resume --print-loss
  l10=$(loss "resumed$ranks.log" 10) l11=$(loss "resumed$ranks.log" 11)
  printf '%-34s %12s %12s\n' "resumed on $ranks rank(s), batch $(( 16 / ranks ))" "${l10:-none}" "${l11:-none}"
  python3 -c "import sys; got = [float(x) for x in sys.argv[1:3]]; want = [float(x) for x in sys.argv[4:6]]
sys.exit(0 if all(abs(g - w) <= float(sys.argv[3]) * abs(w) for g, w in zip(got, want)) else 1)" \
    "${l10:-nan}" "${l11:-nan}" "$tol" "$ref10" "$ref11" || bad+="$ranks "
  [ "$ranks" -eq 1 ] && break
done
[ -z "$bad" ] || fail "resumed on ${bad}rank(s): losses differ from the uninterrupted run's by more than $tol (relative)"
echo "PASS (tolerance $tol relative)"
