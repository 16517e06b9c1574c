#!/usr/bin/env bash
# What the profiler's hooks cost while it is off: gpt2_bench (GPT-2 124M, B16 T1024 bf16) built twice from
# this tree, with the hooks (build-prof-on, the default) and without (build-prof-off, -DKILN_PROFILER=OFF: every
# hook's test a constant false), run alternately ROUNDS times each (default 3) in one call; prints each
# run, the medians and their difference. GPU machine; carry .deps (nlohmann-json).
# Usage: bash scripts/profiler_off_ab.sh    (STEPS=k timed steps a run, default 30)
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-3}
steps=${STEPS:-30}
common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_BUILD_EXAMPLES=ON
        -DKILN_BUILD_TESTS=OFF)
for b in "build-prof-on ON" "build-prof-off OFF"; do
  set -- $b
  { cmake -S . -B "$1" "${common[@]}" -DKILN_PROFILER="$2" && cmake --build "$1" -j"$(nproc)" --target gpt2_bench; } \
    > "/tmp/profiler_ab_$1.log" 2>&1 || { tail -20 "/tmp/profiler_ab_$1.log"; exit 1; }
done
tps() { "$1/examples/gpt2_bench" --steps "$steps" 2>/dev/null | grep -o "tokens_per_second=[0-9]*" | cut -d= -f2; }
on=() off=()
for (( r = 1; r <= rounds; r++ )); do
  a=$(tps build-prof-on) b=$(tps build-prof-off)
  echo "round $r: hooks built in (off) $a tokens/s, compiled out $b tokens/s"
  on+=("$a") off+=("$b")
done
python3 - "${on[*]}" "${off[*]}" <<'PY'
import statistics, sys
on = [float(x) for x in sys.argv[1].split()]
off = [float(x) for x in sys.argv[2].split()]
a, b = statistics.median(on), statistics.median(off)
print(f"median tokens/s: hooks built in, profiler off {a:.0f}; hooks compiled out {b:.0f}; "
      f"cost of the hooks {100 * (b - a) / b:+.2f}% (runs spread {100 * (max(on + off) - min(on + off)) / b:.2f}%)")
PY
