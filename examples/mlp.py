"""A two-layer MLP with a residual connection (KernelBench-style model file).

Sizes are small by default so the CPU build (Triton interpreter) is quick; set
COOPT_EXAMPLE_SIZE=bench for GPU-sized shapes and COOPT_EXAMPLE_DTYPE=bfloat16 for bf16.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BENCH = os.environ.get("COOPT_EXAMPLE_SIZE") == "bench"
DTYPE = getattr(torch, os.environ.get("COOPT_EXAMPLE_DTYPE", "float32"))
BATCH, HIDDEN, FFN = (4096, 4096, 16384) if BENCH else (8, 64, 256)


class Model(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def get_init_inputs():
    return [HIDDEN, FFN]


def get_inputs():
    return [torch.randn(BATCH, HIDDEN, dtype=DTYPE)]


def load_weights(model: nn.Module) -> None:
    model.to(DTYPE)
