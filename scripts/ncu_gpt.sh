#!/usr/bin/env bash
# Where a GPT-2 training step spends its device time: Nsight Compute times every kernel of gpt2_bench
# (2 layers, B 16, T 1024, setup + 3 steps; per-layer costs scale by 6 for GPT-2 small) and prints the
# total per kernel name. Usage on the GPU machine: bash scripts/ncu_gpt.sh (logs under $OUT or ncu_gpt_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-ncu_gpt_logs}
mkdir -p "$OUT"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_BUILD_EXAMPLES=ON > /dev/null
cmake --build build-gpu -j16 --target gpt2_bench > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum -c 3000 \
  build-gpu/examples/gpt2_bench --n-layer 2 --warmup 2 --steps 1 > $OUT/gpt.csv 2> $OUT/gpt.err
python3 - $OUT/gpt.csv <<'PY'
import csv,sys,re,collections
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>10]
h=rows[0]; ki,vi,ii=h.index("Kernel Name"),h.index("Metric Value"),h.index("ID")
ks=[(int(r[ii]),re.sub(r"\(.*","",r[ki]).replace("kiln::cuda::","").replace("(anonymous namespace)::","")[:80],float(r[vi].replace(",",""))) for r in rows[1:]]
half=ks  # all kernels: model setup plus three steps
tot=collections.defaultdict(float); cnt=collections.Counter()
for _,k,t in half: tot[k]+=t; cnt[k]+=1
s=sum(tot.values())
print(f"kernels {len(half)} (setup + 3 steps), device time {s/1e6:.3f} ms")
for k,t in sorted(tot.items(),key=lambda x:-x[1])[:40]:
    print(f"{t/1e3:9.1f} us {100*t/s:5.1f}% n={cnt[k]:4d}  {k}")
PY
