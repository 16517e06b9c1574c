#!/usr/bin/env bash
# Runs tests/distributed/failure/main.cpp's job (mode: timeout or kill) under mpiexec with N ranks (default 2)
# and checks that it ends non-zero, in bounded time, with the error it should print.
# Usage: run.sh MPIEXEC PROGRAM MODE [N]
set -uo pipefail
mpiexec=$1 program=$2 mode=$3 n=${4:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
start=$(date +%s)
output=$(timeout 120 "$mpiexec" -n "$n" --oversubscribe "$program" "$mode" 2>&1)
status=$?
elapsed=$(( $(date +%s) - start ))
echo "$output"
echo "exit status $status after $elapsed s"
fail() { echo "FAIL: $*"; exit 1; }
[ $status -ne 0 ] || fail "the job exited 0"
[ $status -ne 124 ] || fail "the job hung (killed by timeout after 120 s)"
[ $elapsed -lt 60 ] || fail "the job took $elapsed s to end"
if [ "$mode" = timeout ]; then
  echo "$output" | grep -q "rank 0: kiln::Error: barrier on the mpi group of $n ranks (rank 0) did not finish within 1000 ms" ||
    fail "rank 0 did not report the barrier's timeout"
else
  # rank 0 either times out in its all_reduce or is ended by mpiexec, which names the killed rank
  echo "$output" | grep -Eq "all_reduce \(sum\) on the mpi group of $n ranks \(rank 0\) did not finish|rank 1 .*(signal 9|Killed)" ||
    fail "neither rank 0's error nor mpiexec's report of rank 1's death"
fi
echo PASS
