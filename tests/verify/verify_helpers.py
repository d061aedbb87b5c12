"""Shared helpers for tests/verify: regions and small module files written into tmp_path."""

from __future__ import annotations

import textwrap
from pathlib import Path

from coopt.ir.region import RegionSummary, TensorSpec


def write_module(directory: Path, name: str, source: str) -> Path:
    """Write `directory/name.py` from an indented source string; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def vector_region(dtype: str = "float32", lo: int = 1, hi: int = 4096) -> RegionSummary:
    """out = f(x, y) on 1-D tensors of symbolic length n."""
    spec = TensorSpec(("n",), dtype)
    return RegionSummary("ew0", "elementwise", (spec, spec), (spec,),
                         dims={"n": (lo, hi)}, example_dims={"n": min(hi, 64)})


def matrix_region(dtype: str = "float32") -> RegionSummary:
    """out = f(x) on [rows, cols] with both dims symbolic."""
    spec = TensorSpec(("rows", "cols"), dtype)
    return RegionSummary("rr0", "row_reduction", (spec,), (spec,),
                         dims={"rows": (1, 512), "cols": (1, 512)},
                         example_dims={"rows": 8, "cols": 32})


# out = x * y + 1 (the reference every vector candidate is checked against)
MUL_ADD_REFERENCE = """
    import torch

    def run(x, y):
        return (x * y + 1.0,)
"""

# Wrong on the last element, only when n is odd: the shrinker must find the odd edge.
ODD_TAIL_BUG = """
    def run(x, y):
        out = x * y + 1.0
        if x.shape[0] % 2 == 1:
            out[-1] = 0.0
        return (out,)
"""
