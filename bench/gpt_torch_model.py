"""The GPT-2 model in plain PyTorch, shared by the references of examples/char_gpt (bench/char_gpt_torch.py)
and examples/gpt2_bench (bench/gpt2_torch.py): pre-LayerNorm blocks, causal SDPA attention, GELU (tanh)
MLP, learned positions, lm_head tied to the token embedding, GPT-2's initialization (normal 0.02, residual
projections 0.02 / sqrt(2 L), zero biases). Dropout modules exist only when dropout > 0, so a dropout-free
model runs no extra kernels."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


def _dropout(p):
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Block(nn.Module):
    def __init__(self, E, H, dropout=0.0, bias=True):
        super().__init__()
        self.H, self.dropout = H, dropout
        self.ln_1 = nn.LayerNorm(E, bias=bias)
        self.c_attn = nn.Linear(E, 3 * E, bias=bias)
        self.c_proj = nn.Linear(E, E, bias=bias)
        self.ln_2 = nn.LayerNorm(E, bias=bias)
        self.c_fc = nn.Linear(E, 4 * E, bias=bias)
        self.mlp_proj = nn.Linear(4 * E, E, bias=bias)
        self.drop = _dropout(dropout)

    def forward(self, x):
        B, T, E = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(E, dim=2)
        q, k, v = (t.view(B, T, self.H, E // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, E)))
        return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(self, V, T, L, H, E, dropout=0.0, bias=True, grad_checkpoint=False):
        super().__init__()
        self.grad_checkpoint = grad_checkpoint
        self.wte = nn.Embedding(V, E)
        self.wpe = nn.Embedding(T, E)
        self.drop = _dropout(dropout)
        self.h = nn.ModuleList(Block(E, H, dropout, bias) for _ in range(L))
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
        x = self.drop(self.wte(idx) + self.wpe.weight[:T])
        for block in self.h:
            if self.grad_checkpoint and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def num_params(self):
        """Parameters without the position embeddings (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
