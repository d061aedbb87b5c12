"""Helpers for tests/tune: a tiny elementwise region and candidate modules written into tmp dirs.

A plain module (not conftest) so tests can import it; the name is unique across test folders."""

from __future__ import annotations

import textwrap
from pathlib import Path

from coopt.ir.region import RegionSummary, TensorSpec


def add_region(name: str = "r0") -> RegionSummary:
    """out = in0 + in1 over [B, 64] fp32, B symbolic (example 4)."""
    spec = TensorSpec(("B", 64), "float32")
    return RegionSummary(
        name=name,
        family="elementwise",
        inputs=(spec, spec),
        outputs=(spec,),
        attrs={"program": [["out", "add", ["in0", "in1"]]], "outputs": ["out"]},
        dims={"B": (1, 16)},
        example_dims={"B": 4},
    )


def write_module(directory: Path, stem: str, body: str) -> Path:
    """Write a candidate module `stem.py` whose source is `body` (dedented)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}.py"
    path.write_text(textwrap.dedent(body).lstrip())
    return path


ADD = """
    import torch

    def run(a, b):
        return (a + b,)
"""
