#!/usr/bin/env bash
# scripts/kilnrun and the environment-variable rendezvous (CI: CPU only). Usage: run.sh RENDEZVOUS_PROGRAM
set -uo pipefail
program=$1
kilnrun="$(dirname "$0")/../../../scripts/kilnrun"
fail() { echo "FAIL: $*"; exit 1; }
port=$(( 20000 + RANDOM % 20000 ))

# 1. three ranks meet at rank 0 over TCP; every line is prefixed with its rank
out=$("$kilnrun" --nproc-per-node 3 --master-port $port "$program" 2>&1); status=$?
echo "$out"
[ $status -eq 0 ] || fail "the rendezvous job exited $status"
for r in 0 1 2; do
  echo "$out" | grep -q "^\[rank $r\] rank $r of 3 (local $r) received 'payload of rank 0'" || fail "rank $r"
done

# 1b. ranks that succeed one after another: kilnrun waits for each and exits 0
out=$("$kilnrun" --nproc-per-node 3 bash -c 'sleep "0.$(( 3 * RANK ))"; echo done' 2>&1); status=$?
echo "$out"
[ $status -eq 0 ] || fail "ranks that all succeeded gave kilnrun status $status"
[ "$(echo "$out" | grep -c 'done$')" -eq 3 ] || fail "not every rank finished"
! echo "$out" | grep -q "no such job" || fail "kilnrun waited for a rank it had already reaped"

# 2. a rank that fails ends the others at once, and kilnrun exits with its status
start=$(date +%s)
out=$("$kilnrun" --nproc-per-node 2 bash -c '[ "$RANK" = 1 ] && exit 7; sleep 60' 2>&1); status=$?
echo "$out"
[ $status -eq 7 ] || fail "kilnrun exited $status, not the failed rank's 7"
[ $(( $(date +%s) - start )) -lt 20 ] || fail "the other rank was not ended"
echo "$out" | grep -q "rank 1 exited with status 7" || fail "no report of the failed rank"

# 3. a rank whose peer never comes reports it within the timeout (a lone rank 1 of 2: rank 0 missing)
out=$(RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(( port + 1 )) timeout 60 "$program" 3000 2>&1); status=$?
echo "$out"
[ $status -eq 1 ] || fail "a missing rank 0 gave status $status"
echo "$out" | grep -q "could not reach rank 0 at 127.0.0.1:$(( port + 1 )) within 3000 ms" || fail "no rendezvous error"
echo PASS
