#!/usr/bin/env bash
# The kill test on NCCL (GPU machine, one GPU a rank): tests/distributed/failure/main.cpp's nccl-kill job on
# N ranks (default 2; ctest runs 2, scripts/ddp_check.sh every GPU of the machine).
#   1. the N ranks started by hand with torchrun-style variables (no launcher to end the others): rank 1 dies
#      by SIGKILL, and every other rank must print the watchdog's error naming the collective, the group and
#      the 5 s timeout (or NCCL's asynchronous error, if NCCL sees the dead peer first), and exit 1 within a
#      bound;
#   2. the same with the all-reduces captured in a CUDA graph (nccl-graph-kill): the watchdog times the replay;
#   3. the first job under scripts/kilnrun, which must exit non-zero in bounded time.
# Usage: nccl_run.sh PROGRAM [N]
set -uo pipefail
program=$1
n=${2:-2}
kilnrun=$(dirname "$0")/../../../scripts/kilnrun
export NCCL_NVLS_ENABLE=0
fail() { echo "FAIL: $*"; exit 1; }
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$gpus" -ge "$n" ] || { echo "SKIP: $gpus GPU(s); the NCCL kill test on $n ranks needs $n"; exit 77; }
port=$(( 29700 + RANDOM % 200 ))
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# by_hand MODE WHAT: the job's MODE on n ranks started by hand; every rank but 1 must report WHAT's timeout
# or failure and exit 1 in bounded time
by_hand() {
  local mode=$1 what=$2
  local start=$(date +%s) pids=() failed="" r status elapsed out why
  for (( r = 0; r < n; r++ )); do
    # rank 0 traces its watchdog (KILN_WATCHDOG_DEBUG): shown only if this test fails
    debug=$([ $r -eq 0 ] && echo 1 || echo 0)
    KILN_WATCHDOG_DEBUG=$debug RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      timeout 120 "$program" "$mode" > "$logs/rank$r.log" 2>&1 &
    pids+=($!)
  done
  for (( r = 0; r < n; r++ )); do
    wait "${pids[$r]}"
    status=$?
    elapsed=$(( $(date +%s) - start ))
    echo "$mode rank $r: exit status $status after $elapsed s"
    [ $r -eq 1 ] && continue  # the one killed
    out=$(cat "$logs/rank$r.log")
    why=""
    if [ $status -eq 124 ]; then why="hung (killed by timeout after 120 s)"
    elif [ $status -ne 1 ]; then why="exited $status, not 1"
    # the watchdog's timeout, or NCCL's own report of the dead peer, whichever comes first
    elif ! echo "$out" | grep -Eq "$what (did not finish within 5000 ms|failed: )"; then
      why="did not report its collective's timeout or failure"
    elif [ $elapsed -ge 60 ]; then why="took $elapsed s to end"
    fi
    if [ -n "$why" ]; then
      echo "$out"
      failed+="$mode rank $r $why; "
    else
      echo "$out" | grep -m1 "kiln::Error"
    fi
  done
  [ -z "$failed" ] || fail "$failed"
}
by_hand nccl-kill "all_reduce \(sum\) on the nccl group of $n ranks \(rank [0-9]+\)"
port=$(( port + 2 ))
# the all-reduces captured in a CUDA graph: the watchdog times rank 0's replay
by_hand nccl-graph-kill "the 4 collective\(s\) of a CUDA graph replay \(the first: all_reduce \(sum\) on the nccl group of $n ranks \(rank [0-9]+\)\)"

start=$(date +%s)
out=$(timeout 120 "$kilnrun" --nproc-per-node "$n" --master-port $(( port + 1 )) "$program" nccl-kill 2>&1)
status=$?
elapsed=$(( $(date +%s) - start ))
echo "$out" | tail -20
echo "kilnrun: exit status $status after $elapsed s"
[ $status -ne 0 ] && [ $status -ne 124 ] || fail "kilnrun exited $status"
[ $elapsed -lt 60 ] || fail "kilnrun took $elapsed s to end"
echo "PASS ($n ranks)"
