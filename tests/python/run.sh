#!/usr/bin/env bash
# Runs the Python interop tests with an interpreter that has h5py and numpy (Debian's python3-h5py and
# python3-numpy, which scripts/install_deps.sh installs; /usr/bin/python3 first, where a pyenv shim may
# shadow it). Usage: run.sh REPOSITORY_ROOT [TEST_SCRIPT [ARGS...]]  (default test_kiln_checkpoint.py -v)
set -uo pipefail
root=$1
script=${2:-test_kiln_checkpoint.py}
shift $(( $# > 1 ? 2 : 1 ))
[ $# -eq 0 ] && [ "$script" = test_kiln_checkpoint.py ] && set -- -v
for python in /usr/bin/python3 python3; do
  if "$python" -c "import h5py, numpy" 2>/dev/null; then
    exec "$python" "$root/tests/python/$script" "$root" "$@"
  fi
done
echo "FAIL: no python3 with h5py and numpy (bash scripts/install_deps.sh installs python3-h5py python3-numpy)"
exit 1
