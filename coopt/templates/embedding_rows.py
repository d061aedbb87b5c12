"""Template family "embedding_rows": a decode step's embedding gather with the first norm's row statistics.

Region: fuse-norm-statistics makes it where the first layer's norm GEMV reads the embedding;
inputs table, ids, g, outputs h = table[ids], hg = h * g, sq (the chunk sums of h^2) as
coopt/ir/region.py's contract for embedding_rows says.

Why: at 32 rows the first layer's norm otherwise runs after ATen's embedding kernel in a row
kernel of its own (the GEMV's NORM_FIRST): two launches and their gaps (~3.5 µs of a b32 / 2048
step, bench/NOTES-decode.md). One kernel gathers the rows and writes what the norm GEMV of every
later layer reads from its producer. A program holds its whole row in registers: rows over
16384 columns (64 elements a thread at 8 warps) have no legal point and run the reference.

Example:
    >>> family = EmbeddingRowsFamily()
    >>> family.param_space(region, H200)   # K = 4096
    {'num_warps': [1, 2, 4, 8]}
    >>> family.check(region, {"num_warps": 1}, H200)
    'one row of 4096 is over 64 elements per thread with num_warps=1'
"""

from __future__ import annotations

from coopt.ir.region import RegionSummary
from coopt.targets import Target
from coopt.templates.base import TemplateFamily, lane_fill_problem, next_pow2, render_template
from coopt.templates.elementwise import FLOAT_DTYPES

NUM_WARPS = (1, 2, 4, 8)
MAX_ELEMENTS_PER_THREAD = 64  # h in fp32 and its square per element


class EmbeddingRowsFamily(TemplateFamily):
    name = "embedding_rows"

    def matches(self, region: RegionSummary) -> bool:
        if region.family != self.name or len(region.inputs) != 3 or len(region.outputs) != 3:
            return False
        table, ids, g = region.inputs
        chunk = (region.attrs.get("row_squares") or {}).get("chunk")
        width = table.shape[1] if len(table.shape) == 2 else None
        return (isinstance(width, int) and isinstance(chunk, int) and chunk > 0
                and chunk == next_pow2(chunk) and width % chunk == 0
                and ids.dtype in ("int64", "int32") and table.dtype in FLOAT_DTYPES and g.dtype == table.dtype
                and g.shape == (width,))

    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        return {"num_warps": list(NUM_WARPS)}

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        width = region.inputs[0].shape[1]
        return lane_fill_problem(f"one row of {width}", next_pow2(width), params["num_warps"], MAX_ELEMENTS_PER_THREAD)

    def render(self, region: RegionSummary, params: dict) -> str:
        return render_template("triton/embedding_rows.py.j2", region_name=region.name,
                               chunk=region.attrs["row_squares"]["chunk"], num_warps=params["num_warps"])
