"""Template family "row_reduction": softmax / log_softmax / layer_norm / rms_norm over the last dim.

One program per row (rows = all leading dims flattened). With `single_pass` the whole row is one
BLOCK_N tile held in registers; otherwise the program walks the row in BLOCK_N chunks, once per
statistic and once to write, which is what rows too long for registers need. Statistics are
accumulated in fp32 and match torch: layer_norm uses the biased variance, rms_norm is
x * rsqrt(mean(x^2) + eps) * weight in fp32 then cast, softmax subtracts the row max (log_softmax
is x - max - log(sum(exp(x - max)))). With a
residual the kernel also writes h = x + residual and normalises h as stored (rounded to h's dtype),
as eager torch does.

Example:
    >>> family = RowReductionFamily()
    >>> family.param_space(region, H200)   # region: rms_norm over 4096 columns
    {'BLOCK_N': [128, 256, 512, 1024, 2048, 4096], 'num_warps': [1, 2, 4, 8],
     'single_pass': [True, False]}
    >>> family.check(region, {"BLOCK_N": 1024, "num_warps": 4, "single_pass": True}, H200)
    'single_pass needs BLOCK_N >= 4096 (the longest row)'
"""

from __future__ import annotations

from coopt.ir.region import RegionSummary
from coopt.targets import Target
from coopt.templates.base import TemplateFamily, max_extent, next_pow2, render_template
from coopt.templates.elementwise import FLOAT_DTYPES

KINDS = ("softmax", "log_softmax", "layer_norm", "rms_norm")
SOFTMAXES = ("softmax", "log_softmax")  # no eps, no affine part
LOOPED_BLOCKS = (128, 256, 512, 1024, 2048, 4096)
# Longer rows do not fit in registers (16384 fp32 over 8 warps is 64 per thread): loop instead.
MAX_SINGLE_PASS_BLOCK = 16384
NUM_WARPS = (1, 2, 4, 8)
MAX_ELEMENTS_PER_THREAD = 64


class RowReductionFamily(TemplateFamily):
    name = "row_reduction"

    def matches(self, region: RegionSummary) -> bool:
        if region.family != self.name:
            return False
        attrs = region.attrs
        kind = attrs.get("kind")
        n_inputs = 1 + sum(bool(attrs.get(k)) for k in ("residual", "has_weight", "has_bias"))
        return (
            kind in KINDS
            # as in torch: softmax has no affine part, rms_norm no bias
            and not (kind in SOFTMAXES and attrs.get("has_weight"))
            and not (kind != "layer_norm" and attrs.get("has_bias"))
            and len(region.inputs) == n_inputs
            and len(region.outputs) == (2 if attrs.get("residual") else 1)
            and len(region.inputs[0].shape) >= 1
            and self._row_length(region) is not None
            and all(spec.dtype in FLOAT_DTYPES for spec in region.outputs)
        )

    @staticmethod
    def _row_length(region: RegionSummary) -> int | None:
        """Longest row the kernel must handle (the last dim, at its maximum if symbolic)."""
        return max_extent(region.inputs[0].shape[-1], region)

    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        whole_row = next_pow2(self._row_length(region))
        blocks = [b for b in LOOPED_BLOCKS if b < whole_row]
        if whole_row <= MAX_SINGLE_PASS_BLOCK:
            blocks.append(whole_row)
        return {"BLOCK_N": blocks, "num_warps": list(NUM_WARPS), "single_pass": [True, False]}

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        block, num_warps, single_pass = params["BLOCK_N"], params["num_warps"], params["single_pass"]
        row_length = self._row_length(region)
        if single_pass and block < row_length:
            return f"single_pass needs BLOCK_N >= {row_length} (the longest row)"
        if single_pass and block > MAX_SINGLE_PASS_BLOCK:
            return f"single_pass rows over {MAX_SINGLE_PASS_BLOCK} do not fit in registers"
        if not single_pass and block >= row_length:
            return f"BLOCK_N={block} holds the whole row: use single_pass"
        threads = 32 * num_warps
        # one warp may hold a short row with lanes to spare; more warps would only idle
        if num_warps > 1 and block < threads:
            return f"BLOCK_N={block} leaves threads idle with num_warps={num_warps}"
        if block // threads > MAX_ELEMENTS_PER_THREAD:
            return f"BLOCK_N={block} is over {MAX_ELEMENTS_PER_THREAD} elements per thread with num_warps={num_warps}"
        return None

    def render(self, region: RegionSummary, params: dict) -> str:
        attrs = region.attrs
        residual = bool(attrs.get("residual"))
        return render_template(
            "triton/row_reduction.py.j2",
            region_name=region.name,
            kind=attrs["kind"],
            softmax_like=attrs["kind"] in SOFTMAXES,
            eps=float(attrs.get("eps", 0.0)),
            residual=residual,
            has_weight=bool(attrs.get("has_weight")),
            has_bias=bool(attrs.get("has_bias")),
            y_dtype=region.outputs[0].dtype,
            h_dtype=region.outputs[1].dtype if residual else None,
            BLOCK_N=params["BLOCK_N"],
            num_warps=params["num_warps"],
            single_pass=params["single_pass"],
        )
