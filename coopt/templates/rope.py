"""Template family "rope": rotary position embedding, out = x·cos + rotate_half(x)·sin.

In a decoder, RoPE is six ATen ops per projection (two slices, neg, cat, two muls and an add):
as separate kernels they each read and write the activation. One kernel reads x, cos and sin
once and writes the result once; it reads x through its strides, so the slice of a merged
q|k|v projection needs no copy.

Example:
    >>> family = RopeFamily()
    >>> family.param_space(region, H200)
    {'BLOCK_R': [1, 2, 4, 8, 16, 32], 'num_warps': [1, 2, 4, 8]}
"""

from __future__ import annotations

from coopt.ir.region import RegionSummary
from coopt.targets import Target
from coopt.templates.base import TemplateFamily, lane_fill_problem, next_pow2, render_template

BLOCK_ROWS = (1, 2, 4, 8, 16, 32)
NUM_WARPS = (1, 2, 4, 8)
MAX_ELEMENTS_PER_THREAD = 64  # x, its partner, cos and sin per element: more spills
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class RopeFamily(TemplateFamily):
    name = "rope"

    def matches(self, region: RegionSummary) -> bool:
        if region.family != self.name or len(region.inputs) != 3 or len(region.outputs) != 1:
            return False
        x = region.inputs[0]
        d = x.shape[-1] if x.shape else None
        return (
            isinstance(d, int) and d % 2 == 0
            and len(x.shape) <= 4
            and all(len(spec.shape) <= 4 for spec in region.inputs)
            and x.dtype in FLOAT_DTYPES
        )

    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        return {"BLOCK_R": list(BLOCK_ROWS), "num_warps": list(NUM_WARPS)}

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        elements = params["BLOCK_R"] * next_pow2(region.inputs[0].shape[-1])
        return lane_fill_problem(f"BLOCK_R={params['BLOCK_R']} rows of D", elements, params["num_warps"], MAX_ELEMENTS_PER_THREAD)

    def render(self, region: RegionSummary, params: dict) -> str:
        return render_template(
            "triton/rope.py.j2", region_name=region.name, BLOCK_R=params["BLOCK_R"], num_warps=params["num_warps"]
        )
