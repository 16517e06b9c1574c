#!/usr/bin/env bash
# kiln_info runs, exits 0 and says what this build is. Usage: kiln_info_test.sh KILN_INFO VERSION WITH_CUDA
set -uo pipefail
out=$("$1" 2>&1); status=$?
echo "$out"
fail() { echo "FAIL: $*"; exit 1; }
[ $status -eq 0 ] || fail "kiln_info exited $status"
echo "$out" | grep -q "^Kiln $2 (" || fail "no version line"
if [ "$3" = ON ] || [ "$3" = 1 ] || [ "$3" = TRUE ]; then
  echo "$out" | grep -q "^CUDA backend: on (architectures " || fail "the CUDA build does not say so"
  echo "$out" | grep -q "^CUDA runtime " || fail "no CUDA library versions"
else
  echo "$out" | grep -q "^CUDA backend: off" || fail "the CPU build does not say so"
fi
echo "$out" | grep -Eq "^distributed: MPI backend (yes|no), NCCL " || fail "no distributed line"
echo "$out" | grep -Eq "^[0-9]+ CUDA devices?$" || fail "no device count"
echo PASS
