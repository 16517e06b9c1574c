#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer + UndefinedBehaviorSanitizer + LeakSanitizer.
#
#   bash scripts/sanitize.sh [build-dir]      (default: build-sanitize)
#
# Builds Kiln without CUDA at -O1 with -fsanitize=address,undefined (every UB check fatal), then runs the
# whole CPU suite (ctest, the install consumer included: it is built with the same flags). Any finding
# (an ASan error, a UBSan runtime error, a leak at exit) fails its test, so "100% tests passed" is zero
# findings; the script also counts the reports in the logs and prints them last. Suppressions (only for
# leaks inside third-party libraries, each named with its reason) are in scripts/lsan.supp.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-sanitize}
bash scripts/install_deps.sh
flags="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKILN_CUDA=OFF -DKILN_BUILD_EXAMPLES=OFF \
      -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
      -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined"
cmake --build "$build" -j"$(nproc)"

# allocator_may_return_null: an impossible request (arange of 1e13 elements) must come back as null, which
# Kiln turns into a kiln::Error, as glibc does; ASan would otherwise abort the process.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$PWD/scripts/lsan.supp:print_suppressions=1"
status=0
(cd "$build" && ctest -j"$(nproc)" --output-on-failure --timeout 1200 -LE distributed) > "$build/sanitize.log" 2>&1 || status=$?
# The MPI-launched tests (label distributed) run with ASan and UBSan but without leak detection: OpenMPI 4.1
# leaks a few KB in its dlopen'ed components at exit, which LSan reports as "<unknown module>" frames it
# cannot attribute (the components are unloaded by then), so no suppression can name them.
(cd "$build" && ASAN_OPTIONS="${ASAN_OPTIONS/detect_leaks=1/detect_leaks=0}" \
   ctest --output-on-failure --timeout 1200 -L distributed) >> "$build/sanitize.log" 2>&1 || status=$?
asan=$(grep -c "ERROR: AddressSanitizer" "$build/sanitize.log" || true)
ubsan=$(grep -c "runtime error:" "$build/sanitize.log" || true)
leaks=$(grep -c "ERROR: LeakSanitizer" "$build/sanitize.log" || true)
tail -n 30 "$build/sanitize.log"
echo "==== sanitize summary: ASan errors $asan, UBSan runtime errors $ubsan, LeakSanitizer reports $leaks (log: $build/sanitize.log)"
[ "$status" -eq 0 ] && [ "$asan" -eq 0 ] && [ "$ubsan" -eq 0 ] && [ "$leaks" -eq 0 ]
