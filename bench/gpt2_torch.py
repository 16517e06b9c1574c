#!/usr/bin/env python3
"""GPT-2 124M training throughput in plain PyTorch: the reference for examples/gpt2_bench.

The same model and step as gpt2_bench: 12 layers, 12 heads, width 768, context 1024, vocabulary 50304,
biases, no dropout, pre-LayerNorm blocks with F.scaled_dot_product_attention(is_causal=True) and a
GELU(tanh) MLP, lm_head tied to the token embedding; B=16 x T=1024 random tokens; bf16 autocast with f32
master weights; fused AdamW (lr 6e-4, betas (0.9, 0.95), weight decay 0.1 on the 2-D weights). Warm-up
steps, then timed steps between two torch.cuda.synchronize() calls, eager and torch.compile in turn:

    python3 bench/gpt2_torch.py                    # eager, then compile
    python3 bench/gpt2_torch.py --modes compile --grad-checkpoint

Prints one line per mode:
    RESULT eager tokens_per_second=... mfu=... peak_gib=... step_ms=...
    RESULT compile tokens_per_second=... mfu=... peak_gib=... step_ms=...
MFU = (6N + 12 L H Q T) * tokens/s / 989e12, N the parameters without the position embeddings (nanoGPT's
estimate_mfu); peak_gib = torch.cuda.max_memory_allocated() over the mode's whole run (model included).
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class Block(nn.Module):
    def __init__(self, E, H, bias=True):
        super().__init__()
        self.H = H
        self.ln_1 = nn.LayerNorm(E, bias=bias)
        self.c_attn = nn.Linear(E, 3 * E, bias=bias)
        self.c_proj = nn.Linear(E, E, bias=bias)
        self.ln_2 = nn.LayerNorm(E, bias=bias)
        self.c_fc = nn.Linear(E, 4 * E, bias=bias)
        self.mlp_proj = nn.Linear(4 * E, E, bias=bias)

    def attn(self, x):
        B, T, E = x.shape
        q, k, v = self.c_attn(x).split(E, dim=2)
        q, k, v = (t.view(B, T, self.H, E // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, E))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V, T, L, H, E, bias=True, grad_checkpoint=False):
        super().__init__()
        self.grad_checkpoint = grad_checkpoint
        self.wte = nn.Embedding(V, E)
        self.wpe = nn.Embedding(T, E)
        self.h = nn.ModuleList(Block(E, H, bias) for _ in range(L))
        self.ln_f = nn.LayerNorm(E, bias=bias)
        self.lm_head = nn.Linear(E, V, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("mlp_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * L))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe.weight[:T]
        for block in self.h:
            if self.grad_checkpoint and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def num_params(self):
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()


def run(mode, args):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    dev = "cuda"
    V, T, L, H, E, B = args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd, args.batch_size
    model = GPT(V, T, L, H, E, grad_checkpoint=args.grad_checkpoint).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=True)
    step_model = torch.compile(model) if mode == "compile" else model
    batches = [(torch.randint(0, V, (B, T), device=dev), torch.randint(0, V, (B, T), device=dev)) for _ in range(2)]

    def step(i):
        x, y = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    warmup = args.warmup + (2 if mode == "compile" else 0)  # compilation happens in the first steps
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(warmup + i)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0

    N = model.num_params()
    flops_per_token = 6 * N + 12 * L * H * (E // H) * T
    tps = args.steps * B * T / seconds
    mfu = flops_per_token * tps / 989e12
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"# {mode}: N = {N / 1e6:.2f}M, loss {loss.item():.4f}", flush=True)
    print(f"RESULT {mode} tokens_per_second={tps:.0f} mfu={mfu:.4f} peak_gib={peak:.2f} "
          f"step_ms={1e3 * seconds / args.steps:.1f}", flush=True)
    del model, opt, step_model, batches


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--grad-checkpoint", action="store_true")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    for mode in args.modes.split(","):
        run(mode.strip(), args)


if __name__ == "__main__":
    main()
