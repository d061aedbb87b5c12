"""Template family "elementwise": one fused pointwise program over broadcast inputs.

The region's program (see `coopt.ir.region`) becomes the body of a 1-D Triton kernel over the
output's elements: each input is read at its broadcast position (host-computed strides, 0 on
broadcast dims, unravelled against the output shape left-padded to 4-D), the program runs in
fp32 and every output is stored in its own dtype.

Example:
    >>> family = ElementwiseFamily()
    >>> family.param_space(region, H200)
    {'BLOCK': [128, 256, 512, 1024, 2048, 4096], 'num_warps': [1, 2, 4, 8]}
    >>> source = family.render(region, {"BLOCK": 1024, "num_warps": 4})
"""

from __future__ import annotations

from coopt.ir.region import ELEMENTWISE_FNS, RegionSummary
from coopt.targets import Target
from coopt.templates.base import TemplateFamily, lane_fill_problem, max_extent, next_pow2, render_template
from coopt.templates.ewprogram import render_program

MAX_RANK = 4  # the kernel unravels indices over at most 4 dims
BLOCKS = (128, 256, 512, 1024, 2048, 4096)
NUM_WARPS = (1, 2, 4, 8)
# More elements than this per thread spills registers once a program has a few inputs.
MAX_ELEMENTS_PER_THREAD = 64
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class ElementwiseFamily(TemplateFamily):
    name = "elementwise"

    def matches(self, region: RegionSummary) -> bool:
        if region.family != self.name or not region.inputs:
            return False
        program = region.attrs.get("program", [])
        outputs = region.attrs.get("outputs", [])
        return (
            len(outputs) == len(region.outputs) > 0
            and all(fn in ELEMENTWISE_FNS for _, fn, _ in program)
            and all(len(spec.shape) <= MAX_RANK for spec in (*region.inputs, *region.outputs))
            and all(spec.dtype in FLOAT_DTYPES for spec in region.outputs)
        )

    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        # Blocks far larger than the biggest output only idle lanes: keep the first that covers it.
        numel = 1
        for dim in region.outputs[0].shape:
            extent = max_extent(dim, region)
            numel = numel * extent if extent is not None else None
            if numel is None:
                break
        blocks = [b for b in BLOCKS if numel is None or b <= max(BLOCKS[0], next_pow2(numel))]
        return {"BLOCK": blocks, "num_warps": list(NUM_WARPS)}

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        block = params["BLOCK"]
        return lane_fill_problem(f"BLOCK={block}", block, params["num_warps"], MAX_ELEMENTS_PER_THREAD)

    def render(self, region: RegionSummary, params: dict) -> str:
        input_names = [f"in{i}" for i in range(len(region.inputs))]
        names = {name: name for name in input_names}  # loaded inputs are locals of the same name
        program_lines = render_program(region.attrs.get("program", []), names, dialect="triton")
        return render_template(
            "triton/elementwise.py.j2",
            region_name=region.name,
            input_names=input_names,
            output_names=list(region.attrs["outputs"]),
            output_values=[names[out] for out in region.attrs["outputs"]],
            output_dtypes=[spec.dtype for spec in region.outputs],
            program_lines=program_lines,
            BLOCK=params["BLOCK"],
            num_warps=params["num_warps"],
        )
