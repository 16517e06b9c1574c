"""PyTorch references for bench/kernels_bench.cpp: the same ops, shapes and dtypes, timed the same way
(CUDA events, median after warm-up). Prints `TORCH <name> <ms>` lines."""
import math
import torch
import torch.nn.functional as F

from bench_util import median_ms, report

dev = "cuda"


torch.manual_seed(0)
with torch.no_grad():
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    report("gemm_bf16_8192", median_ms(lambda: a @ b, 3, 10, 2))
    del a, b
    x = torch.randn(8192, 768, device=dev, dtype=torch.bfloat16)
    w = torch.randn(3072, 768, device=dev, dtype=torch.bfloat16)
    bias = torch.randn(3072, device=dev, dtype=torch.bfloat16)
    report("linear_gelu_bf16_8192x768x3072", median_ms(lambda: F.gelu(F.linear(x, w, bias), approximate="tanh")))

for dt, sfx in ((torch.float32, "_f32"), (torch.bfloat16, "_bf16")):
    x = torch.randn(16384, 4096, device=dev, dtype=dt)
    w = torch.randn(4096, device=dev, dtype=dt)
    b = torch.randn(4096, device=dev, dtype=dt)
    with torch.no_grad():
        report("copy" + sfx, median_ms(lambda: x.clone()))
        report("layernorm_fwd" + sfx, median_ms(lambda: F.layer_norm(x, (4096,), w, b)))
        report("softmax" + sfx, median_ms(lambda: torch.softmax(x, -1)))
        report("gelu" + sfx, median_ms(lambda: F.gelu(x, approximate="tanh")))
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    bg = b.clone().requires_grad_(True)
    dy = torch.randn_like(x)
    y = F.layer_norm(xg, (4096,), wg, bg)

    def ln_bwd():
        xg.grad = wg.grad = bg.grad = None
        y.backward(dy, retain_graph=True)

    report("layernorm_bwd" + sfx, median_ms(ln_bwd))
    del x, xg, dy, y

logits = torch.randn(8192, 50304, device=dev, dtype=torch.bfloat16, requires_grad=True)
target = torch.randint(0, 50304, (8192,), device=dev)


def ce():
    logits.grad = None
    F.cross_entropy(logits, target).backward()


def ce_autocast():
    logits.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(logits, target)
    loss.backward()


# Kiln's fused loss computes in f32 from bf16 logits, as autocast has PyTorch do (it runs the loss in
# f32): that is the reference. Plain bf16 PyTorch (log-probabilities rounded to bf16) is the second row.
report("cross_entropy_fwd_bwd_bf16_8192x50304", median_ms(ce_autocast))
report("cross_entropy_fwd_bwd_bf16_8192x50304@plain_bf16", median_ms(ce))
# the same work (loss and the logits' gradient) for Kiln's one-pass in-place kernel
report("cross_entropy_in_place_bf16_8192x50304", median_ms(ce_autocast))
del logits

# GPT-2's residual step under bf16 autocast: h = x + delta, y = layer_norm(h) (f32 under autocast, cast to
# bf16 by the next matmul: here explicitly), forward and backward with gradients on h and y.
M, C = 16384, 768
x = torch.randn(M, C, device=dev, requires_grad=True)
delta = torch.randn(M, C, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(C, device=dev, requires_grad=True)
b = torch.randn(C, device=dev, requires_grad=True)
gh = torch.randn(M, C, device=dev)
gy = torch.randn(M, C, device=dev, dtype=torch.bfloat16)


def add_ln():
    x.grad = delta.grad = w.grad = b.grad = None  # gradients assigned, not accumulated
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = x + delta
        y = F.layer_norm(h, (C,), w, b).to(torch.bfloat16)
    torch.autograd.backward([h, y], [gh, gy])


report("add_layer_norm_fwd_bwd_bf16_16384x768", median_ms(add_ln))
del x, delta, w, b, gh, gy

# a linear layer's bias gradient under autocast (f32 master bias: the bf16 gradient summed in f32), and the
# MLP's GELU backward with it (autograd: the GELU's backward kernel, then the sum)
for N in (768, 2304):
    dy = torch.randn(16384, N, device=dev, dtype=torch.bfloat16)
    report(f"bias_gradient_bf16_16384x{N}", median_ms(lambda: dy.sum(0, dtype=torch.float32)))
dy = torch.randn(16384, 3072, device=dev, dtype=torch.bfloat16)
z = torch.randn(16384, 3072, device=dev, dtype=torch.bfloat16)


def gelu_bias_grad():
    dz = torch.ops.aten.gelu_backward(dy, z, approximate="tanh")
    return dz, dz.sum(0, dtype=torch.float32)


report("gelu_bias_gradient_bf16_16384x3072", median_ms(gelu_bias_grad))
del dy, z

shapes = [(50304, 768), (1024, 768)]
for _ in range(12):
    shapes += [(768,), (768,), (2304, 768), (2304,), (768, 768), (768,), (768,), (768,), (3072, 768), (3072,), (768, 3072), (768,)]
shapes += [(768,), (768,)]
params = [torch.randn(s, device=dev, requires_grad=True) for s in shapes]
for p in params:
    p.grad = torch.randn_like(p)
opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
report("adamw_step_124M_f32", median_ms(opt.step))
