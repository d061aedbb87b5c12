"""A MiniGPT-style transformer block: pre-LayerNorm, causal self-attention written out
explicitly (q k^T · scale, masked_fill with a causal buffer, softmax, · v) and a GELU MLP.

Small by default; COOPT_EXAMPLE_SIZE=bench for GPU-sized shapes, COOPT_EXAMPLE_DTYPE for dtype.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BENCH = os.environ.get("COOPT_EXAMPLE_SIZE") == "bench"
DTYPE = getattr(torch, os.environ.get("COOPT_EXAMPLE_DTYPE", "float32"))
BATCH, SEQ, EMBED, HEADS = (8, 1024, 1024, 16) if BENCH else (2, 16, 64, 4)


class CausalSelfAttention(nn.Module):
    def __init__(self, embed: int, heads: int, max_seq: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(embed, 3 * embed)
        self.proj = nn.Linear(embed, embed)
        self.register_buffer("mask", torch.tril(torch.ones(max_seq, max_seq)).view(1, 1, max_seq, max_seq))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Model(nn.Module):
    def __init__(self, embed: int, heads: int, max_seq: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(embed)
        self.attn = CausalSelfAttention(embed, heads, max_seq)
        self.ln2 = nn.LayerNorm(embed)
        self.fc = nn.Linear(embed, 4 * embed)
        self.proj = nn.Linear(4 * embed, embed)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def get_init_inputs():
    return [EMBED, HEADS, SEQ]


def get_inputs():
    return [torch.randn(BATCH, SEQ, EMBED, dtype=DTYPE)]


def load_weights(model: nn.Module) -> None:
    model.to(DTYPE)
