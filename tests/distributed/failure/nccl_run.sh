#!/usr/bin/env bash
# The kill test on NCCL (GPU machine, 2 GPUs): tests/distributed/failure/main.cpp's nccl-kill job.
#   1. the two ranks started by hand with torchrun-style variables (no launcher to end rank 0): rank 1 dies by
#      SIGKILL, and rank 0 must print the watchdog's error naming the collective, the group and the 5 s
#      timeout (or NCCL's asynchronous error, if NCCL sees the dead peer first), and exit 1 within a bound;
#   2. the same job under scripts/kilnrun, which must exit non-zero in bounded time.
# Usage: nccl_run.sh PROGRAM
set -uo pipefail
program=$1
kilnrun=$(dirname "$0")/../../../scripts/kilnrun
export NCCL_NVLS_ENABLE=0
fail() { echo "FAIL: $*"; exit 1; }
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$gpus" -ge 2 ] || { echo "SKIP: $gpus GPU(s); the NCCL kill test needs 2"; exit 77; }
port=$(( 29700 + RANDOM % 200 ))

start=$(date +%s)
RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 120 "$program" nccl-kill &
other=$!
# rank 0 traces its watchdog (KILN_WATCHDOG_DEBUG): shown only if this test fails
out=$(KILN_WATCHDOG_DEBUG=1 RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 120 \
  "$program" nccl-kill 2>&1)
status=$?
elapsed=$(( $(date +%s) - start ))
wait $other
other_status=$?
echo "$out"
echo "rank 0: exit status $status after $elapsed s (rank 1 exited $other_status)"
[ $status -ne 124 ] || fail "rank 0 hung (killed by timeout after 120 s)"
[ $status -eq 1 ] || fail "rank 0 exited $status, not 1"
# the watchdog's timeout, or NCCL's own report of the dead peer, whichever comes first
echo "$out" | grep -Eq "all_reduce \(sum\) on the nccl group of 2 ranks \(rank 0\) (did not finish within 5000 ms|failed: )" ||
  fail "rank 0 did not report its all_reduce's timeout or failure"
[ $elapsed -lt 60 ] || fail "rank 0 took $elapsed s to end"

start=$(date +%s)
out=$(timeout 120 "$kilnrun" --nproc-per-node 2 --master-port $(( port + 1 )) "$program" nccl-kill 2>&1)
status=$?
elapsed=$(( $(date +%s) - start ))
echo "$out"
echo "kilnrun: exit status $status after $elapsed s"
[ $status -ne 0 ] && [ $status -ne 124 ] || fail "kilnrun exited $status"
[ $elapsed -lt 60 ] || fail "kilnrun took $elapsed s to end"
echo PASS
