#!/usr/bin/env python3
"""The data-parallel scaling table from the logs of scripts/ddp_scaling.sh (scale_<impl>_<N>.log, each with
a RESULT line: tokens_per_second=... peak_gib=...), one folder or several (runs of another call merged):

    python3 bench/ddp_scaling_table.py LOGDIR [LOGDIR ...]

Columns per size N: tokens/s of Kiln DDP, Kiln ZeRO-1 and PyTorch compiled DDP; each one's scaling
efficiency against its own 1-GPU figure (tokens/s at N over N times 1 GPU's); Kiln DDP / torch; peak
memory a GPU of DDP and ZeRO-1, and ZeRO-1's prediction: DDP's peak less the AdamW moments it no longer
holds, (1 - 1/N) of 2 f32 values a parameter (GPT-2 124M with its 50304-row tied embedding: 124,475,904
parameters, 0.93 GiB of moments).
"""
import glob
import os
import re
import sys

PARAMS = 124_475_904  # GPT-2 124M as gpt2_bench builds it (vocabulary 50304, biases, tied lm_head)
MOMENTS_GIB = 2 * 4 * PARAMS / 2**30


def read(dirs):
    runs = {}
    for d in dirs:
        for path in glob.glob(os.path.join(d, "scale_*_*.log")):
            m = re.match(r"scale_(kiln|zero|torch)_(\d+)\.log$", os.path.basename(path))
            if not m:
                continue
            text = open(path, errors="replace").read()
            results = re.findall(r"RESULT.*?tokens_per_second=([0-9.]+).*?peak_gib=([0-9.]+)", text)
            if results:
                tps, peak = results[-1]
                runs[(m.group(1), int(m.group(2)))] = (float(tps), float(peak))
    return runs


def main():
    runs = read(sys.argv[1:] or ["."])
    if not runs:
        print("ddp_scaling_table: no RESULT lines in", " ".join(sys.argv[1:]))
        return 1
    sizes = sorted({n for _, n in runs})
    one = {impl: runs.get(("kiln" if impl == "zero" else impl, 1), (0, 0))[0] for impl in ("kiln", "zero", "torch")}

    def cell(impl, n):
        key = ("kiln", 1) if impl == "zero" and n == 1 else (impl, n)  # ZeRO-1 on one GPU is plain AdamW
        tps = runs.get(key, (0, 0))[0]
        if not tps:
            return "-", "-", 0
        eff = f"{100 * tps / (n * one[impl]):.1f}%" if one[impl] else "-"
        return f"{tps:,.0f}", eff, tps

    print("GPT-2 124M, B16 T1024 bf16 a GPU, tokens/s (scaling against 1 GPU)")
    print(f"{'GPUs':>5} {'kiln DDP':>12} {'':>7} {'kiln ZeRO-1':>12} {'':>7} {'torch compiled':>15} {'':>7} "
          f"{'kiln/torch':>10} {'peak GiB DDP':>13} {'ZeRO-1':>7} {'predicted':>10}")
    for n in sizes:
        k, ke, kt = cell("kiln", n)
        z, ze, _ = cell("zero", n)
        t, te, tt = cell("torch", n)
        ratio = f"{kt / tt:.3f}x" if kt and tt else "-"
        mem_ddp = runs.get(("kiln", n), (0, 0))[1]
        mem_zero = runs.get(("zero", n), (0, 0))[1] if n > 1 else mem_ddp
        predicted = mem_ddp - (1 - 1 / n) * MOMENTS_GIB if mem_ddp else 0
        print(f"{n:>5} {k:>12} {ke:>7} {z:>12} {ze:>7} {t:>15} {te:>7} {ratio:>10} "
              f"{mem_ddp:>13.2f} {mem_zero:>7.2f} {predicted:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
