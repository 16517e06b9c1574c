#!/usr/bin/env python3
"""nanoGPT's shakespeare-char training run in plain PyTorch: the wall-time reference for examples/char_gpt.

Same data, split, model, optimizer, schedule and evaluation as char_gpt: character vocabulary (sorted unique
characters), first 90% train / last 10% val; GPT with 6 layers, 6 heads, width 384, context 256, no biases,
dropout 0.2 (embeddings, residual branches, attention weights), tied lm_head; batch 64; AdamW lr 1e-3,
betas (0.9, 0.99), weight decay 0.1 on 2-D weights, fused; 100 warmup iterations (lr (it+1)/100), cosine
decay to 1e-4 at 5000; gradient clipping at 1.0; bf16 autocast; evaluation every 250 iterations and after
the last on 200 random batches of each split (eval mode, no_grad).

    python3 bench/char_gpt_torch.py --data .data/tinyshakespeare.txt [--compile] [--iters 5000]

Prints `iter N train X val Y` per evaluation and last
    RESULT best_val_loss=... seconds=... tokens_per_second=...
seconds: the whole run (data, model, training, evaluations); tokens_per_second: training tokens over the
time spent in training iterations.
"""
import argparse
import math
import os
import time

import numpy as np
import torch

from gpt_torch_model import GPT


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_data = os.environ.get("KILN_SHAKESPEARE") or (
        "../shared/data/tinyshakespeare.txt" if os.path.exists("../shared/data/tinyshakespeare.txt")
        else ".data/tinyshakespeare.txt")
    p.add_argument("--data", default=default_data)
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-iters", type=int, default=100)
    p.add_argument("--lr-decay-iters", type=int, default=0, help="0: --iters")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    t_start = time.perf_counter()
    decay_iters = args.lr_decay_iters or max(args.iters, args.warmup_iters + 1)

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = "cuda"
    text = open(args.data, "rb").read()
    vocab = sorted(set(text))
    lut = np.zeros(256, dtype=np.int64)
    lut[vocab] = np.arange(len(vocab))
    data = lut[np.frombuffer(text, dtype=np.uint8)]
    n = int(0.9 * len(data))
    splits = {"train": torch.from_numpy(data[:n]), "val": torch.from_numpy(data[n:])}
    B, T = args.batch_size, args.block_size

    def get_batch(split):
        d = splits[split]
        ix = torch.randint(len(d) - T, (B,))
        x = torch.stack([d[i:i + T] for i in ix])
        y = torch.stack([d[i + 1:i + 1 + T] for i in ix])
        return x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)

    model = GPT(len(vocab), T, args.n_layer, args.n_head, args.n_embd, args.dropout, bias=False).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99), fused=True)
    run_model = torch.compile(model) if args.compile else model

    def lr_at(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / args.warmup_iters
        if it >= decay_iters:
            return args.min_lr
        r = (it - args.warmup_iters) / (decay_iters - args.warmup_iters)
        return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * r))

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            total = torch.zeros((), device=dev)
            for _ in range(args.eval_iters):
                x, y = get_batch(split)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    total += run_model(x, y).float()
            out[split] = total.item() / args.eval_iters
        model.train()
        return out

    best_val, train_seconds = float("inf"), 0.0
    torch.cuda.synchronize()
    seg_start, seg_iters = time.perf_counter(), 0
    for it in range(args.iters + 1):
        if it % args.eval_interval == 0 or it == args.iters:
            torch.cuda.synchronize()
            seg = time.perf_counter() - seg_start
            train_seconds += seg
            losses = estimate_loss()
            best_val = min(best_val, losses["val"])
            ms = 1e3 * seg / seg_iters if seg_iters else 0.0
            print(f"iter {it} train {losses['train']:.4f} val {losses['val']:.4f} (lr {lr_at(it):.3g}, "
                  f"{ms:.1f} ms/iter)", flush=True)
            seg_start, seg_iters = time.perf_counter(), 0
        if it == args.iters:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        x, y = get_batch("train")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run_model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seg_iters += 1
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t_start
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}, compile={args.compile}, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
    print(f"RESULT best_val_loss={best_val:.4f} seconds={seconds:.1f} "
          f"tokens_per_second={args.iters * B * T / train_seconds:.0f}", flush=True)


if __name__ == "__main__":
    main()
