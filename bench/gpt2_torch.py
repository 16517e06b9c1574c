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

Under torchrun with several ranks (torchrun --nproc-per-node 2 bench/gpt2_torch.py) it runs PyTorch DDP
(NCCL, one GPU a rank, torch.compile of the DDP-wrapped model in compile mode), each rank its own batches;
tokens/s counts every rank's tokens, MFU is per GPU, and rank 0 alone prints (with world=N).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

from gpt_torch_model import GPT


def run(mode, args):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    dev = f"cuda:{torch.cuda.current_device()}"
    V, T, L, H, E, B = args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd, args.batch_size
    model = GPT(V, T, L, H, E, grad_checkpoint=args.grad_checkpoint).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=True)
    wrapped = model
    if world > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
        if args.comm_bf16:  # the gradients all-reduced as bf16 (gpt2_bench --comm-bf16 does the same)
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            wrapped.register_comm_hook(None, default_hooks.bf16_compress_hook)
    step_model = torch.compile(wrapped) if mode == "compile" else wrapped
    gen = torch.Generator(device=dev).manual_seed(1 + rank)  # each rank its own batches
    batches = [(torch.randint(0, V, (B, T), device=dev, generator=gen),
                torch.randint(0, V, (B, T), device=dev, generator=gen)) for _ in range(2)]

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
    tps = args.steps * B * T * world / seconds
    mfu = flops_per_token * tps / (989e12 * world)
    peak = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        print(f"# {mode}: N = {N / 1e6:.2f}M, loss {loss.item():.4f}", flush=True)
        print(f"RESULT {mode} tokens_per_second={tps:.0f} mfu={mfu:.4f} peak_gib={peak:.2f} "
              f"step_ms={1e3 * seconds / args.steps:.1f} world={world}", flush=True)
    del model, wrapped, opt, step_model, batches


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
    p.add_argument("--comm-bf16", action="store_true", help="DDP: all-reduce the gradients as bf16")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one GPU a rank
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    for mode in args.modes.split(","):
        run(mode.strip(), args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
