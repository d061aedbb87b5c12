"""A Llama-style decoder layer: RMSNorm, rotary embeddings, grouped-query attention (SDPA with
enable_gqa), SwiGLU MLP, residual connections. Prefill of one sequence batch.

Small by default; COOPT_EXAMPLE_SIZE=bench gives Llama-3-8B layer dims (hidden 4096, 32 heads,
8 KV heads, FFN 14336), COOPT_EXAMPLE_DTYPE=bfloat16 for bf16.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BENCH = os.environ.get("COOPT_EXAMPLE_SIZE") == "bench"
DTYPE = getattr(torch, os.environ.get("COOPT_EXAMPLE_DTYPE", "float32"))
if BENCH:
    BATCH, SEQ, HIDDEN, HEADS, KV_HEADS, FFN = 1, 2048, 4096, 32, 8, 14336
else:
    BATCH, SEQ, HIDDEN, HEADS, KV_HEADS, FFN = 2, 16, 64, 4, 2, 160


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Model(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, max_seq: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.attn_norm = RMSNorm(hidden)
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.w_gate = nn.Linear(hidden, ffn, bias=False)
        self.w_up = nn.Linear(hidden, ffn, bias=False)
        self.w_down = nn.Linear(ffn, hidden, bias=False)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(max_seq).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


def get_init_inputs():
    return [HIDDEN, HEADS, KV_HEADS, FFN, SEQ]


def get_inputs():
    return [torch.randn(BATCH, SEQ, HIDDEN, dtype=DTYPE)]


def load_weights(model: nn.Module) -> None:
    model.to(DTYPE)
