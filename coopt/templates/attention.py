"""attention: flash-attention forward, softmax(q k^T * scale [+ causal mask]) v, in one kernel.

Region schema (coopt.ir.region): q [B, H, Sq, D], k / v [B, Hkv, Sk, D] (any strides: q is
often a transpose view), output [B, H, Sq, D]; attrs {"causal", "scale", "num_heads",
"num_kv_heads"}. Query head h reads kv head h // (H // Hkv). A causal mask with Sq != Sk is
aligned to the bottom right (query i sees keys j <= i + Sk - Sq); a query that sees no key
gets zeros, as eager SDPA does.

A prompt over a KV cache (attrs "lengths_input": 3, a fourth input lengths [Sq]) may read an fp8
cache (docs/kv-cache.md): k / v float8_e4m3fn, inputs k_scale, v_scale (fp32, attrs "kv_scale":
"per-tensor" [1], "per-head" [Hkv], "per-token" [B, Hkv, Sk]), read as k * k_scale. K/V tiles are
loaded as fp8 (half the bytes) and widened to q's dtype for tl.dot (exact for e4m3); a
per-tensor / per-head K scale is folded into the softmax scale and the V scale multiplies each
program's output once; per-token scales multiply the score columns (K) and the probabilities
before P @ V (V), loaded with each tile. fp32 queries over an fp8 cache have no legal point.

Paged (paged-kv; attrs "page_size": P, "page_table_input": 4, "pool_input": 1): k / v are pools
[N, Hkv, P, D] and input 4 a page_table [B, max_pages] int32 (fp8 scales follow it; per-token
scales are pools [N, Hkv, P] paged alike); key j of sequence b is row j % P of page
page_table[b, j // P] (its scale: row j % P of that page of the scale pools), one lookup per K/V
block where BLOCK_N divides P, one per key row where a block covers BLOCK_N / P whole pages, and
the keys a sequence has are max_pages * P.

Online softmax with fp32 statistics and accumulator; each program owns BLOCK_M query rows and
streams K/V in BLOCK_N blocks: first the blocks every row may see (no masking), then the
partly visible ones (masked). A head dim that is not a power of two is padded with masks.

Knobs (explicit lists, pruned by `check`):
    BLOCK_M, BLOCK_N      query rows per program, keys per step
    PACK_GQA              (GQA only) one program takes the query rows of all H // Hkv heads
                          that share a kv head, so K/V are read once per group and a decode
                          step (Sq = 1) fills BLOCK_M with real rows instead of padding
    SPLIT_KV              flash-decoding: the keys of each row are split over SPLIT_KV programs
                          whose fp32 partials (acc, max, sum) a second kernel merges; for
                          small batch x heads x Sq that would leave SMs idle
    num_warps, num_stages launch options

Example (one decode step of a 32-head model with 8 kv heads, cache of up to 4096 positions):
    >>> from coopt.ir.region import RegionSummary, TensorSpec
    >>> from coopt.targets import H200
    >>> kv = TensorSpec((1, 8, "T", 128), "bfloat16")
    >>> region = RegionSummary(
    ...     "decode_attention", "attention",
    ...     inputs=(TensorSpec((1, 32, 1, 128), "bfloat16"), kv, kv),
    ...     outputs=(TensorSpec((1, 32, 1, 128), "bfloat16"),),
    ...     attrs={"causal": True, "scale": 128 ** -0.5, "num_heads": 32, "num_kv_heads": 8},
    ...     dims={"T": (1, 4096)})
    >>> family = AttentionFamily()
    >>> params = {"BLOCK_M": 16, "BLOCK_N": 64, "PACK_GQA": True, "SPLIT_KV": 16,
    ...           "num_warps": 4, "num_stages": 3}
    >>> family.check(region, params, H200) is None
    True
    >>> family.check(region, {**params, "BLOCK_M": 64}, H200)
    'BLOCK_M=64 exceeds the problem (at most 4)'
    >>> "_combine_splits_kernel[" in family.render(region, params)
    True
"""

from __future__ import annotations

import dataclasses
import math

from coopt.ir.region import DTYPE_BYTES, RegionSummary, TensorSpec
from coopt.runtime.pages import PAGE_SIZES
from coopt.targets import Target
from coopt.templates.base import TemplateFamily, dim_range, next_pow2, render_template

_TL_DTYPE = {"float32": "tl.float32", "bfloat16": "tl.bfloat16", "float16": "tl.float16"}
_TORCH_DTYPE = {"float32": "torch.float32", "bfloat16": "torch.bfloat16", "float16": "torch.float16"}

_MAX_HEAD_DIM = 256
_MAX_GRID_Y = 65535  # batch x heads go in grid dim 1
# fp32 values per thread of the S = q k^T tile plus the output accumulator above which the
# kernel spills registers (ptxas for sm_90, triton 3.9). bf16 runs on wgmma, operands in shared
# memory; fp32 (IEEE, no tensor cores) keeps its operand slices in registers too.
_MAX_TILE_REGS_PER_THREAD = {"bf16/fp16": 160, "fp32": 24}
# fp8 K/V tiles are widened in registers before tl.dot (same ptxas measurements, a prompt of 256
# over a 4096-position cache, 32 heads over 8, D 128): with at most 64 widened values of a K tile
# per thread no point spills more than a bf16 cache does; BLOCK_N 128 over 4 warps (128 values)
# spills at every BLOCK_M (2-61 spill instructions at 255 registers), over 8 warps it does not.
# An fp32 query over an fp8 cache spills at every legal fp32 tile (245-6400 spill instructions;
# the widened tiles in the CUDA-core dot's operand layout), so it has no point.
_MAX_FP8_TILE_VALUES_PER_THREAD = 64

# An fp8 KV cache (docs/kv-cache.md): K/V stored as float8_e4m3fn, read as k * k_scale.
FP8_CACHE_DTYPE = "float8_e4m3fn"
KV_SCALES = ("per-tensor", "per-head", "per-token")


def kv_scale(region: RegionSummary) -> str | None:
    """The fp8 cache's scale granularity (attrs "kv_scale"), None for a cache in q's dtype."""
    return region.attrs.get("kv_scale")


def _scale_shape(granularity: str, cache: TensorSpec) -> tuple:
    """[1] per tensor, [Hkv] per head, [B, Hkv, S] (one per cached row) per token: a paged cache
    [N, Hkv, P, D] has per-token scale pools [N, Hkv, P]."""
    return {"per-tensor": (1,), "per-head": (cache.shape[1],), "per-token": tuple(cache.shape[:3])}[granularity]


def kv_cache_problem(region: RegionSummary, scales_at: int) -> str | None:
    """Why k, v (inputs 1, 2) and the inputs from `scales_at` on break the cache contract, or None.

    A plain cache: k, v in q's dtype and no input from `scales_at` on. An fp8 cache (attrs
    "kv_scale"): k, v float8_e4m3fn, then exactly k_scale, v_scale, fp32, shaped by the
    granularity ([1], [Hkv] or k's [B, Hkv, S]). With per-tensor or per-head scales k may stay in
    q's dtype beside an fp8 v (fp8-kv-cache values-only: k_scale ones): the kernels widen k to
    their tile dtype as they would an fp8 tile, a no-op or exact.
    """
    q, k, v = region.inputs[:3]
    granularity = kv_scale(region)
    if granularity is None:
        if len(region.inputs) != scales_at:
            return f"{len(region.inputs)} inputs, expected {scales_at}"
        return None if q.dtype == k.dtype == v.dtype else "k / v dtype differs from q's without kv_scale"
    if granularity not in KV_SCALES:
        return f"kv_scale {granularity!r} is none of {', '.join(KV_SCALES)}"
    if len(region.inputs) != scales_at + 2:
        return f"an fp8 cache needs inputs k_scale, v_scale (got {len(region.inputs)} inputs)"
    if v.dtype != FP8_CACHE_DTYPE or k.dtype not in (FP8_CACHE_DTYPE, q.dtype):
        return f"kv_scale needs {FP8_CACHE_DTYPE} v and an {FP8_CACHE_DTYPE} k or one in q's dtype, got {k.dtype} / {v.dtype}"
    if k.dtype != FP8_CACHE_DTYPE and granularity == "per-token":
        return "a k in q's dtype beside an fp8 v (values-only) goes with per-tensor or per-head scales"
    for name, scale, cache in (("k_scale", region.inputs[scales_at], k), ("v_scale", region.inputs[scales_at + 1], v)):
        if scale.dtype != "float32":
            return f"{name} is {scale.dtype}, expected float32"
        if tuple(scale.shape) != _scale_shape(granularity, cache):
            return f"{name} shape {tuple(scale.shape)} is not {granularity} {_scale_shape(granularity, cache)}"
    return None


# fp8-kv-cache's exact-recent (attrs "exact_rows_input", "recent"): the last inputs, after the
# rest of either cached attention's schema, are k_exact, v_exact [B, Hkv, T, D] (this call's rows
# before rounding; T = 1 in a decode step) and, with "recent" > 1, the rings k_recent, v_recent
# [B_max >= B, Hkv, recent, D]; each query reads its newest "recent" keys from them (the
# semantics: coopt/ir/dialect.py, _CachedAttentionBase). A decode step may write its rows into
# the rings too (attrs "ring_write": {"positions_input": i, "per_row": bool}, fuse-attention):
# positions [1] (or [B] per row) last, the rings written in place (attrs "inplace", outputs the
# two rings, then the attention's output), each sequence's row at slot positions[b] % recent.
# With paged-kv the rings are pools [R, Hkv, recent, D] and row b's ring is pool[ring_slots[b]]
# (attrs "ring_slots_input": ring_slots [B] int32, the very last input).
def ring_slots_at(region: RegionSummary) -> int | None:
    """Index of ring_slots where a paged region reads each row's ring through it, else None."""
    return region.attrs.get("ring_slots_input")


def exact_rows_at(region: RegionSummary) -> int | None:
    """Index of k_exact where the region reads its queries' newest keys unrounded, else None."""
    return region.attrs.get("exact_rows_input")


# A decode step's exact-recent attention with its cache write folded in (fuse-kv-write-attention;
# attrs "exact_rows": "folded", "recent", "rings_input" where recent > 1): no k_exact / v_exact
# inputs, the own rows being what the folded write stores before rounding (rope(k_new), less
# K's offset; v_new, less V's), and the rings last, written in place at slot positions[0] %
# recent (inplace [1, 2, r, r + 1]; outputs the caches, the rings, the attention's output).
def folded_exact(region: RegionSummary) -> bool:
    """Whether the region's own exact rows are its folded write's rows before rounding."""
    return region.attrs.get("exact_rows") == "folded"


def folded_exact_dtypes(region: RegionSummary) -> tuple[str, str]:
    """The dtypes of a folded exact region's own K and V rows (and of its rings): what its write
    computes before rounding, fp32 where it subtracts an offset, else k_new's / v_new's."""
    folded = region.attrs["kv_write"]
    k_new, v_new = region.inputs[folded["positions_input"] + 1:folded["positions_input"] + 3]
    return ("float32" if folded.get("k_offset_input") is not None else k_new.dtype,
            "float32" if folded.get("v_offset_input") is not None else v_new.dtype)


def without_exact_rows(region: RegionSummary) -> RegionSummary:
    """The region less its exact rows, rings and ring write, for the checks of the rest of its schema."""
    if folded_exact(region):
        rings = region.attrs.get("rings_input")
        attrs = {k: v for k, v in region.attrs.items() if k not in ("exact_rows", "recent", "rings_input")}
        outputs = region.outputs if rings is None else (*region.outputs[:2], region.outputs[-1])
        return dataclasses.replace(region, inputs=region.inputs[:rings], outputs=outputs, attrs={**attrs, "inplace": [1, 2]})
    at = exact_rows_at(region)
    if at is None:
        return region
    attrs = {k: v for k, v in region.attrs.items() if k != "ring_slots_input"}
    if "ring_write" not in region.attrs:
        return dataclasses.replace(region, inputs=region.inputs[:at], attrs=attrs)
    attrs = {k: v for k, v in attrs.items() if k not in ("ring_write", "inplace")}
    return dataclasses.replace(region, inputs=region.inputs[:at], outputs=region.outputs[-1:], attrs=attrs)


def _rings_problem(region: RegionSummary, rings, window: int, slots=None) -> str | None:
    """Why `rings` are not [B_max >= B, Hkv, window, D] of the region's query and caches, or with
    `slots` (paged-kv's ring_slots) pools [R, Hkv, window, D] and slots [B] int32 (None: they are)."""
    q, k = region.inputs[:2]
    batch = q.shape[0]
    rows = "R" if slots is not None else "B_max >= B"
    if any(tuple(t.shape[1:]) != (k.shape[1], window, q.shape[3]) for t in rings):
        return f"the rings are not [{rows}, Hkv, {window}, D]"
    if slots is not None:  # any R: row b's ring is the pool's ring_slots[b]
        if slots.dtype != "int32" or tuple(slots.shape) != (batch,) or not rings:
            return "ring_slots: [B] int32 after the rings' pools"
    elif any(not (t.shape[0] == batch or not isinstance(batch, int) or (isinstance(t.shape[0], int) and t.shape[0] >= batch))
             for t in rings):
        return f"the rings are not [{rows}, Hkv, {window}, D]"
    return None


def _folded_exact_problem(region: RegionSummary) -> str | None:
    """Why a folded exact region breaks its schema (None: it fits)."""
    window, folded = region.attrs.get("recent"), region.attrs.get("kv_write")
    if not isinstance(window, int) or window < 1 or kv_scale(region) not in ("per-tensor", "per-head") \
            or not isinstance(folded, dict):
        return "folded exact rows need a folded write into fp8 caches with per-tensor or per-head scales, recent >= 1"
    at = region.attrs.get("rings_input")
    rings = region.inputs[at:] if at is not None else ()
    if (window > 1) != (at is not None) or len(rings) != 2 * (window > 1):
        return "folded exact rows: the two rings last where recent > 1"
    want = folded_exact_dtypes(region)
    if [t.dtype for t in rings] != list(want[:len(rings)]):
        return f"the rings hold the rows before rounding: {' and '.join(want)}"
    inplace = [1, 2, at, at + 1] if rings else [1, 2]
    if list(region.attrs.get("inplace") or ()) != inplace or len(region.outputs) != len(inplace) + 1 \
            or [o.dtype for o in region.outputs[2:-1]] != [t.dtype for t in rings]:
        return "folded exact rows: the caches, then the rings, written in place, then the output"
    return _rings_problem(region, rings, window)


def exact_rows_problem(region: RegionSummary) -> str | None:
    """Why the exact rows and rings break their schema (None: they fit, or there are none)."""
    if folded_exact(region):
        return _folded_exact_problem(region)
    at, window = exact_rows_at(region), region.attrs.get("recent")
    if at is None:
        return None
    if not isinstance(window, int) or window < 1 or kv_scale(region) is None:
        return "exact rows need an fp8 cache and attrs recent >= 1"
    q, k = region.inputs[:2]
    written = region.attrs.get("ring_write")
    rings_end = at + 2 + 2 * (window > 1)
    rows, rings = region.inputs[at:at + 2], region.inputs[at + 2:rings_end]
    slots_at = ring_slots_at(region)
    inputs = region.inputs
    if slots_at is not None:  # paged-kv's ring_slots: the very last input
        if slots_at != len(inputs) - 1:
            return "ring_slots is not the last input"
        inputs = inputs[:-1]
    if len(rows) != 2 or len(rings) != 2 * (window > 1) or any(t.dtype not in _TL_DTYPE for t in (*rows, *rings)):
        return f"exact rows: k_exact, v_exact{' and two rings' if window > 1 else ''} of floats last"
    if written is not None:
        positions = inputs[rings_end:]
        if (window == 1 or q.shape[2] != 1 or written.get("positions_input") != rings_end or len(positions) != 1
                or positions[0].dtype not in ("int32", "int64")
                or tuple(positions[0].shape) != ((q.shape[0],) if written.get("per_row") else (1,))
                or list(region.attrs.get("inplace") or ()) != [at + 2, at + 3] or len(region.outputs) != 3
                or [o.dtype for o in region.outputs[:2]] != [r.dtype for r in rings]):
            return "a ring write: a decode step's positions last, the two rings written in place, then the output"
    elif len(inputs) != rings_end:
        return "inputs past the exact rows and rings"
    if any(tuple(t.shape) != (q.shape[0], k.shape[1], q.shape[2], q.shape[3]) for t in rows):
        return "k_exact / v_exact are not [B, Hkv, T, D] of the query's B, T and D"
    return _rings_problem(region, rings, window, None if slots_at is None else region.inputs[slots_at])


def kv_element_bytes(region: RegionSummary) -> int:
    """Bytes of the larger of a K and a V element (1 for an fp8 cache; a values-only cache keeps
    K in q's dtype): what a tile of either takes in shared memory at most."""
    return max(DTYPE_BYTES[region.inputs[1].dtype], DTYPE_BYTES[region.inputs[2].dtype])


# Paged KV (paged-kv, docs/kv-cache.md): pools of pages of P positions read through a page table.
def page_size(region: RegionSummary) -> int | None:
    """Positions per page of a paged KV cache (attrs "page_size"), None for a cache per sequence."""
    return region.attrs.get("page_size")


def paged_problem(region: RegionSummary) -> str | None:
    """Why a paged region (attrs "page_size") breaks the paged schema, or None (also when not paged):
    q, k_pages / v_pages [N, Hkv, P, D], lengths, page_table [B, max_pages] int32 (input 4), then
    k_scale, v_scale of an fp8 cache (per-tensor, per-head, or per-token pools [N, Hkv, P] that
    `kv_cache_problem` checks). decode_attention and attention (a prompt over the cache) share it."""
    size = page_size(region)
    if size is None:
        return None
    if size not in PAGE_SIZES:
        return f"page_size={size} is none of {PAGE_SIZES}"
    if len(region.inputs) < 5:
        return f"paged KV needs a page_table input 4 (got {len(region.inputs)} inputs)"
    q, k, v, _, table = region.inputs[:5]
    if k.shape[2] != size or v.shape[2] != size:
        return f"k / v pages hold {k.shape[2]} / {v.shape[2]} positions, page_size is {size}"
    if len(table.shape) != 2 or table.dtype != "int32" or table.shape[0] != q.shape[0]:
        return f"page_table {list(table.shape)} {table.dtype} is not [B, max_pages] int32"
    return None


def paged_schema_ok(region: RegionSummary) -> bool:
    """Whether a paged region has the paged schema (True for a region that is not paged)."""
    return paged_problem(region) is None


class AttentionFamily(TemplateFamily):
    name = "attention"

    # -- shape facts -------------------------------------------------------------------
    @staticmethod
    def _head_dim(region: RegionSummary) -> int | str:
        return region.inputs[0].shape[3]

    @staticmethod
    def _group(region: RegionSummary) -> int:
        return region.attrs["num_heads"] // region.attrs["num_kv_heads"]

    @staticmethod
    def _query_lengths(region: RegionSummary) -> bool:
        """A prompt over a KV cache: input 3 holds one key count per query position."""
        return region.attrs.get("lengths_input") == 3 and list(region.attrs.get("lengths_bound") or ()) == [1, 2]

    @classmethod
    def _paged(cls, region: RegionSummary) -> bool:
        """A prompt over a paged KV cache (paged-kv): k / v are page pools, input 4 the page table."""
        return cls._query_lengths(region) and page_size(region) is not None

    @classmethod
    def _scales_at(cls, region: RegionSummary) -> int:
        """Index of k_scale (fp8): after q, k, v, [lengths], [page_table]."""
        return 3 + cls._query_lengths(region) + cls._paged(region)

    def matches(self, region: RegionSummary) -> bool:
        if (exact_rows_problem(region) is not None or "ring_write" in region.attrs
                or (exact_rows_at(region) is not None and not self._query_lengths(region))):
            return False  # (the rings' write is a decode step's: a prompt's rows overwrite slots other queries read)
        region = without_exact_rows(region)  # (the rest's schema is the plain one)
        lengths = self._query_lengths(region)
        # only a prompt over a KV cache (lengths) reads an fp8 cache, with its two scales, or pages
        fp8 = lengths and kv_scale(region) is not None
        if region.family != self.name or len(region.inputs) != self._scales_at(region) + 2 * fp8 or len(region.outputs) != 1:
            return False
        if self._paged(region) and not paged_schema_ok(region):
            return False
        q, k, v = region.inputs[:3]
        if lengths and (region.attrs.get("causal") or region.inputs[3].shape != (q.shape[2],)
                        or region.inputs[3].dtype not in ("int32", "int64")):
            return False
        if any(len(s.shape) != 4 for s in (q, k, v, region.outputs[0])):
            return False
        head_dim = self._head_dim(region)
        heads, kv_heads = region.attrs.get("num_heads"), region.attrs.get("num_kv_heads")
        return (
            isinstance(head_dim, int)
            and 1 <= head_dim <= _MAX_HEAD_DIM
            and k.shape[3] == v.shape[3] == head_dim
            and isinstance(heads, int) and isinstance(kv_heads, int)
            and kv_heads >= 1 and heads % kv_heads == 0
            and all(s.dtype in _TL_DTYPE for s in (q, region.outputs[0]))
            and kv_cache_problem(region, self._scales_at(region)) is None
        )

    # -- the space -----------------------------------------------------------------------
    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        return {
            "BLOCK_M": [16, 32, 64, 128],
            "BLOCK_N": [16, 32, 64, 128],
            "PACK_GQA": [False, True] if self._group(region) > 1 else [False],
            "SPLIT_KV": [1, 2, 4, 8, 16],
            "num_warps": [4, 8],
            "num_stages": [1, 2, 3, 4],
        }

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        problem = exact_rows_problem(region)
        region = without_exact_rows(region)
        problem = problem or kv_cache_problem(region, self._scales_at(region)) or (paged_problem(region) if self._paged(region) else None)
        if problem is not None:
            return problem
        bm, bn, warps, stages = params["BLOCK_M"], params["BLOCK_N"], params["num_warps"], params["num_stages"]
        block_d = max(16, next_pow2(self._head_dim(region)))
        q_elem = DTYPE_BYTES[region.inputs[0].dtype]
        kv_elem = kv_element_bytes(region)
        if params["PACK_GQA"] and self._group(region) == 1:
            return "PACK_GQA needs grouped kv heads (num_heads > num_kv_heads)"
        smem = bm * block_d * q_elem + 2 * bn * block_d * stages * kv_elem
        if smem > target.smem_per_block_bytes:
            return f"q tile and {stages} K/V stages need {smem} B of shared memory > {target.smem_per_block_bytes} B"
        regs_kind = "fp32" if region.inputs[0].dtype == "float32" else "bf16/fp16"
        if bm * (block_d + bn) // (32 * warps) > _MAX_TILE_REGS_PER_THREAD[regs_kind]:
            return f"{bm}x{bn} scores and {bm}x{block_d} accumulator over {warps} warps spill registers"
        if kv_scale(region) is not None:
            if regs_kind == "fp32":
                return "an fp32 query over an fp8 cache spills registers at every tile (widened K/V)"
            if bn * block_d // (32 * warps) > _MAX_FP8_TILE_VALUES_PER_THREAD:
                return f"widening {bn}x{block_d} fp8 K/V tiles over {warps} warps spills registers"
        if warps == 8 and bm < 64:
            return f"8 warps on {bm} query rows leave most threads idle"
        # A tile may cover the largest problem, never more (floor 16: tl.dot's minimum).
        _, sq_hi = dim_range(region, [region.inputs[0].shape[2]])
        if self._paged(region):
            # (BLOCK_N and the page size are powers of two: a block lies in one page or covers whole pages)
            _, pages_hi = dim_range(region, [region.inputs[4].shape[1]])
            sk_hi = None if pages_hi is None else pages_hi * page_size(region)
        else:
            _, sk_hi = dim_range(region, [region.inputs[1].shape[2]])
        rows_hi = None if sq_hi is None else sq_hi * (self._group(region) if params["PACK_GQA"] else 1)
        for knob, size, hi in (("BLOCK_M", bm, rows_hi), ("BLOCK_N", bn, sk_hi)):
            if hi is not None and size > max(16, next_pow2(hi)):
                return f"{knob}={size} exceeds the problem (at most {hi})"
        batch_hi = dim_range(region, [region.inputs[0].shape[0]])[1]
        heads = region.attrs["num_kv_heads" if params["PACK_GQA"] else "num_heads"]
        if batch_hi is not None and batch_hi * heads > _MAX_GRID_Y:
            return f"batch x heads = {batch_hi * heads} programs exceed CUDA's grid limit {_MAX_GRID_Y}"
        split_kv = params["SPLIT_KV"]
        if split_kv > 1:
            if sk_hi is not None and sk_hi < 2 * split_kv * bn:
                return f"SPLIT_KV={split_kv} leaves fewer than 2 key blocks of {bn} per split (Sk <= {sk_hi})"
            programs = self._programs(region, params)
            if programs >= target.num_sms:
                return f"{programs} programs already fill {target.num_sms} SMs without SPLIT_KV"
        return None

    def _programs(self, region: RegionSummary, params: dict) -> int:
        """Programs of the smallest problem in the region's range, before splitting keys."""
        q_shape = region.inputs[0].shape
        batch_lo, _ = dim_range(region, [q_shape[0]])
        sq_lo, _ = dim_range(region, [q_shape[2]])
        if params["PACK_GQA"]:
            rows, heads = sq_lo * self._group(region), region.attrs["num_kv_heads"]
        else:
            rows, heads = sq_lo, region.attrs["num_heads"]
        return -(-rows // params["BLOCK_M"]) * batch_lo * heads

    # -- rendering -------------------------------------------------------------------------
    def render(self, region: RegionSummary, params: dict) -> str:
        head_dim = self._head_dim(region)
        scale = region.attrs.get("scale")
        dtype = region.inputs[0].dtype
        return render_template(
            "triton/attention.py.j2",
            region_name=region.name,
            params=params,
            causal=bool(region.attrs["causal"]),
            query_lengths=self._query_lengths(region),
            scale=repr(float(scale if scale is not None else 1.0 / math.sqrt(head_dim))),
            num_heads=region.attrs["num_heads"],
            num_kv_heads=region.attrs["num_kv_heads"],
            head_dim=head_dim,
            block_d=max(16, next_pow2(head_dim)),
            ieee_dot=dtype == "float32",
            kv_scale=kv_scale(region) if self._query_lengths(region) else None,
            paged=self._paged(region),
            page_size=page_size(region),
            tile_tl_dtype=_TL_DTYPE[dtype],  # fp8 K/V tiles are widened to q's dtype for tl.dot
            out_tl_dtype=_TL_DTYPE[region.outputs[0].dtype],
            out_torch_dtype=_TORCH_DTYPE[region.outputs[0].dtype],
            exact_rows=exact_rows_at(region) is not None,
            recent=region.attrs.get("recent"),
            ring=(region.attrs.get("recent") or 1) > 1,
            ring_slots=ring_slots_at(region) is not None,  # paged-kv: row b's ring is ring_slots[b]'s
        )
