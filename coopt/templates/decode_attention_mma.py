"""decode_attention_mma: decode attention over an fp8 (e4m3) or bf16 KV cache in CUDA C++ on tensor cores.

The same regions as `decode_attention` (templates/decode_attention.py documents the schema: q
[B, H, 1, D], caches [B, Hkv, S_max, D], lengths, optional query RoPE, the step's cache write
folded in, or caches in pages read through a page table), narrowed to what this kernel implements:
both caches float8_e4m3fn with per-tensor or per-head scales, K bf16 beside an e4m3 V with such
scales (fp8-kv-cache's values-only; K's scale is ones), or both bf16 (no scales), rows of
D = 128 elements stored contiguously, a bf16 query and output, and
a head group GROUP = H / Hkv of at most 8. Where it matches it is one more family of candidates
beside the Triton template, verified and timed like them; the build keeps the fastest that
verifies.

Why CUDA: the Triton template's fp8 loop costs ~1060 instructions a 128-key tile (widening e4m3
to fp16 and moving V's bytes into tl.dot's operand one at a time) and streams at 2.5-3.3 TB/s;
this kernel feeds mma.sync m16n8k16 straight from shared memory and measured 21.65 µs against
the template's 26.55 at b1 / 32768 and 66.86 (4.02 TB/s, 96 % of the copy bandwidth) against
82.64 at b1 / 131072 on the H200 (bench/cuda_fp8_attention_probe.py, bench/RESULTS.md session 26).

Layout of the work (as measured in the probe): SPLIT blocks a (sequence, kv head), each taking
an equal CHUNK-aligned share of the valid keys; each of a block's warps streams its own CHUNK-key
pieces (chunks warp, warp + WARPS, ...) through its own num_stages-slot cp.async ring, so warps
never wait for each other inside the loop; rows past the length are zero-filled by the copy. The
copies go through the L1 (COPY "ca") or past it ("cg"): with "cg" the loop read every cache sector
twice from L2 (ncu), and "ca" at 8 warps is the form that reached 4 TB/s. The block's warps merge
in shared memory, the blocks in global memory: the last to arrive (one thread's acq_rel count
after a block barrier, no fence in every thread) merges the SPLIT partials, all loaded in one
round trip, and zeroes its counter (one launch, as the Triton template's splits meet); at SPLIT 1 the block
writes its output straight from its warps' merge (no partials, fence or count: -3.7 µs a launch at
b32 / 2048, session 28). Every load that waits for no other (length, position, scales, q and its
rope partners) goes out at the start, and every ring slot fills before q is rotated (q's math
sits under `if (mine > 0)`: without the branch ptxas hoisted it above the copies, session 34's
SASS); a chunk whose rows all lie below the length is copied from per-lane addresses (a lane's
piece is the same in every row it copies), without zero-fill operands; the step's new row
(the folded write) is computed by the warp whose chunk holds it, stored, and written into its
ring slot when that chunk lands, so no block waits at a barrier for it (b1 / 2048 bf16 folded
7.57 µs against 8.45, bench/RESULTS.md session 34); q and the
rotary tables are read 16 bytes at a time only (run() copies a view whose rows are not
contiguous and 16-byte aligned: a strided fallback beside each load cost ~1 µs, session 29). Through a page table each
copied row looks up its page (an L1-resident load; ids clamped into the pool), so a chunk may span
pages of any size.

The dots: scores S[16 rows = heads (GROUP real), 8 keys] = q[16, 16 dims] K^T, eight k-steps
over the head dim, which is permuted the same way for q and K (so the dot is unchanged) so that a
lane's K bytes are one 32-byte run; the output O^T[16 dims, 8 heads] = V^T P^T with dims as M (32
accumulator floats a lane), P^T's fragment being the score fragment itself, V's key pairs
assembled by prmt. e4m3 widens to f16 exactly (cvt.rn.f16x2.e4m3x2). q goes to fp16 shifted by a
power of two (its largest |value| into (2^13, 2^14], exact for bf16 values; the shift joins K's
scale in the score scale, as the Triton template's TILE_FP16 does); P in [0, 1] is rounded to
fp16 for the PV dot.

A bf16 cache (session 32) runs the same kernel with rows of 256 bytes (16 pieces, the second
half's swizzle flipping one more bit so a warp's loads meet no bank twice), the dots on bf16
operands (mma.sync m16n8k16 bf16: q as it is, no shift; K's words straight from shared memory;
V's key pairs by prmt; P rounded to bf16, as the Triton template's tl.dot(p.to(v.dtype), v)). It
is after the b1 / 2048 step's attention latency (~8 µs a layer over 2 µs of bytes in the Triton
template, bench/NOTES-decode.md). A values-only cache (session 34) takes each cache's own path:
K's 256-byte rows and the bf16 score dots, V's 128-byte rows and the fp16 PV dots over widened
e4m3 (the rows of the two caches copied by separate loops where their sizes differ).

fp8-kv-cache's exact-recent (session 44): each sequence's newest N <= 16 keys are read unrounded,
not from the cache. The key loop stops at length - N; the window's keys are spread over the last
split's warps, key d (d = 0 the own row) to warp (chunks + d) % WARPS, so the own row goes to the
warp after its last chunk's (the fewest chunks). Each such warp copies its keys' rows (ring slots;
the own row from k_exact / v_exact, or with the write folded in, the row it computes before
rounding) into shared memory with its first ring copies, and after its loop weighs them as one
more online-softmax step (scores from q's dot operands in fp32, V over V's scale into the
accumulator); after the block's barrier the own row's warp stores the step's rows into the rings.
Session 44 had one warp weigh the whole window (b32 / 2048 on the H100: 50.4 µs a layer against
49.0 without the window; b1 / 32768: 29.5 against 27.6, session 45): a serial tail of that warp
the block waited for.

Numerics against the Triton template: a query rotated here is rounded to bf16 (as the unfused
rope stores it) before the shift; the folded write rounds rope(k_new) to bf16, subtracts a
smooth-k / smooth-v offset, divides by the scale (IEEE) and rounds to e4m3 with the hardware's
round-to-nearest-even, saturating at 448, which is the kv_write template's result.

Verification needs the GPU: the family offers no point where torch sees no CUDA device (CPU CI
renders the kernel and compiles it for sm_90a (NVRTC or nvcc: tests/conftest.py compile_for_hopper);
tests/templates/test_decode_attention_mma.py).

Knobs: SPLIT (blocks a (sequence, kv head)), CHUNK (keys a warp's ring slot), COPY ("ca", "cg"),
num_warps (4 or 8), num_stages (ring slots), MEET (how 2-8 splits meet: "global", the partials
in global memory and the last block to arrive merging them, or "cluster", the splits one
thread-block cluster merging through distributed shared memory, each block 1/SPLIT of the
outputs; optional, "global" where a point lacks it). The cluster passed its GPU tests on an H100
(session 36) and ran 0.41 µs faster than global memory folded at b1 / 2048 on the H200 (session 37).
"""

from __future__ import annotations

import math

from coopt.ir.region import (
    RegionSummary,
    kv_write_inputs,
    kv_write_offsets,
    kv_write_rope,
    lengths_offset,
)
from coopt.targets import Target
from coopt.templates.attention import (
    FP8_CACHE_DTYPE,
    exact_rows_at,
    exact_rows_problem,
    folded_exact,
    folded_exact_dtypes,
    kv_scale,
    page_size,
    ring_slots_at,
    without_exact_rows,
)
from coopt.templates.base import TemplateFamily, cuda_point_problem, render_template
from coopt.templates.decode_attention import DecodeAttentionFamily, gathered_tables

OPTIONAL_KNOBS = {"MEET": "global"}  # a point without it (from a cache, an older advisor) meets in global memory
MAX_CLUSTER = 8  # the portable cluster size: past it the launch needs a non-portable attribute and whole GPCs free
HEAD_DIM = 128  # the kernel's rows: 128 elements (e4m3: eight 16-byte pieces; bf16: sixteen)
MAX_GROUP = 8  # query heads a kv head: the PV dot's N (heads 2t, 2t + 1 of the 4 lane columns)
MAX_RECENT = 16  # exact-recent's window: its rows in shared memory, a score a row in registers
EXACT_DTYPES = {"float32": 4, "bfloat16": 2}  # an exact row's element bytes


def bf16_cache(region: RegionSummary) -> bool:
    """Both caches bf16 (no scales): the kernel's 256-byte rows and bf16 dots."""
    return kv_scale(region) is None and all(c.dtype == "bfloat16" for c in region.inputs[1:3])


def element_bytes(region: RegionSummary) -> tuple[int, int]:
    """Bytes of a K and of a V cache element: 2 (bf16), 1 (e4m3)."""
    return tuple(1 if cache.dtype == FP8_CACHE_DTYPE else 2 for cache in region.inputs[1:3])


def exact_rows_dtypes(region: RegionSummary) -> tuple[str, str] | None:
    """The dtypes of a region's exact rows (K's, V's: fp8-kv-cache's exact-recent), else None: its
    k_exact / v_exact inputs', or folded, what its write computes before rounding (fp32 where it
    subtracts an offset, else k_new's / v_new's)."""
    if folded_exact(region):
        return folded_exact_dtypes(region)
    at = exact_rows_at(region)
    return None if at is None else (region.inputs[at].dtype, region.inputs[at + 1].dtype)


def exact_problem(region: RegionSummary) -> str | None:
    """Why the kernel cannot read a region's newest rows unrounded (fp8-kv-cache's exact-recent;
    None: it can, or the region has none)."""
    dtypes = exact_rows_dtypes(region)
    if dtypes is None:
        return None
    problem = exact_rows_problem(region)
    if problem is not None:
        return problem
    window = region.attrs["recent"]
    if kv_write_inputs(region) is not None and not folded_exact(region):
        return "exact rows beside a folded write that is not exact-recent's: not implemented"
    if page_size(region) is not None and (folded_exact(region) or (window > 1 and ring_slots_at(region) is None)):
        return "exact rows through pages: not folded, the rings read through ring_slots"
    if window > MAX_RECENT:
        return f"exact-recent windows of at most {MAX_RECENT} rows (has {window})"
    at = exact_rows_at(region)
    rings = region.inputs[at + 2:at + 2 + 2 * (window > 1)] if at is not None else ()
    if any(t not in EXACT_DTYPES for t in dtypes) or any(r.dtype != t for r, t in zip(rings, dtypes)):
        return "exact rows in fp32 or bf16, each ring in its rows' dtype"
    return None


def mma_problem(region: RegionSummary) -> str | None:
    """Why the kernel cannot implement a decode_attention region (None: it can)."""
    problem = exact_problem(region)
    if problem is not None:
        return problem
    region = without_exact_rows(region)
    q, k, v = region.inputs[:3]
    if not bf16_cache(region):
        if kv_scale(region) not in ("per-tensor", "per-head"):
            return "needs both caches in bf16, or in fp8 with per-tensor or per-head scales"
        if v.dtype != FP8_CACHE_DTYPE or k.dtype not in (FP8_CACHE_DTYPE, "bfloat16"):
            return "needs V in float8_e4m3fn and K in float8_e4m3fn or bf16 (or both in bf16)"
    if q.dtype != "bfloat16" or region.outputs[-1].dtype != "bfloat16":
        return "needs a bf16 query and output"
    if q.shape[3] != HEAD_DIM:
        return f"needs head dim {HEAD_DIM}"
    group = region.attrs["num_heads"] // region.attrs["num_kv_heads"]
    if group > MAX_GROUP:
        return f"needs at most {MAX_GROUP} query heads a kv head (has {group})"
    return None


def shared_bytes(params: dict, group: int, k_bytes: int = 1, v_bytes: int = 1, window: int = 0) -> int:
    """Dynamic shared memory a block (the kernel has no static __shared__: it would move the rings
    off a 128-byte boundary): every warp's ring (K and V rows of a chunk a slot, `k_bytes` and
    `v_bytes` a cache element), `window` bytes of exact-recent rows, the warps' partials (m, l,
    acc of each head), the merge's weights and sums of every split, its flag; meeting in a
    cluster, the block's partials too."""
    warps = params["num_warps"]
    ring = params["num_stages"] * params["CHUNK"] * HEAD_DIM * (k_bytes + v_bytes)
    cluster = 4 * group * (2 + HEAD_DIM) if params.get("MEET", OPTIONAL_KNOBS["MEET"]) == "cluster" else 0
    return warps * ring + window + 4 * (warps * group * (2 + HEAD_DIM) + 2 * params["SPLIT"] * group) + 16 + cluster


def window_bytes(region: RegionSummary) -> int:
    """exact-recent's rows in shared memory: every ring slot and the own row, of K and of V."""
    dtypes = exact_rows_dtypes(region)
    if dtypes is None:
        return 0
    window = region.attrs["recent"]
    slots = (window if window > 1 else 0) + 1
    return slots * HEAD_DIM * sum(EXACT_DTYPES[t] for t in dtypes)


class DecodeAttentionMmaFamily(TemplateFamily):
    name = "decode_attention_mma"

    def matches(self, region: RegionSummary) -> bool:
        return (region.family == "decode_attention" and DecodeAttentionFamily().matches(region)
                and mma_problem(region) is None)

    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        return {
            "SPLIT": [1, 2, 4, 8, 16, 32],
            "CHUNK": [16, 32],
            "COPY": ["ca", "cg"],
            "num_warps": [4, 8],
            "num_stages": [2, 3, 4],
            "MEET": ["global", "cluster"],
        }

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        problem = mma_problem(region) or self.outside_space(region, {**OPTIONAL_KNOBS, **params}, target)
        if problem is not None:
            return problem
        if params.get("MEET") == "cluster" and not 2 <= params["SPLIT"] <= MAX_CLUSTER:
            return f"MEET=cluster needs 2 to {MAX_CLUSTER} splits (a portable cluster; one split has no meeting)"
        if not target.arch.startswith("sm_9"):
            return ("written for Hopper (sm_9x): e4m3 widened by cvt.f16x2.e4m3x2, rings of up to 227 KiB of "
                    "shared memory")
        return cuda_point_problem(region_shared_bytes(region, params), target)

    def render(self, region: RegionSummary, params: dict) -> str:
        dtypes, window = exact_rows_dtypes(region), region.attrs.get("recent") or 1
        ring_write = region.attrs.get("ring_write")
        folded = folded_exact(region)
        exact = {"exact": dtypes is not None, "exact_folded": folded, "recent": window,
                 "ring": dtypes is not None and window > 1, "ring_write": ring_write is not None or (folded and window > 1),
                 "kx_float": False, "vx_float": False, "ring_positions_t": "int",
                 "ring_slots": ring_slots_at(region) is not None}
        shared = region_shared_bytes(region, params)  # (its window's rows included)
        if dtypes is not None:
            exact["kx_float"], exact["vx_float"] = (t == "float32" for t in dtypes)
            if ring_write is not None:
                positions = region.inputs[ring_write["positions_input"]]
                exact["ring_positions_t"] = "int" if positions.dtype == "int32" else "long long"
            region = without_exact_rows(region)  # (the rest renders as the plain region)
        written, k_tables = kv_write_inputs(region), kv_write_rope(region)
        k_offset, v_offset = kv_write_offsets(region)
        scale = region.attrs.get("scale")
        group = region.attrs["num_heads"] // region.attrs["num_kv_heads"]
        gathered = gathered_tables(region)
        k_bytes, v_bytes = element_bytes(region)
        return render_template(
            "cuda/decode_attention_mma.py.j2",
            region_name=region.name,
            p=params,
            cluster={**OPTIONAL_KNOBS, **params}["MEET"] == "cluster",
            group=group,
            num_heads=region.attrs["num_heads"],
            num_kv_heads=region.attrs["num_kv_heads"],
            scale=repr(float(scale if scale is not None else 1.0 / math.sqrt(HEAD_DIM))),
            shared_bytes=shared,
            bf16=bf16_cache(region),
            k16=k_bytes == 2,
            v16=v_bytes == 2,
            kv_scale=kv_scale(region),
            lengths_t="int" if region.inputs[3].dtype == "int32" else "long long",
            lengths_offset=lengths_offset(region),  # lengths = input 3 + this
            positions_t="int" if written is not None and region.inputs[written].dtype == "int32" else "long long",
            rope=bool(region.attrs.get("rope")),
            kv_write=written is not None,
            kv_rope=k_tables is not None,
            kv_own_tables=k_tables is not None and k_tables == written + 3,  # else the query's
            k_offset=k_offset is not None,
            v_offset=v_offset is not None,
            gathered=gathered,
            paged=page_size(region) is not None,
            page_size=page_size(region),
            row="table_row" if gathered else "batch",  # the rotary tables' row: the write's position, or the sequence's
            **exact,
        )


def region_shared_bytes(region: RegionSummary, params: dict) -> int:
    """`shared_bytes` of a point on a region: its head group, its caches' element sizes, its window's rows."""
    group = region.attrs["num_heads"] // region.attrs["num_kv_heads"]
    return shared_bytes(params, group, *element_bytes(region), window_bytes(region))
