#!/usr/bin/env bash
# Per-kernel device time and DRAM traffic of the row kernels (layer norm, softmax, cross-entropy) in the
# benchmark binary, measured by Nsight Compute (clocks left alone): median per kernel name and dtype.
# Usage: bash scripts/ncu_rows.sh [build dir]   (writes $OUT/ncu_rows.csv)
set -uo pipefail
build=${1:-build-gpu}
out=${OUT:-gpu_check_logs}
mkdir -p "$out"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
"$NCU" --clock-control none --csv --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
  -k 'regex:layer_norm|softmax_kernel|cross_entropy|column_sum' -c 400 "$build/bench/kiln_bench" \
  > "$out/ncu_rows.csv" 2> "$out/ncu_rows.err"
python3 - "$out/ncu_rows.csv" <<'PY'
import csv, re, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("ncu wrote no rows:", open(sys.argv[1]).read()[-1500:], open(sys.argv[1][:-4] + ".err").read()[-1500:])
    sys.exit(1)
head = rows[0]
ki, mi, vi = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
by = {}
for r in rows[1:]:
    name = re.sub(r"\(.*", "", r[ki]).replace("kiln::cuda::", "").replace("<unnamed>::", "")
    grid = r[head.index("Grid Size")] if "Grid Size" in head else ""
    key = (name, grid)
    by.setdefault(key, {}).setdefault(r[mi], []).append(float(r[vi].replace(",", "")))
for (name, grid), m in by.items():
    t = statistics.median(m.get("gpu__time_duration.sum", [0]))
    rd = statistics.median(m.get("dram__bytes_read.sum", [0]))
    wr = statistics.median(m.get("dram__bytes_write.sum", [0]))
    n = len(m.get("gpu__time_duration.sum", []))
    print(f"NCU {name[:60]:60s} grid {grid:>14s} n={n:3d} {t/1e3:9.1f} us  read {rd/1e6:8.1f} MB  write {wr/1e6:8.1f} MB  {(rd+wr)/max(t,1)/1e3:6.2f} TB/s")
PY
