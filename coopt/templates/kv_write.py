"""Template family "kv_write": one decode (or prefill) step's KV-cache write in one launch.

Region schema (coopt.ir.region, docs/kv-cache.md):

    attrs = {"rope": bool, "quant": "none" | "per-tensor" | "per-head" | "per-token",
             "inplace": [input indices written in place], ["headroom": float, per-token only],
             ["positions": "per-row", "index_input": 2, "index_bound": [0, 2]]}
    inputs: k_cache, v_cache [B_max, Hkv, S_max, D], positions [T] int32/int64,
            k, v [B, Hkv, T, D] (any strides, B <= B_max), [cos, sin broadcastable to k],
            [k_scale, v_scale: [1] / [Hkv] fp32 read, or per-token [B_max, Hkv, S_max] written]
    outputs: the inplace inputs after cache[:B, :, positions] = quant(rope(k)) (resp. v)

    Per row ("positions": "per-row", a ragged decode step): positions [B], k, v [B, Hkv, 1, D]:
    cache[b, :, positions[b]] = quant(rope(k[b, :, 0])), each sequence at its own position.

    Exact rows (fp8-kv-cache's exact-recent; attrs "exact_outputs": ["k"], ["v"] or ["k", "v"],
    quant per-tensor or per-head): after the written buffers, outputs [B, Hkv, T, D] of the rows
    as they are before rounding, rope(k) - k_offset (fp32 with an offset, else k's dtype) and
    v - v_offset (fp32), which attentions read unrounded.

    Values only (fp8-kv-cache's values-only; attrs "values_only": true, quant per-tensor or
    per-head): k_cache stays in k's dtype, v_cache float8_e4m3fn, and one scale input, v_scale:
    cache[..] = rope(k) for K, quant(v) for V.

    Paged (paged-kv; attrs "page_size": P, "page_table_input": last, "pool_input": 0): k_cache,
    v_cache are page pools [N_pages, Hkv, P, D] and a last input page_table [B, max_pages] int32;
    position p of sequence b is row p % P of page page_table[b, p // P] (per row or per token as
    above; any quant: per-token scale buffers are pools [N_pages, Hkv, P] paged alike, a row's
    scale stored at its page and row). Positions outside [0, max_pages * P) are not written;
    page ids are clamped into the pool.

Without the fusion a Llama layer's step launches a rope kernel for K and two index_put_ copies
(and with an fp8 cache two quantize kernels): four or five launches of a few µs each for a few
KB. Here one program handles BLOCK_R rows (b, head, t) of D elements: it loads the K and V
rows through their strides, rotates K in registers (rotate-half, as coopt.rope: partner element
d ± D/2, cos and sin through broadcast strides), quantizes (below) and stores both rows at
cache position positions[t]. Positions outside [0, S_max) are not written (the program's input
checks refuse them before any kernel runs; this only keeps timing with arbitrary inputs safe).

fp8 (float8_e4m3fn): q = clamp(x / s, -448, 448) rounded to nearest even; s is k_scale[0]
(per-tensor), k_scale[h] (per-head), or per-token s = max(absmax(row), 1e-12) · (headroom / 448) (fp8-kv-cache's formula),
computed here and stored at k_scale[b, h, positions[t]] next to the row (paged: at the row's page
and slot of the scale pool).

Knobs (explicit lists, pruned by `check`): BLOCK_R rows per program, num_warps.

Example (a Llama-3-8B decode step, bf16 cache of 4096 positions, rope on K):
    >>> from coopt.ir.region import RegionSummary, TensorSpec
    >>> from coopt.targets import H200
    >>> cache, row = TensorSpec((1, 8, 4096, 128), "bfloat16"), TensorSpec((1, 8, 1, 128), "bfloat16")
    >>> table = TensorSpec((1, 128), "float32")
    >>> region = RegionSummary("r3_kv_write", "kv_write",
    ...     inputs=(cache, cache, TensorSpec((1,), "int64"), row, row, table, table),
    ...     outputs=(cache, cache), attrs={"rope": True, "quant": "none", "inplace": [0, 1]})
    >>> KvWriteFamily().matches(region)
    True
    >>> KvWriteFamily().legal_points(region, H200)[:2]
    [{'BLOCK_R': 1, 'num_warps': 1}, {'BLOCK_R': 1, 'num_warps': 2}]
"""

from __future__ import annotations

from coopt.ir.region import RegionSummary
from coopt.runtime.pages import PAGE_SIZES
from coopt.targets import Target
from coopt.templates.base import TemplateFamily, dim_range, lane_fill_problem, next_pow2, render_template

BLOCK_ROWS = (1, 2, 4, 8, 16, 32)
NUM_WARPS = (1, 2, 4, 8)
# K, its rope partner, cos, sin and V per element: more than this per thread spills
MAX_ELEMENTS_PER_THREAD = 32
QUANT_MODES = ("none", "per-tensor", "per-head", "per-token")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
FP8 = "float8_e4m3fn"
MAX_HEAD_DIM = 512


class KvWriteFamily(TemplateFamily):
    name = "kv_write"

    def matches(self, region: RegionSummary) -> bool:
        attrs = region.attrs
        rope, quant = attrs.get("rope"), attrs.get("quant")
        if region.family != self.name or not isinstance(rope, bool) or quant not in QUANT_MODES:
            return False
        paged = attrs.get("page_size") is not None
        # smooth-k / smooth-v: K / V less a per-(head, channel) offset before quant
        offsets = [attrs.get("k_offset", False), attrs.get("v_offset", False)]
        if any(not isinstance(o, bool) or (o and quant not in ("per-tensor", "per-head")) for o in offsets):
            return False
        # values-only: K kept in its dtype (no K scale, no K offset), V quantized
        values_only = attrs.get("values_only", False)
        if not isinstance(values_only, bool) or (values_only and (quant not in ("per-tensor", "per-head") or offsets[0])):
            return False
        scales = (2 - values_only) * (quant != "none")
        want_inputs = 5 + 2 * rope + scales + sum(offsets) + paged
        inplace = [0, 1, 5 + 2 * rope, 6 + 2 * rope] if quant == "per-token" else [0, 1]
        if len(region.inputs) != want_inputs or list(attrs.get("inplace") or ()) != inplace:
            return False
        exact = attrs.get("exact_outputs", [])
        if not (isinstance(exact, list) and exact in ([], ["k"], ["v"], ["k", "v"])) \
                or (exact and quant not in ("per-tensor", "per-head")):
            return False
        if len(region.outputs) != len(inplace) + len(exact):
            return False
        k_cache, v_cache, positions, k, v = region.inputs[:5]
        if any(len(s.shape) != 4 for s in (k_cache, v_cache, k, v)) or len(positions.shape) != 1:
            return False
        per_row = attrs.get("positions", "shared")
        if per_row not in ("shared", "per-row"):
            return False
        # per row: one position per sequence, each writing its one token (T = 1)
        indexed = (k.shape[0], 1) if per_row == "per-row" else (k.shape[2], k.shape[2])
        head_dim = k_cache.shape[3]
        cache_dtype = FP8 if quant != "none" else k.dtype
        if paged and not self._paged_ok(region):
            return False
        # per-token: one scale per cache row, [B_max, Hkv, S_max] (paged: [N_pages, Hkv, P])
        if quant == "per-token" and any(s.shape != k_cache.shape[:3] for s in region.inputs[5 + 2 * rope:7 + 2 * rope]):
            return False
        # the offsets [1, Hkv, 1, D] fp32 (K's, then V's), after the scales
        first_offset = 5 + 2 * rope + scales
        if any(s.shape != (1, k_cache.shape[1], 1, k_cache.shape[3]) for s in region.inputs[first_offset:first_offset + sum(offsets)]):
            return False
        return (
            isinstance(head_dim, int) and 1 <= head_dim <= MAX_HEAD_DIM
            and (head_dim % 2 == 0 or not rope)
            and all(s.shape[3] == head_dim for s in (v_cache, k, v))
            and k_cache.shape[1] == v_cache.shape[1] == k.shape[1] == v.shape[1]
            and k.shape[2] == v.shape[2] == indexed[1] and positions.shape[0] == indexed[0]
            and positions.dtype in ("int32", "int64")
            # quantized, K and V may differ in dtype (exact-recent's centred keys are fp32 beside bf16
            # values: each row is widened to fp32 before its quant); stored as they are, they match
            and k.dtype in FLOAT_DTYPES and v.dtype in FLOAT_DTYPES and (quant != "none" or v.dtype == k.dtype)
            and k_cache.dtype == (k.dtype if values_only else cache_dtype) and v_cache.dtype == cache_dtype
            and all(len(s.shape) <= 4 and s.dtype in FLOAT_DTYPES for s in region.inputs[5:5 + 2 * rope])
            and all(s.dtype == "float32" for s in region.inputs[5 + 2 * rope:len(region.inputs) - paged])
            and [o.dtype for o in region.outputs[:len(inplace)]] == [region.inputs[i].dtype for i in inplace]
            and all(self._exact_output_ok(region, name, out) for name, out in zip(exact, region.outputs[len(inplace):]))
        )

    @staticmethod
    def _exact_output_ok(region: RegionSummary, name: str, out) -> bool:
        """An exact-rows output: the rows' shape, fp32 where an offset is subtracted, else the
        rope's result in k's dtype (a V row with neither is v itself, never an output)."""
        attrs, rows = region.attrs, region.inputs[3 if name == "k" else 4]
        offset, rope = attrs.get(f"{name}_offset", False), name == "k" and attrs["rope"]
        return (offset or rope) and out.shape == rows.shape and out.dtype == ("float32" if offset else rows.dtype)

    @staticmethod
    def _paged_ok(region: RegionSummary) -> bool:
        """The paged schema: pools [N, Hkv, P, D], page table [B, max_pages] int32 last."""
        attrs, table = region.attrs, region.inputs[-1]
        size = attrs.get("page_size")
        return (
            size in PAGE_SIZES
            and attrs.get("page_table_input") == len(region.inputs) - 1 and attrs.get("pool_input") == 0
            and region.inputs[0].shape[2] == region.inputs[1].shape[2] == size
            and len(table.shape) == 2 and table.dtype == "int32" and table.shape[0] == region.inputs[3].shape[0]
        )

    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        return {"BLOCK_R": list(BLOCK_ROWS), "num_warps": list(NUM_WARPS)}

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        space = self.param_space(region, target)
        for knob, values in space.items():
            if params.get(knob) not in values:
                return f"{knob}={params.get(knob)} is not in the space"
        block_r = params["BLOCK_R"]
        _, rows = dim_range(region, region.inputs[3].shape[:3])
        if rows is not None and block_r > next_pow2(rows):
            return f"BLOCK_R={block_r} exceeds the {rows} rows (b, head, t) of a step"
        elements = block_r * next_pow2(region.inputs[0].shape[3])
        if params["num_warps"] == min(NUM_WARPS) and elements < 32:
            return None  # a small step (few rows of a small D): one warp, some lanes idle, is all there is
        return lane_fill_problem(f"BLOCK_R={block_r} rows of D", elements, params["num_warps"], MAX_ELEMENTS_PER_THREAD)

    def render(self, region: RegionSummary, params: dict) -> str:
        attrs = region.attrs
        return render_template(
            "triton/kv_write.py.j2",
            region_name=region.name,
            BLOCK_R=params["BLOCK_R"],
            num_warps=params["num_warps"],
            rope=attrs["rope"],
            quant=attrs["quant"],
            per_row=attrs.get("positions") == "per-row",
            k_offset=bool(attrs.get("k_offset", False)),
            values_only=bool(attrs.get("values_only", False)),
            v_offset=bool(attrs.get("v_offset", False)),
            exact_outputs=attrs.get("exact_outputs", []),
            exact_dtypes=[o.dtype for o in region.outputs[len(region.outputs) - len(attrs.get("exact_outputs", [])):]],
            page_size=attrs.get("page_size") or 0,
            headroom=repr(float(attrs.get("headroom", 1.0))),
        )
