"""decode_attention: flash-decoding of one new token per sequence over a static KV cache.

Region schema (coopt.ir.region): q [B, H, 1, D] (any strides), k_cache / v_cache
[B, Hkv, S_max, D] (any strides), lengths [B] int32 or int64 with 1 <= lengths[b] <= S_max; output
[B, H, 1, D] in q's dtype. attrs {"scale", "num_heads", "num_kv_heads", "lengths_input": 3,
"lengths_bound": [1, 2]}, optionally "example_length" (the valid length the advisor plans
for; default S_max). The query of sequence b attends to cache positions 0 .. lengths[b] - 1
(causal for a decode step at position lengths[b] - 1); query head h reads kv head
h // (H // Hkv). A length outside [0, S_max] is clamped into it (never a read outside the cache)
and a length of 0 gives zeros.

fp8 cache (docs/kv-cache.md): k_cache / v_cache float8_e4m3fn, two more inputs k_scale, v_scale
(fp32; attrs "kv_scale": "per-tensor" [1], "per-head" [Hkv], "per-token" [B, Hkv, S_max]); the
cache is read as k * k_scale, v * v_scale. K/V tiles are loaded as fp8 and widened in registers
(to q's dtype for tl.dot: e4m3 is exact in bf16 / fp16; to fp32 for multiply and sum). A
per-tensor / per-head scale is one scalar per program (one kv head): K's is folded into the
softmax scale, V's multiplies the program's output once. Per-token scales are loaded with each
tile: the score columns are multiplied by k_scale[b, h, n], the probabilities (not l_i) by
v_scale[b, h, n] before P @ V.

Paged KV (issue 4; the runtime is coopt/runtime/paged.py): attrs add "page_size": P (a power of
two, 16..256); inputs q [B, H, 1, D], k_pages / v_pages [N_pages, Hkv, P, D] (pages shared by all
sequences), lengths [B] int32 or int64, page_table [B, max_pages] int32, then k_scale, v_scale when attrs
has "kv_scale" (per-tensor [1], per-head [Hkv], or per-token scale pools [N_pages, Hkv, P] paged
like the caches: a row's scale at the same page and row). Position p of sequence b is row p % P
of page page_table[b, p // P]; slots of page_table past cdiv(lengths[b], P) are never read,
lengths are clamped to max_pages * P and page ids into [0, N_pages). The kernel is the same
loop with page table lookups: one per tile where BLOCK_N divides P, one per key row (a gather
from the table row, L1-resident) where a tile covers BLOCK_N / P whole pages, so small pages
(16 positions: 4 KiB K tiles at D 128) do not force small tiles (both are powers of two: a tile
never holds part of two pages). kv_bytes_read is unchanged (the page table adds
B * max_pages * 4 bytes at most).

RoPE of the query (attrs "rope": True, from fuse-attention): input 0 is the query before its
rotary embedding and two inputs cos, sin (broadcastable to q, in q's dtype) follow the lengths /
page table, before any scales; the kernel rotates q as it loads it (rotate-half form, fp32,
rounded to q's dtype for tl.dot), so the step has no rope kernel for q.

The step's cache write folded in (attrs "kv_write": {"positions_input": i, "rope": bool}, from
fuse-kv-write-attention): unpaged caches, in q's dtype or fp8 with per-tensor / per-head scales
(below); inputs i, i + 1, i + 2 are positions [1] (one for every sequence), k_new and v_new
[B, Hkv, 1, D] in q's dtype, then with "rope" K's cos and sin (broadcastable to k_new) at
"rope_tables_input": i + 3, or 4 where they are the query's; outputs the two caches written in
place (attrs "inplace" [1, 2]) and then the attention's output. The region is index_put_ of
rope(k_new) / v_new at the position, then the attention over the written caches: the split
whose keys hold the position (the last split where none does) stores the row, then a barrier,
then its key loop reads it back as it reads any row, so the loop is the plain kernel's. No
other program reads that position. One launch and one round trip through memory a layer less
than kv_write then attention, at the plain attention's time (bench/RESULTS.md session 18).
An fp8 cache's write quantizes with the attention's own k_scale / v_scale (i = the scales' index
+ 2), as the kv_write template does: rope(k_new) rounded to k_new's dtype, less K's offset
[1, Hkv, 1, D] fp32 where the cache is stored centred (smooth-k: attrs kv_write
"k_offset_input"), over the scale, rounded to e4m3; V likewise ("v_offset_input", smooth-v). The
offsets are the region's last inputs. A values-only cache (K in q's dtype) stores K unquantized.

Kernel (flash-decoding's two stages in one launch):
    split    grid (B * Hkv, SPLIT_KV): one program per (sequence, kv head, split). Its rows are
             the H // Hkv query heads sharing that kv head (GQA packing: each K/V block is read
             once for the whole group). It takes an equal BLOCK_N-aligned share of the
             sequence's valid keys 0 .. lengths[b] - 1 and runs an online softmax over it in
             fp32; positions past lengths[b] are never loaded, and a split whose share is empty
             loads nothing. With SPLIT_KV = 1 it normalises and writes the output itself.
    merge    only when SPLIT_KV > 1, in the same launch: each split stores its fp32 partials
             (acc, max, sum) and counts itself in on a counter per (sequence, kv head); the last
             to arrive merges the splits that saw keys, in split order, and writes the output
             (templates/triton/_split_meeting.j2; a second kernel would cost a launch gap, ~1-2
             µs, as much as the whole attention at short lengths).

Bandwidth model: per cached position and kv head the kernel reads 2 * D * element-size bytes
(K and V rows; element size 1 for an fp8 cache, plus 2 * 4 bytes of per-token scales) and does 4 * D * (H // Hkv) flops: 2 * group / element-size flops per byte (4 for
Llama-3-8B in bf16), far below the ~190 (790 TFLOP/s over 4.2 TB/s) at which Hopper becomes
compute bound. So the time is bytes / bandwidth, and the bytes that must move are the valid K
and V rows, sum over b of lengths[b] * Hkv * (D * element size [+ 4]) * 2 (`kv_bytes_read`): an fp8
cache halves the floor (a bit less with per-token scales: (D + 4) / 2D at D 128 is 52%); q, the
output and the partials (B * H * SPLIT_KV * (D + 2) * 4 bytes written and read once) are small
beside them. On the H200 (4.2 TB/s measured copy bandwidth) one Llama-3-8B layer (Hkv 8, D 128,
bf16) at length 32768 reads 134 MB: 32 us is the floor the kernel must approach; at length
2048 it reads 8.4 MB (2 us), where the launch latency of two kernels matters as much. A
static-cache baseline reading all S_max positions pays for S_max instead of the length. To
stream at full bandwidth every SM needs a program: B * Hkv * SPLIT_KV should cover the 132 SMs
(the advisor picks SPLIT_KV from the length and the SM count, llm_advisor/heuristic_rules.py).

Knobs (explicit lists, pruned by `check`):
    BLOCK_N      cache positions per step (K and V tiles of BLOCK_N x D)
    SPLIT_KV     programs per (sequence, kv head); 1 = no merge. The space holds powers of two;
                 the template renders any count (bench/v_layout_probe.py --splits sweeps others)
    USE_DOT      scores and P @ V by tl.dot (group padded to 16 rows: tensor cores) or by
                 multiply and sum on CUDA cores (no padding: best for small groups and fp32)
    TILE_FP16    (fp8 cache with per-tensor / per-head scales, bf16 q) widen the e4m3 tiles to
                 fp16 and run both dots in fp16, q shifted by a power of two (_fp16_tiles_problem)
    num_warps, num_stages  launch options (stages pipeline the K/V loads)

Example (one decode step of a 32-head model with 8 kv heads, cache of 4096 positions):
    >>> from coopt.ir.region import RegionSummary, TensorSpec
    >>> from coopt.targets import H200
    >>> kv = TensorSpec((1, 8, 4096, 128), "bfloat16")
    >>> q = TensorSpec((1, 32, 1, 128), "bfloat16")
    >>> region = RegionSummary(
    ...     "layer0_attn", "decode_attention", inputs=(q, kv, kv, TensorSpec((1,), "int32")),
    ...     outputs=(q,), attrs={"scale": 128 ** -0.5, "num_heads": 32, "num_kv_heads": 8,
    ...                          "lengths_input": 3, "lengths_bound": [1, 2]})
    >>> family = DecodeAttentionFamily()
    >>> params = {"BLOCK_N": 64, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
    >>> family.check(region, params, H200) is None
    True
    >>> family.check(region, {**params, "SPLIT_KV": 128}, H200)
    'SPLIT_KV=128 is not in the space'
    >>> "atomic_add(arrivals_ptr" in family.render(region, params)  # the splits meet in one launch
    True
    >>> kv_bytes_read(region, [2048])  # K and V rows of 2048 positions, 8 kv heads, bf16
    8388608

The same step over an fp8 cache with per-head scales (BLOCK_N 128: the same bytes per tile):
    >>> fp8 = TensorSpec((1, 8, 4096, 128), "float8_e4m3fn")
    >>> scales = TensorSpec((8,), "float32")
    >>> fp8_region = RegionSummary(
    ...     "layer0_attn", "decode_attention", inputs=(q, fp8, fp8, TensorSpec((1,), "int32"), scales, scales),
    ...     outputs=(q,), attrs={**region.attrs, "kv_scale": "per-head"})
    >>> family.check(fp8_region, {**params, "BLOCK_N": 128}, H200) is None
    True
    >>> kv_bytes_read(fp8_region, [2048])  # half the bytes
    4194304

The same step through a page table: a pool of 1024 pages of 16 positions, up to 256 pages a
sequence (a tile lies in one page or covers whole pages: BLOCK_N 64 reads 4 pages a tile):
    >>> pages = TensorSpec((1024, 8, 16, 128), "bfloat16")
    >>> paged_region = RegionSummary(
    ...     "layer0_attn", "decode_attention",
    ...     inputs=(q, pages, pages, TensorSpec((1,), "int32"), TensorSpec((1, 256), "int32")),
    ...     outputs=(q,), attrs={**region.attrs, "page_size": 16})
    >>> family.matches(paged_region), family.check(paged_region, {**params, "BLOCK_N": 16}, H200) is None
    (True, True)
    >>> family.check(paged_region, params, H200) is None
    True
"""

from __future__ import annotations

import dataclasses
import math

from coopt.ir.region import (
    DTYPE_BYTES,
    RegionSummary,
    kv_write_inputs,
    kv_write_offsets,
    kv_write_rope,
    lengths_offset,
    rope_at,
)
from coopt.targets import Target
from coopt.templates.attention import (
    _TL_DTYPE,
    _TORCH_DTYPE,
    FP8_CACHE_DTYPE,
    exact_rows_at,
    exact_rows_problem,
    folded_exact,
    kv_cache_problem,
    kv_element_bytes,
    kv_scale,
    page_size,
    paged_problem,
    paged_schema_ok,
    ring_slots_at,
    without_exact_rows,
)
from coopt.templates.base import TemplateFamily, dim_range, next_pow2, render_template

# knobs some regions' spaces add, and their value where a point leaves them out
OPTIONAL_KNOBS = {"TILE_FP16": False, "V_WORDS": False}
_MAX_HEAD_DIM = 256
# Register budgets per thread, from ptxas -v for sm_90 (triton 3.9) over BLOCK_N x D x group x
# warps: multiply-and-sum materialises the [group, BLOCK_N, D] products in fp32, and up to 32 per
# thread stay under ~200 registers without spilling (64 reach 255 and spill); tl.dot keeps
# the K/V tile, the scores and the accumulator per thread: 16-bit operands feed the tensor cores
# from shared memory and fit at (tile + group x (BLOCK_N + D)) <= 160 per thread, fp32 (FMA dot
# on CUDA cores, operands in registers) at <= 64.
_MAX_PRODUCTS_PER_THREAD = 32
_MAX_DOT_VALUES_PER_THREAD = {"bf16/fp16": 160, "fp32": 64}
# fp8 tiles (same ptxas measurements, 2x32 heads over 8 kv heads, D 128): widening the loaded
# e4m3 tile to bf16 keeps both forms live, +40 registers at 4 warps (BLOCK_N 128: 171, no
# spill). At 8 warps an earlier template spilled at BLOCK_N 128 (80 values, ptxas stopping at
# 128 registers); session 19 compiled BLOCK_N 128 at 8 warps with Triton 3.6 and 3.9 at 165-179
# registers and no spill (fp16 and bf16 tiles, per-head and per-token scales, the write folded
# with rope and smooth-k): 80 values at 8 warps (D 256 stays out). tl.dot in fp32 on widened fp8
# tiles spills from 26 values on (BLOCK_N 32 at 8 warps, BLOCK_N 16 at 4: 255 registers, ~150
# spill instructions); BLOCK_N 16 at 8 warps (17 values) fits in 165-181.
_MAX_FP8_DOT_VALUES_PER_THREAD = {"bf16/fp16": 160, "bf16/fp16 8 warps": 80, "fp32": 24}
# Every thread should load at least one 16-byte vector of each K tile; fewer leaves warps idle.
_MIN_TILE_BYTES_PER_THREAD = 16


def _fp16_tiles_problem(region: RegionSummary) -> str | None:
    """Why TILE_FP16 does not apply to `region` (None: it does). It widens e4m3 K/V tiles to
    fp16, which sm_89+ converts two values an instruction (e4m3 -> bf16 takes several: the H200
    ran the bf16-widened fp8 kernel at 1.47 TB/s, the bf16 cache at 3.19), and runs both dots in
    fp16: q scaled into fp16's range by a power of two folded into the softmax scale, P in [0, 1].
    Per-token V scales weigh P itself (small scales would leave fp16's range): not with those."""
    if kv_scale(region) not in ("per-tensor", "per-head"):
        return "TILE_FP16 is for fp8 caches with per-tensor or per-head scales"
    if region.inputs[1].dtype != FP8_CACHE_DTYPE:
        return "TILE_FP16 widens e4m3 K tiles (keys kept in bf16 would be rounded to fp16)"
    if region.inputs[0].dtype != "bfloat16":
        return "TILE_FP16 is for a bf16 query (fp16 tiles are q's dtype already; fp32 keeps fp32)"
    return None


def _v_words_problem(region: RegionSummary) -> str | None:
    """Why V_WORDS does not apply to `region` (None: it does). With fp16 tiles (TILE_FP16) it
    reads V's tiles as 16-bit words of two e4m3 values and widens them to fp16 in the layout they
    load in; tl.dot then takes V through shared memory as fp16 (ldmatrix, transposed). Loaded as
    bytes, V goes from shared memory into the dot's operand layout one byte a load: its operand
    runs along the keys, which are D bytes apart (K, read along D, loads 8 bytes at a time either
    way; the sm_90 instruction counts are in docs/kv-cache.md). Needs whole rows of an even
    power-of-two D (no padded columns)."""
    problem = _fp16_tiles_problem(region)
    if problem is not None:
        return problem
    head_dim = region.inputs[0].shape[3]
    if not isinstance(head_dim, int) or head_dim < 16 or head_dim != next_pow2(head_dim):
        return "V_WORDS reads whole rows of a power-of-two head dim (>= 16)"
    return None


# The last split merges the partials of its GROUP heads: loaded for all heads at once (one round
# trip to L2 for all of them) when GROUP x SPLIT_KV x BLOCK_D fp32 values come to at most this many
# a thread; else head by head (each head's loads wait for the previous head's store: a round trip
# a head).
_MAX_MERGE_VALUES_PER_THREAD = 128


def scales_at(region: RegionSummary) -> int:
    """Index of k_scale (when fp8): after the lengths, the page table and the rope tables."""
    return 4 + (page_size(region) is not None) + 2 * bool(region.attrs.get("rope"))


def kv_bytes_read(region: RegionSummary, lengths) -> int:
    """Bytes the kernel must read from the caches for these valid lengths: K and V rows (1 byte
    an element in fp8; a values-only cache keeps K in q's dtype), and with per-token scales one
    fp32 K and one V scale per row."""
    _, kv_heads, _, head_dim = region.inputs[1].shape
    row_bytes = head_dim * (DTYPE_BYTES[region.inputs[1].dtype] + DTYPE_BYTES[region.inputs[2].dtype])
    if kv_scale(region) == "per-token":
        row_bytes += 2 * DTYPE_BYTES[region.inputs[scales_at(region)].dtype]
    return sum(int(n) for n in lengths) * kv_heads * row_bytes


def gathered_tables(region: RegionSummary) -> bool:
    """Whether the rotary tables are whole tables the kernel reads at the folded write's
    position (attrs kv_write "gathered_tables", fuse-kv-write-attention), not gathered rows."""
    folded = region.attrs.get("kv_write")
    return isinstance(folded, dict) and bool(folded.get("gathered_tables"))


def _table_ok(region: RegionSummary, table, rotated) -> bool:
    """A rotary table for the `rotated` input (q, or the folded write's k_new): in its dtype, and
    either a whole table [S, D] (S a static size >= 1) read at the write's position
    (`gathered_tables`) or rows that broadcast to it (rank <= 4, each dim 1 or the input's)."""
    shape, full = list(table.shape), list(rotated.shape)
    if table.dtype != rotated.dtype:
        return False
    if gathered_tables(region):
        return len(shape) == 2 and isinstance(shape[0], int) and shape[0] >= 1 and shape[1] == full[3]
    return len(shape) <= 4 and all(d == 1 or d == f for d, f in zip(shape[::-1], full[::-1]))


class DecodeAttentionFamily(TemplateFamily):
    name = "decode_attention"

    # -- shape facts -------------------------------------------------------------------
    @staticmethod
    def _group(region: RegionSummary) -> int:
        return region.attrs["num_heads"] // region.attrs["num_kv_heads"]

    @staticmethod
    def _block_d(region: RegionSummary) -> int:
        return max(16, next_pow2(region.inputs[0].shape[3]))

    def block_h(self, region: RegionSummary, use_dot: bool) -> int:
        """Rows of a program: the head group, padded to a power of two (16 for tl.dot)."""
        rows = next_pow2(self._group(region))
        return max(16, rows) if use_dot else rows

    def matches(self, region: RegionSummary) -> bool:
        if exact_rows_problem(region) is not None or (exact_rows_at(region) is not None and kv_write_inputs(region) is not None):
            return False
        region = without_exact_rows(region)  # (the rest's schema is the plain one)
        first_scale = scales_at(region)
        written = kv_write_inputs(region)
        if written is not None:  # the step's cache write folded in: its inputs last, the written caches first out
            if not self._kv_write_ok(region):
                return False
        elif len(region.inputs) not in (first_scale, first_scale + 2) or len(region.outputs) != 1:
            return False
        if region.family != self.name:
            return False
        q, k, v, lengths = region.inputs[:4]
        if any(len(s.shape) != 4 for s in (q, k, v, region.outputs[-1])) or len(lengths.shape) != 1:
            return False
        head_dim = q.shape[3]
        heads, kv_heads = region.attrs.get("num_heads"), region.attrs.get("num_kv_heads")
        return (
            isinstance(head_dim, int)
            and 1 <= head_dim <= _MAX_HEAD_DIM
            and q.shape[2] == 1
            and k.shape[3] == v.shape[3] == head_dim
            and isinstance(heads, int) and isinstance(kv_heads, int)
            and kv_heads >= 1 and heads % kv_heads == 0
            and all(s.dtype in _TL_DTYPE for s in (q, region.outputs[-1]))
            # k, v in q's dtype, or an fp8 cache with its scales (inputs 4, 5; 5, 6 when paged)
            and (written is not None or kv_cache_problem(region, first_scale) is None)  # (_kv_write_ok checked it)
            and (rope_at(region) is None or self._rope_ok(region))
            and (page_size(region) is None or paged_schema_ok(region))
            and q.shape[1] == heads and k.shape[1] == kv_heads
            and lengths.dtype in ("int32", "int64")
            # verification draws valid lengths only when the region names them (verify/strategies.py)
            and region.attrs.get("lengths_input") == 3
            and list(region.attrs.get("lengths_bound") or ()) == [1, 2]
        )

    @staticmethod
    def _kv_write_ok(region: RegionSummary) -> bool:
        """The folded write (fuse-kv-write-attention): unpaged caches, in q's dtype or fp8 with
        per-tensor / per-head scales (the attention's own: the kernel quantizes the row with
        them), one position for all sequences, k_new / v_new [B, Hkv, 1, D] in q's dtype, K's
        rotary tables broadcastable to k_new, then the offsets [1, Hkv, 1, D] fp32 of a cache
        stored centred (smooth-k / smooth-v, fp8 only); outputs the two caches written in place,
        then the output."""
        at = kv_write_inputs(region)
        q, k, v = region.inputs[:3]
        tables = kv_write_rope(region)
        own_tables = tables is not None and tables == at + 3
        k_offset, v_offset = kv_write_offsets(region)
        offsets = [i for i in (k_offset, v_offset) if i is not None]
        granularity = kv_scale(region)
        if (page_size(region) is not None or granularity not in (None, "per-tensor", "per-head")
                or at != scales_at(region) + 2 * (granularity is not None)
                or kv_cache_problem(dataclasses.replace(region, inputs=region.inputs[:at]), scales_at(region)) is not None
                or len(region.inputs) != at + 3 + 2 * own_tables + len(offsets) or len(region.outputs) != 3
                or list(region.attrs.get("inplace") or ()) != [1, 2]
                or (region.attrs["kv_write"].get("rope") and tables not in (at + 3, rope_at(region)))):
            return False
        positions, k_new, v_new = region.inputs[at:at + 3]
        if list(positions.shape) != [1] or positions.dtype not in ("int32", "int64"):
            return False
        if any(len(t.shape) != 4 or t.dtype != q.dtype or tuple(t.shape[1:]) != (k.shape[1], 1, k.shape[3])
               for t in (k_new, v_new)):
            return False
        if [o.dtype for o in region.outputs[:2]] != [k.dtype, v.dtype]:
            return False
        # each offset last, in order, and only for a cache stored in fp8
        end = len(region.inputs)
        if offsets != list(range(end - len(offsets), end)) or any(
                i is not None and (cache.dtype != FP8_CACHE_DTYPE or region.inputs[i].dtype != "float32"
                                   or tuple(region.inputs[i].shape) != (1, k.shape[1], 1, k.shape[3]))
                for i, cache in ((k_offset, k), (v_offset, v))):
            return False
        return all(_table_ok(region, table, k_new) for table in (region.inputs[tables:tables + 2] if tables is not None else ()))

    @staticmethod
    def _rope_ok(region: RegionSummary) -> bool:
        """cos and sin broadcast to q [B, H, 1, D] (rank <= 4, each dim 1 or q's), or whole
        tables [S, D] read at the folded write's position (attrs kv_write "gathered_tables");
        an even D."""
        q = region.inputs[0]
        at = rope_at(region)
        return all(_table_ok(region, table, q) for table in region.inputs[at:at + 2]) and q.shape[3] % 2 == 0

    # -- the space -----------------------------------------------------------------------
    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        space = {
            "BLOCK_N": [16, 32, 64, 128],
            "SPLIT_KV": [1, 2, 4, 8, 16, 32, 64],
            "USE_DOT": [False, True],
            "num_warps": [2, 4, 8],
            "num_stages": [1, 2, 3, 4],
        }
        if _fp16_tiles_problem(region) is None:  # an fp8 cache read by a bf16 query
            space["TILE_FP16"] = [False, True]
        if _v_words_problem(region) is None:
            space["V_WORDS"] = [False, True]
        return space

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        problem = exact_rows_problem(region)
        if problem is not None:
            return problem
        region = without_exact_rows(region)
        folded = kv_write_inputs(region) is not None  # a bf16 / fp32 unpaged cache (_kv_write_ok)
        problem = (None if folded else kv_cache_problem(region, scales_at(region))) or paged_problem(region)
        if problem is not None:
            return problem
        space = self.param_space(region, target)
        for knob, values in space.items():
            if params.get(knob, OPTIONAL_KNOBS.get(knob)) not in values:
                return f"{knob}={params.get(knob)} is not in the space"
        bn, split_kv, use_dot = params["BLOCK_N"], params["SPLIT_KV"], params["USE_DOT"]
        warps, stages = params["num_warps"], params["num_stages"]
        if params.get("TILE_FP16"):
            problem = _fp16_tiles_problem(region) or (None if use_dot else "TILE_FP16 widens fp8 tiles for tl.dot (USE_DOT=True)")
            if problem:
                return problem
        if params.get("V_WORDS"):
            problem = _v_words_problem(region) or (None if params.get("TILE_FP16") else "V_WORDS widens V for fp16 tiles (TILE_FP16=True)")
            if problem:
                return problem
        block_d, block_h = self._block_d(region), self.block_h(region, use_dot)
        elem = kv_element_bytes(region)  # K/V: 1 for an fp8 cache
        q_elem = DTYPE_BYTES[region.inputs[0].dtype]
        fp8 = kv_scale(region) is not None
        threads = 32 * warps
        paged = page_size(region)
        # (Paged: BLOCK_N and the page size are both powers of two, so a tile lies in one page or
        # covers whole pages; the kernel reads either.)
        # A K tile may cover the largest cache, never more; each split at least one K tile.
        # (Paged: the cache a page table addresses, max_pages x page_size.)
        cache_dims = [region.inputs[1].shape[2]] if paged is None else [region.inputs[4].shape[1], paged]
        _, max_length = dim_range(region, cache_dims)
        if max_length is not None and bn > max(16, next_pow2(max_length)):
            return f"BLOCK_N={bn} exceeds the cache (S_max <= {max_length})"
        if max_length is not None and split_kv > 1 and split_kv * bn > max_length:
            return f"SPLIT_KV={split_kv} splits of BLOCK_N={bn} exceed the cache (S_max <= {max_length})"
        smem = block_h * block_d * q_elem + 2 * bn * block_d * stages * elem
        if params.get("V_WORDS"):  # V's widened fp16 tile, staged for tl.dot
            smem += bn * block_d * 2
        if smem > target.smem_per_block_bytes:
            return f"{stages} K/V stages need {smem} B of shared memory > {target.smem_per_block_bytes} B"
        # An fp8 tile counts at its widened 16-bit size: a warp's 8-byte loads still read 256
        # contiguous bytes, and fewer warps would leave fewer threads to widen it.
        if warps > min(space["num_warps"]) and bn * block_d * max(elem, 2) < _MIN_TILE_BYTES_PER_THREAD * threads:
            return f"a {bn}x{block_d} K tile leaves some of {warps} warps without a 16-byte load"
        if use_dot:
            # the dot runs in q's dtype (fp8 tiles are widened to it)
            kind = "fp32" if q_elem == 4 else "bf16/fp16"
            values = (bn * block_d + block_h * (bn + block_d)) // threads
            if fp8:
                budget = _MAX_FP8_DOT_VALUES_PER_THREAD[kind + (" 8 warps" if kind != "fp32" and warps == 8 else "")]
            else:
                budget = _MAX_DOT_VALUES_PER_THREAD[kind]
            if values > budget:
                what = "fp8" if fp8 else kind
                return f"tl.dot on {bn}x{block_d} {what} K/V tiles over {warps} warps spills registers"
        elif block_h * bn * block_d // threads > _MAX_PRODUCTS_PER_THREAD:
            return f"{block_h}x{bn}x{block_d} products over {warps} warps spill registers"
        return None

    # -- rendering -------------------------------------------------------------------------
    def render(self, region: RegionSummary, params: dict) -> str:
        written, k_tables = kv_write_inputs(region), kv_write_rope(region)
        k_offset, v_offset = kv_write_offsets(region)
        head_dim = region.inputs[0].shape[3]
        scale = region.attrs.get("scale")
        block_d, group_p = self._block_d(region), next_pow2(self._group(region))
        # the merge's tl.arange over the splits: a power of two (renders any SPLIT_KV, the space's
        # powers of two and others a sweep tries, bench/v_layout_probe.py --splits)
        split_p = next_pow2(params["SPLIT_KV"])
        merged_values = group_p * split_p * block_d  # the last split's partials
        return render_template(
            "triton/decode_attention.py.j2",
            region_name=region.name,
            params={**OPTIONAL_KNOBS, **params},
            scale=repr(float(scale if scale is not None else 1.0 / math.sqrt(head_dim))),
            num_heads=region.attrs["num_heads"],
            num_kv_heads=region.attrs["num_kv_heads"],
            head_dim=head_dim,
            block_d=block_d,
            block_h=self.block_h(region, params["USE_DOT"]),
            # the merge loads every head's partials at once where they fit in registers
            merge_at_once=merged_values <= _MAX_MERGE_VALUES_PER_THREAD * 32 * params["num_warps"],
            group_p=group_p,
            split_p=split_p,
            ieee_dot=region.inputs[0].dtype == "float32",
            kv_scale=kv_scale(region),
            paged=page_size(region) is not None,
            page_size=page_size(region),
            rope=bool(region.attrs.get("rope")),
            # fp8 tiles are converted to what the scores are computed in: q's dtype for tl.dot
            # (e4m3 is exact in bf16 / fp16), fp32 for multiply and sum
            tile_tl_dtype=("tl.float16" if params.get("TILE_FP16") else _TL_DTYPE[region.inputs[0].dtype])
            if params["USE_DOT"] else "tl.float32",
            out_tl_dtype=_TL_DTYPE[region.outputs[-1].dtype],
            out_torch_dtype=_TORCH_DTYPE[region.outputs[-1].dtype],
            lengths_offset=lengths_offset(region),  # lengths = input 3 + this
            kv_write=written is not None,
            # the folded write quantizes what it stores in an fp8 cache, less a calibrated offset where given
            k_quant=written is not None and region.inputs[1].dtype == FP8_CACHE_DTYPE,
            v_quant=written is not None and region.inputs[2].dtype == FP8_CACHE_DTYPE,
            k_offset=k_offset is not None,
            v_offset=v_offset is not None,
            kv_rope=k_tables is not None,
            kv_own_tables=k_tables is not None and k_tables == written + 3,  # else the query's
            gathered=gathered_tables(region),
            exact_rows=exact_rows_at(region) is not None or folded_exact(region),
            exact_folded=folded_exact(region),  # the own rows the folded write's, the rings its positions'
            recent=region.attrs.get("recent"),
            ring=(region.attrs.get("recent") or 1) > 1,
            ring_write="ring_write" in region.attrs or (folded_exact(region) and region.attrs["recent"] > 1),
            ring_slots=ring_slots_at(region) is not None,  # paged-kv: row b's ring is ring_slots[b]'s
        )
