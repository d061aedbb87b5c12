"""The tiny Llama of examples/llama/model.py exported with a dynamic batch and sequence length:
one build serves prefill (T prompt tokens) and decode (T = 1) for 1..4 sequences.

A model file for `coopt build` (KernelBench convention), used by test_llama_generate.py. The
cache holds 4 sequences of 64 positions; the example call is a 3-token chunk at positions 8..10
of 2 sequences.
"""

from pathlib import Path

import torch

from coopt.frontend.model_file import import_model_file

MAX_BATCH, MAX_SEQ = 4, 64
llama = import_model_file(Path(__file__).resolve().parents[2] / "examples" / "llama" / "model.py")
Model = llama.Model


def get_init_inputs():
    return [llama.ModelArgs.from_preset("tiny"), MAX_BATCH, MAX_SEQ, "float32", 8, 0]


def get_inputs():
    tokens = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(1))
    return [tokens, torch.arange(8, 11)]


def dynamic_shapes():
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    length = torch.export.Dim("length", min=1, max=MAX_SEQ)
    return ({0: batch, 1: length}, {0: length})
