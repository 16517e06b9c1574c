#!/usr/bin/env bash
# Installs the built Kiln into a temporary prefix, extracts the README's example, builds it with
# find_package(Kiln) and runs it. Arguments: the build dir and the source dir.
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
sed -n '/<!-- readme-example:begin -->/,/<!-- readme-example:end -->/p' "$src/README.md" | sed '/^```/d;/^<!--/d' \
  > "$work/main.cpp"
[ -s "$work/main.cpp" ] || { echo "no example found in README.md"; exit 1; }
# The consumer is compiled with Kiln's own flags (scripts/sanitize.sh builds both with the sanitizers).
cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
distributed=""
[ "$(cache_value KILN_WITH_MPI)" = "TRUE" ] && distributed="-DDISTRIBUTED_SOURCE=$src/tests/consumer/distributed_main.cpp"
cmake -S "$src/tests/consumer" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CXX_FLAGS="$(cache_value CMAKE_CXX_FLAGS)" -DCMAKE_EXE_LINKER_FLAGS="$(cache_value CMAKE_EXE_LINKER_FLAGS)" \
      -DCMAKE_PREFIX_PATH="$work/prefix" -DEXAMPLE_SOURCE="$work/main.cpp" $distributed >/dev/null
cmake --build "$work/build"
cd "$work" && ./build/readme_example
test -s "$work/readme_example.h5"
# Kiln::kiln_distributed, where the build has its MPI backend: two ranks all-reduce. Under the sanitizers
# without leak detection, as scripts/sanitize.sh runs every MPI job: OpenMPI leaks in its dlopen'ed
# components at exit, in frames LeakSanitizer cannot name.
if [ -n "$distributed" ]; then
  ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0" \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$(cache_value MPIEXEC_EXECUTABLE)" -n 2 --oversubscribe \
    ./build/distributed_example
fi
