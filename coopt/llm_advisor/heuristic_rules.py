"""Per-family cost rules for the heuristic advisor (lower cost = try first).

Each rule reads the region's shapes once, then scores points by how far each knob is from the
value that simple performance reasoning suggests, measured in factors of two
(`_log_gap(64, 128) == 1`). Knobs a rule does not know cost nothing, so unknown knobs keep the
family's legal order. Knob names are matched case-insensitively with a few aliases, because the
rules must not depend on the exact spelling a template family picks.

A rule is `rule(request) -> (cost(point) -> float, rationale)`.
"""

from __future__ import annotations

import math
from typing import Callable

from coopt.llm_advisor.protocol import AdviceRequest

CostFn = Callable[[dict], float]

BLOCK_M = ("BLOCK_M", "BLOCK_SIZE_M")
BLOCK_N = ("BLOCK_N", "BLOCK_SIZE_N")
BLOCK_K = ("BLOCK_K", "BLOCK_SIZE_K")
BLOCK = ("BLOCK", "BLOCK_SIZE", "XBLOCK")
WARPS = ("num_warps", "WARPS")
STAGES = ("num_stages", "STAGES")
GROUP_M = ("GROUP_M", "GROUP_SIZE_M")
SPLIT_K = ("SPLIT_K",)
GEMV = ("GEMV",)
NORM_FIRST = ("NORM_FIRST",)
SWAP_AB = ("SWAP_AB",)
STREAM_K = ("STREAM_K",)
MEET = ("MEET",)

# "Enough tiles" means at least this share of the SMs has a tile: a short last wave costs
# less than tiles so small that each one does too little work to hide memory latency.
FILL_SHARE = 0.75


# -- helpers -------------------------------------------------------------------------------
def knob(mapping: dict, aliases: tuple[str, ...]):
    """The value under the first alias present (case-insensitive), or None."""
    lowered = {str(k).lower(): v for k, v in mapping.items()}
    for alias in aliases:
        if alias.lower() in lowered:
            return lowered[alias.lower()]
    return None


def _numbers(values) -> list[float]:
    return sorted(v for v in (values or []) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)


def _log_gap(value, target) -> float:
    """Factors of two between value and target; 0 when the knob is absent or not numeric."""
    if value is None or target is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or target <= 0:
        return 0.0 if value == target else 1.0
    return abs(math.log2(value / target))


def _smallest_at_least(allowed: list[float], n: float):
    """Smallest allowed value >= n (one tile covers n), else the largest allowed."""
    fitting = [v for v in allowed if v >= n]
    return min(fitting) if fitting else (max(allowed) if allowed else None)


def _largest_at_most(allowed: list[float], n: float):
    fitting = [v for v in allowed if v <= n]
    return max(fitting) if fitting else (min(allowed) if allowed else None)


def _shape(request: AdviceRequest, index: int, outputs: bool = False) -> tuple[int, ...]:
    """Concrete shape: symbolic dims take the example value, else their max, else 1."""
    region = request.region
    specs = region.outputs if outputs else region.inputs
    if index >= len(specs):
        return ()
    dims = []
    for d in specs[index].shape:
        if isinstance(d, str):
            d = region.example_dims.get(d) or (region.dims.get(d) or (1, 1))[1]
        dims.append(max(1, int(d)))
    return tuple(dims)


def _prod(values) -> int:
    return math.prod(values) if values else 1


def _fill_penalty(tiles: int, num_sms: int) -> float:
    """Factors of two short of giving most SMs a tile (0 when enough tiles)."""
    wanted = FILL_SHARE * num_sms
    return math.log2(wanted / tiles) if 0 < tiles < wanted else 0.0


def _warps_for(elements: float, most: int) -> int:
    """About 8 elements per thread (256 per warp): enough loads in flight, few registers."""
    return int(min(most, max(1, 2 ** round(math.log2(max(1.0, elements / 256))))))


def _stages_gap(stages, low: int, high: int) -> float:
    if stages is None or not isinstance(stages, int):
        return 0.0
    return _log_gap(stages, low) if stages < low else _log_gap(stages, high) if stages > high else 0.0


# -- families ------------------------------------------------------------------------------
def matmul_epilogue(request: AdviceRequest) -> tuple[CostFn, str]:
    a, b = _shape(request, 0), _shape(request, 1)
    m, k = _prod(a[:-1]), (a[-1] if a else 1)
    n = (b[0] if request.region.attrs.get("b_layout") == "nk" else b[-1]) if b else 1
    if request.region.attrs.get("glu"):
        n = max(1, n // 2)  # b holds both halves of a gated linear unit: the output is half as wide
    sms = int(request.target.get("num_sms") or 132)
    if m <= GEMV_MAX_M and True in (knob(request.space, GEMV) or []):
        return _matmul_gemv(request, m, n, k, sms)
    return _matmul_tiles(request, m, n, k, sms)


# The skinny-GEMM (GEMV) kernel streams the weight; its speed is set by how many weight bytes
# every SM keeps in flight. A program keeps num_stages - 1 slabs of BLOCK_N x BLOCK_K in flight
# (Triton's pipeline depth), and an SM runs as many programs at once as shared memory allows.
# Measured on the H200 (bench/gemm.py --quick --shapes skinny,decode; CUDA graphs, triton 3.6):
# - ~48 KB in flight per SM streams the 117 MB-1 GB weights at 3.9-4.5 TB/s; ~32 KB loses
#   10-20% (1x4096x14336: 1x32x256 tiles with 2 slabs in flight 3.35 TB/s, with 3 slabs 3.90);
# - programs that leave SMs idle are the worst loss (64 programs on 132 SMs: 1.1 TB/s);
# - more programs than fit at once, by a few waves, leave a ragged last wave (1x14336x4096:
#   896 programs of 6 per SM 3.35 TB/s; 448 of 3 per SM 3.03; 448 of 4 per SM 3.83);
# - each SPLIT_K doubling costs ~5% on a 32 MB weight (partials and the last program's sum):
#   at 1x4096x4096 the best points split nothing (3.1 TB/s, cuBLAS 2.7).
GEMV_MAX_M = 64  # the family offers the GEMV kernel up to this M
GEMV_FLIGHT_BYTES_PER_SM = 48 * 1024
GEMV_ROW_BYTES = 512  # contiguous bytes per weight row and K step (32 B sectors, long bursts)
# Swapped tl.dot tiles (the weight slab as wgmma's A operand) stream as fast with 256-byte rows:
# H200, 32 rows, norm-statistics form (bench/gemm.py --shapes stats32, session 23): the output
# head 245.8 µs at 256x128 (3 stages) against 274.6 at 128x256 (2) and 278.7 at 64x256 (3);
# gate|up 59.4 at 128x128 against 70.3 at 64x256 (2). q|k|v's best kept 256 (16.2 µs at 64x256).
GEMV_SWAP_ROW_BYTES = 256
GEMV_SLAB_BYTES = 16 * 1024  # 16x512 or 32x256 bf16: the slab of the measured winners
GEMV_MAX_PROGRAMS_PER_SM = 8  # of 4 warps: 32 warps an SM, registers to spare
# Stream-K GEMV points (STREAM_K programs an SM, equal shares of the weight) measured slower than
# their one-program-a-tile twins on every Llama-3-8B shape at b1 and b32 (H200, session 21,
# bench/gemm.py --variants stream-k: o at b1 13.1 against 11.2 µs at best): each ranks a factor
# of two behind its twin, out of the few points a build measures.
GEMV_STREAM_K_SLOWER = 1.0
# The flag meeting of a split point (MEET="flag": the merger polls flagged partials, one round trip
# to L2 after its loop instead of the count meeting's three) is unmeasured on a GPU: it ranks right
# behind its count twin, so a build's top points time both meetings of the best split point.
GEMV_FLAG_MEET_RANK = 0.001


def _matmul_gemv(request: AdviceRequest, m: int, n: int, k: int, sms: int) -> tuple[CostFn, str]:
    """Decode-sized M with the GEMV kernel in the space: its points first, by bytes in flight.

    A GLU region (attrs "glu") streams two weight slabs a K step (rows n and N + n of the merged
    gate|up weight) into one output tile: its slab, bytes in flight and shared memory count both.
    An RMSNorm prologue adds only a [BLOCK_K] slice of the norm weight a step: ranked as without.
    """
    a_elem = 4 if request.region.inputs[0].dtype == "float32" else 2
    b_elem = 4 if request.region.inputs[1].dtype == "float32" else 2
    halves = 2 if request.region.attrs.get("glu") else 1
    smem = int(request.target.get("smem_per_block_bytes") or 232448)
    bm_vals = _numbers(knob(request.space, BLOCK_M))
    # One activation row: multiply-and-sum (BLOCK_M = 1); more: tl.dot on the fewest rows >= M.
    bm_t = 1 if m == 1 and 1 in bm_vals else (_smallest_at_least([v for v in bm_vals if v >= 16], m) or 16)
    tiles_cost, _ = _matmul_tiles(request, m, n, k, sms, with_gemv=True)
    norm_modes = True in (knob(request.space, NORM_FIRST) or [])

    def cost(point: dict) -> float:
        if not knob(point, GEMV):
            return 4.0 + tiles_cost(point)  # the tensor-core kernels come after every GEMV point
        bm, bn, bk = knob(point, BLOCK_M), knob(point, BLOCK_N), knob(point, BLOCK_K)
        split, stages, warps = knob(point, SPLIT_K) or 1, knob(point, STAGES) or 3, knob(point, WARPS) or 4
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (bm, bn, bk, split, stages, warps)):
            return 100.0  # not a point this rule can reason about
        # Rows past M are tl.dot padding; fewer rows than M re-read each slab (from L2).
        c = 2 * math.log2(bm / bm_t) if bm >= bm_t else 0.5 * math.log2(bm_t / bm)
        swap = bool(knob(point, SWAP_AB))
        row_bytes = GEMV_SWAP_ROW_BYTES if swap and bm_t > 1 else GEMV_ROW_BYTES
        c += 0.5 * max(0.0, math.log2(row_bytes / (bk * b_elem)))
        slab = halves * bn * bk * b_elem
        c += 0.1 * _log_gap(slab, GEMV_SLAB_BYTES)  # among equals, the measured winners' slab
        # Every column tile re-reads the M activation rows from L2: M / BLOCK_N of the weight's
        # bytes again (negligible for one row, twice the weight for 32 rows of 16-wide tiles).
        c += math.log2(1 + m / (halves * bn))  # (a GLU program reads them once for both slabs)
        programs = math.ceil(m / bm) * math.ceil(n / bn) * split
        buffers = stages if knob(point, SWAP_AB) else max(1, stages - 1)  # SWAP_AB: wgmma's operand buffers
        program_smem = buffers * (bm * bk * a_elem + slab) + 2048
        resident = max(1, min(GEMV_MAX_PROGRAMS_PER_SM * 4 // warps, smem // program_smem))
        c += _gemv_streaming_cost(programs, resident, max(1, stages - 1) * slab, sms)
        c += 0.5 * math.log2(split) + _log_gap(warps, 4) + 0.25 * _stages_gap(stages, 3, 4)
        if swap:
            # Weight rows on the tensor cores' 64-row side (a wgmma on sm_90, not an mma on
            # activation rows padded to 16) and a wide slab that re-reads the rows less. H200,
            # 32 rows (bench/gemm.py --shapes layer --variants gemv): the best point of every
            # Llama layer GEMV swaps (q|k|v 18.7 µs vs 20.4, o 12.6 vs 13.1, gate|up 57.7 vs
            # 60.6, down 32.5 vs 33.4), on tiles of all M rows (o: 32 rows 12.6 µs, two tiles of 16
            # 13.4: the wgmma takes any multiple of 8 activation rows, and each extra row tile
            # re-reads the weight slab).
            c -= 0.5
            if bm < bm_t:
                c += 0.75
        if norm_modes:
            # The RMSNorm in the GEMV loop (NORM_FIRST=False) or in a kernel before it. One row:
            # in the loop (H200: q|k|v + norm 14.6 µs against 23.9 for eager norm + cuBLAS), the
            # separate norm ranked close behind so that measurement can compare. tl.dot tiles:
            # the in-loop norm re-lays out the activation tile every K step (2x slower than
            # eager norm + cuBLAS at 32 rows), so it comes last.
            # Swapped, the activation tile is the dot's right operand and the in-loop norm
            # measured even (gate|up at 32 rows: 57.7 µs in the loop, 59.9 first): ranked right
            # behind the separate norm.
            first = bool(knob(point, NORM_FIRST))
            c += (0.001 if first else 0.0) if bm == 1 else (0.0 if first else 0.05 if swap else 3.0)
        if knob(point, MEET) == "flag":
            c += GEMV_FLAG_MEET_RANK
        stream_k = knob(point, STREAM_K) or 0
        if stream_k:
            c += GEMV_STREAM_K_SLOWER + 0.001 * stream_k  # fewer programs an SM first
        return c

    kernel = "multiply-and-sum" if bm_t == 1 else f"tl.dot on {bm_t} rows"
    return cost, (
        f"decode-shaped matmul (M={m}, N={n}, K={k}): GEMV kernel, {kernel}; tiles and SPLIT_K for "
        f"~{GEMV_FLIGHT_BYTES_PER_SM // 1024} KB of weight in flight on each of {sms} SMs in one wave"
    )


def _gemv_streaming_cost(programs: int, resident: int, program_flight: int, sms: int) -> float:
    """Idle SMs, too few bytes in flight on a busy SM, and a ragged last wave, in factors of two.
    `resident`: programs an SM runs at once; `program_flight`: weight bytes one keeps in flight."""
    c = 2 * math.log2(0.9 * sms / programs) if programs < 0.9 * sms else 0.0
    in_flight = program_flight * min(programs / sms, resident)
    c += 1.5 * max(0.0, math.log2(GEMV_FLIGHT_BYTES_PER_SM / in_flight))
    waves = programs / (resident * sms)
    if 1 < waves < 4:
        c += 2 * (math.ceil(waves) - waves) / math.ceil(waves)
    return c


def _matmul_tiles(request: AdviceRequest, m: int, n: int, k: int, sms: int,
                  with_gemv: bool = False) -> tuple[CostFn, str]:
    """The tensor-core kernels (plain grid, persistent, TMA)."""
    bm_vals, bn_vals, bk_vals = (_numbers(knob(request.space, names)) for names in (BLOCK_M, BLOCK_N, BLOCK_K))
    if with_gemv:  # the tiles only the GEMV kernel takes (BLOCK_M=1, BLOCK_N=16, BLOCK_K>128)
        bm_vals, bn_vals = [v for v in bm_vals if v >= 16], [v for v in bn_vals if v >= 32]
        bk_vals = [v for v in bk_vals if v <= 128]
    sixteen_bit = bool(request.region.inputs) and request.region.inputs[0].dtype in ("bfloat16", "float16")
    hopper = False  # set for large 16-bit GEMMs below

    if m <= 16:
        # Decode / GEMV: the kernel streams the weight matrix once; anything above M rows in a
        # tile is wasted tensor-core work, so the smallest BLOCK_M that covers M. Long BLOCK_K
        # slabs make each weight read long and contiguous; BLOCK_N as large as possible while
        # still giving most SMs a column tile (bandwidth needs every SM loading).
        regime = f"decode-shaped matmul (M={m})"
        bm_t = _smallest_at_least(bm_vals, m)
        bk_t = _largest_at_most([v for v in bk_vals if v <= 256], max(k, 16))
        filling = [v for v in bn_vals if v <= 128 and math.ceil(n / v) >= FILL_SHARE * sms]
        bn_t = max(filling) if filling else (min(bn_vals) if bn_vals else None)
        stages_range = (4, 5)  # deep pipelining keeps weight loads in flight
    elif math.ceil(m / 128) * math.ceil(n / 128) >= FILL_SHARE * sms:
        # Large: 128x128 output tiles with BLOCK_K 64 reach tensor-core peak on Hopper and
        # still fill the SMs; 3-4 stages of 32 KiB (bf16) fit shared memory.
        regime = f"large matmul (M={m}, N={n}, K={k})"
        # 16-bit operands: 128x256 tiles (8 warps, 3 stages) feed wgmma best on Hopper and
        # halve A re-reads; measured on the H200 (2026-11-30), 128x128 tiles reached ~510
        # TFLOP/s on a 4096x16384x4096 bf16 GEMM against cuBLAS's ~680.
        wide = n >= 256 and sixteen_bit
        bm_t, bn_t, bk_t = 128, (256 if wide else 128), 64
        stages_range = (3, 4)
        # Hopper variants (bench/NOTES-gemm.md, compiled for sm_90 with triton 3.6 and 3.9):
        # tensor copies (USE_TMA) take operand addressing out of the registers and issue slots
        # (the plain 128x256 kernel sits at the 255-register cap and spills with a GELU
        # epilogue; the TMA kernels need 160-240), and the persistent grid overlaps each tile's
        # epilogue with the next tile's loads.
        hopper = sixteen_bit
    else:
        # Medium: 128x128 tiles would leave SMs idle; 64-wide tiles (BLOCK_M no larger than M)
        # and the fill penalty below trade tile efficiency for parallelism.
        regime = f"medium matmul (M={m}, N={n}, K={k})"
        bm_t = min(64, _smallest_at_least(bm_vals, m) or 64)
        bn_t, bk_t = 64, 64
        stages_range = (3, 4)

    def cost(point: dict) -> float:
        bm, bn, bk = knob(point, BLOCK_M), knob(point, BLOCK_N), knob(point, BLOCK_K)
        tma, persistent = knob(point, ("USE_TMA", "TMA")), knob(point, ("PERSISTENT",))
        subtile = knob(point, ("EPILOGUE_SUBTILE",))
        split = knob(point, SPLIT_K)
        split = split if isinstance(split, int) and split > 0 else 1
        c = 2 * _log_gap(bm, bm_t) + _log_gap(bn, bn_t) + _log_gap(bk, bk_t)
        stages = stages_range
        if isinstance(bm, int) and isinstance(bn, int) and bm > 0 and bn > 0:
            # Idle SMs are the largest loss on small problems: weigh it like BLOCK_M. Split-K
            # multiplies the programs (each one reduces a slice of K).
            c += 2 * _fill_penalty(math.ceil(m / bm) * math.ceil(n / bn) * split, sms)
            # 8 warps for 128x128 accumulators (64 fp32 registers per thread), else 4.
            c += _log_gap(knob(point, WARPS), 8 if bm * bn >= 128 * 128 else 4)
            if bm * bn >= 128 * 256:
                stages = (3, 3)  # 48 KiB a stage (bf16): three fit in shared memory with room
                if tma and subtile == 2:
                    stages = (4, 4)  # the halved store buffer (32 KiB) leaves room for a fourth
            elif tma:
                stages = (4, 5)  # copies cost no registers: as deep as shared memory allows
        if hopper:
            c += (0.0 if tma else 1.0) + (0.0 if persistent else 0.5)
            if isinstance(bn, int) and bn >= 256:
                # A 128x256 fp32 epilogue in one piece spills (22-82 spill instructions with
                # GELU, sm_90); in two 128-column halves it does not.
                c += 0.0 if subtile == 2 else 1.0
            if isinstance(bk, int) and bk < 64:
                c += 1.5  # 64-byte rows: half-width swizzle, twice the barrier waits per FLOP
        else:
            # Unmeasured outside large 16-bit GEMMs: prefer the plain grid.
            c += 0.5 * bool(tma) + 0.5 * bool(persistent) + 0.25 * (subtile not in (None, 1))
        c += 0.5 * _stages_gap(knob(point, STAGES), *stages)
        # Grouped tile order reuses B tiles in L2 only when there are several row tiles.
        c += 0.25 * _log_gap(knob(point, GROUP_M), 8 if bm_t and m > bm_t else 1)
        # Split-K adds a second reduction of the partial tiles: worth it only for the fill.
        c += 0.5 * math.log2(split)
        return c

    variant = ", persistent TMA kernel" + (", epilogue in halves" if bn_t == 256 else "") if hopper else ""
    return cost, f"{regime}: BLOCK_M~{bm_t}, BLOCK_N~{bn_t}, BLOCK_K~{bk_t}{variant}, fill {sms} SMs"


def attention(request: AdviceRequest) -> tuple[CostFn, str]:
    q, kv = _shape(request, 0), _shape(request, 1)
    batch, heads, sq, d = (1,) * (4 - len(q)) + q if len(q) < 4 else q[-4:]
    kv_heads = kv[-3] if len(kv) >= 3 else heads
    sk = kv[-2] if len(kv) >= 2 else sq
    group = max(1, heads // max(1, kv_heads))
    sms = int(request.target.get("num_sms") or 132)
    bm_vals, bn_vals = _numbers(knob(request.space, BLOCK_M)), _numbers(knob(request.space, BLOCK_N))
    page_size = request.region.attrs.get("page_size")
    if page_size:  # paged KV: k is a pool of pages; the keys are what the page table addresses
        table = _shape(request, 4)
        sk = (table[-1] if table else 1) * page_size  # (a block may cover several pages)

    def query_tile(rows: int, head_programs: int):
        # For few query rows (decode) one tile covering them: more is wasted work. For many,
        # 128 rows amortise each K/V tile load over more queries, unless SMs would sit idle.
        if rows <= 64:
            return _smallest_at_least(bm_vals, rows)
        return 128 if head_programs * math.ceil(rows / 128) >= FILL_SHARE * sms else 64

    # Key tile 64: the S = QK^T tile stays in registers next to the output accumulator.
    bn_t = _largest_at_most(bn_vals, 64) if sk >= 64 else _smallest_at_least(bn_vals, sk)
    # Head dim > 64 doubles the accumulator and Q tile: 8 warps share the registers.
    warps_t = 4 if d <= 64 else 8
    # K/V loads are the latency the stages hide; a stage of 1-byte fp8 K/V (a prompt over an fp8
    # cache) takes half the shared memory, so one stage deeper costs less than a bf16 stage.
    fp8 = len(request.region.inputs) > 1 and request.region.inputs[1].dtype == "float8_e4m3fn"
    stages_t = (3, 4) if fp8 else (2, 3)

    def cost(point: dict) -> float:
        bm, bn = knob(point, BLOCK_M), knob(point, BLOCK_N)
        # PACK_GQA puts a kv group's query heads in one tile's rows: K/V are loaded once per
        # group instead of once per query head, which is what decode (few rows) is bound by.
        pack = bool(knob(point, ("PACK_GQA",))) and group > 1
        rows, head_programs = (sq * group, batch * kv_heads) if pack else (sq, batch * heads)
        split = knob(point, ("SPLIT_KV",))
        split = split if isinstance(split, int) and split > 0 else 1
        c = 2 * _log_gap(bm, query_tile(rows, head_programs)) + _log_gap(bn, bn_t)
        c += _log_gap(knob(point, WARPS), warps_t) + 0.5 * _stages_gap(knob(point, STAGES), *stages_t)
        if isinstance(bm, int) and bm > 0:
            # Split-KV (flash-decoding) multiplies the programs when heads x tiles are too few.
            c += 2 * _fill_penalty(head_programs * math.ceil(rows / bm) * split, sms)
        c += 0.25 * math.log2(split)  # a small combine step over the partial results
        if group > 1 and sq <= 64 and not pack:
            c += math.log2(group)  # K/V read group times over: the factor packing saves
        return c

    return cost, (
        f"attention (Sq={sq}, Sk={sk}, D={d}, group={group}): BLOCK_N~{bn_t}, {warps_t} warps, "
        f"query tile and splits to fill {sms} SMs"
    )


def _decode_lengths(request: AdviceRequest, max_length: int) -> tuple[int, int]:
    """(the cache a sequence may fill, the length planned for) of a decode attention region:
    paged, what its page table row addresses (max_pages x page size; dim 2 of the pages is the
    page size); the length, the region's example length (the cache size when it gives none)."""
    page_size = request.region.attrs.get("page_size")
    if page_size:
        table = _shape(request, 4)
        max_length = (table[-1] if table else 1) * page_size
    return max_length, min(max_length, max(1, int(request.region.attrs.get("example_length") or max_length)))


def _decode_splits(split_vals: list[float], programs: int, length: int, sms: int, min_keys: int):
    """Splits of each (sequence, kv head)'s keys: the fewest that give `programs` x splits
    programs enough to cover the SMs, but at least `min_keys` keys a split."""
    most = _largest_at_most(split_vals, max(1, length // min_keys))
    filling = [v for v in split_vals if programs * v >= FILL_SHARE * sms]
    return min(min(filling) if filling else max(split_vals), most)


def decode_attention(request: AdviceRequest) -> tuple[CostFn, str]:
    q, kv = _shape(request, 0), _shape(request, 1)
    batch, heads, _, d = (1,) * (4 - len(q)) + q if len(q) < 4 else q[-4:]
    kv_heads, max_length = (kv[-3], kv[-2]) if len(kv) >= 3 else (heads, 1)
    group = max(1, heads // max(1, kv_heads))
    attrs = request.region.attrs
    page_size = attrs.get("page_size")
    max_length, length = _decode_lengths(request, max_length)
    # K/V element size: 1 for an fp8 cache, whose tiles are widened to q's dtype for tl.dot
    elem = {"float32": 4, "float8_e4m3fn": 1}.get(request.region.inputs[1].dtype, 2)
    sixteen_bit_q = request.region.inputs[0].dtype in ("bfloat16", "float16")
    sms = int(request.target.get("num_sms") or 132)
    split_vals = _numbers(knob(request.space, ("SPLIT_KV",))) or [1]
    bn_vals = _numbers(knob(request.space, BLOCK_N))
    # (A tile may cover several pages: BLOCK_N is chosen as for a cache per sequence.)

    # Decode attention streams each (sequence, kv head)'s valid K/V once: bandwidth bound, and
    # one program per (sequence, kv head) leaves most SMs idle when batch x kv heads is small.
    # Split the keys until batch x kv heads x splits covers the SMs, but keep at least
    # min_keys keys per split: below that the fixed cost of a split (loading q, writing and
    # merging its fp32 partials, the reduce launch) outweighs the extra bandwidth. The length
    # planned for is the region's example length (the cache size when it gives none).
    programs = batch * kv_heads
    split_t = _decode_splits(split_vals, programs, length, sms, min_keys=128)
    # K and V tiles of ~16 KiB each: long contiguous reads, two or three stages in flight in
    # shared memory; never longer than a split's share of the keys. With 1-byte fp8 rows that is
    # twice the keys per tile (BLOCK_N 128 at D 128) for the same bytes in flight. Where each SM
    # gets one program or less, that program alone keeps its SM's loads in flight: 32 KiB tiles
    # (H200, bf16, bench/attention_sweep.py: b1 at 32768 BLOCK_N 128 39.0 µs vs 64 40.2; at
    # 2048 10.0-10.7 vs 10.9), while at 256 programs (b32) 16 KiB stays best (62.8 vs 65.1 µs).
    keys_per_split = max(1, length // split_t)
    tile_bytes = 32768 if programs * split_t <= sms else 16384
    bn_t = _largest_at_most(bn_vals, max(16, min(tile_bytes // (d * elem), keys_per_split)))
    # Tiles over several pages look up a page per key row, a dependent load before each tile's
    # K/V: more programs in flight hide it (b32 at 2048, pages of 16, BLOCK_N 64, ~2 programs an
    # SM: split 2 67.3 µs, split 1 81.7; unpaged the other way round, 73.9 vs 63.1;
    # bench/attention_sweep.py, H200). Not measured with more programs than 4 an SM: left as is.
    if page_size and bn_t > page_size and 2 * split_t in split_vals and length // (2 * split_t) >= bn_t \
            and programs * split_t <= 4 * sms:
        split_t *= 2
        keys_per_split = max(1, length // split_t)
    # Tensor cores pad the head group to 16 rows: free for a 16-bit query with group >= 4
    # (multiply-and-sum would need group x D FMAs per key). fp32 tl.dot runs on CUDA cores
    # padded to 16 rows, and for small groups the padding costs more than it saves.
    dot_t = sixteen_bit_q and group >= 4
    warps_t = 4 if d <= 128 else 8
    # Loads in flight hide HBM latency; more stages than blocks per split buy nothing.
    stages_range = (2, 3) if keys_per_split < 4 * (bn_t or 16) else (3, 4)

    # Whether one program per SM streams at full bandwidth is not settled (b1, length 32768,
    # 128 programs of 2048 keys: 3.4 TB/s on the H200): with long splits, rank twice the splits
    # (two programs per SM) second, ahead of tile variants, so that measurement decides.
    # Short lengths are latency-bound (b1, length 2048: 16 splits of 128 keys took 11.4 µs for
    # 8.4 MB on the H200): where the splits leave SMs a program or less each, twice the splits
    # (shorter chains of tile loads) is ranked second too.
    # Where a split is a single tile, though, half the splits (two tiles a program, the second's
    # loads in flight during the first's math) measured ahead (b1 at 2048, BLOCK_N 128: split 8
    # 10.0 µs, split 16 10.7, bench/attention_sweep.py): that is measured second there.
    tile_fp16 = True in (knob(request.space, ("TILE_FP16",)) or [])
    if keys_per_split <= bn_t and split_t // 2 in split_vals:
        second_split = split_t // 2
    elif 2 * split_t in split_vals and (
            keys_per_split >= 1024 or (programs * split_t <= sms and keys_per_split >= 2 * min(bn_vals or [16]))):
        second_split = 2 * split_t
    else:
        second_split = None

    # 8 warps on fp16-widened fp8 tiles halve each thread's loop (sm_90 SASS, session 19), yet
    # measured slower than 4 at every point (H200, session 21, bench/attention_sweep.py: b1 /
    # 32768 split 16 32.8 against 30.8 µs, split 32 35.5 against 26.5; b1 / 2048 7.5 against
    # 6.8; b32 / 2048 55.8 against 42.8): ranked by their distance from warps_t like any point.

    def cost(point: dict) -> float:
        split = knob(point, ("SPLIT_KV",))
        split_cost = 0.05 if split == second_split else 2 * _log_gap(split, split_t)
        c = split_cost + _log_gap(knob(point, BLOCK_N), bn_t)
        use_dot = knob(point, ("USE_DOT",))
        if use_dot is not None and bool(use_dot) != dot_t:
            c += 1.0
        # fp8 tiles widened to bf16 where fp16 tiles apply: last, behind V_WORDS (which keeps
        # fp16's precision). The bf16-widened kernel is slower (conversion-bound: b1 / 32768
        # 41.3 against 30.5 µs, b1 / 131072 135.0 against 88.7 on the H200, bench/RESULTS.md
        # session 6) and rounds the query to bf16's 8 bits where fp16 tiles keep 11: in session
        # 19's b1 / 32768 build two keys' scores 6e-5 apart (magnitude 1000) swapped under that
        # rounding, and both bf16-widened candidates failed verification where the fp16 ones passed.
        if tile_fp16 and use_dot and not knob(point, ("TILE_FP16",)):  # (multiply-and-sum has no fp16 form)
            c += 2.0
        # fp16 tiles with V read as 16-bit words: a third fewer loop instructions in the sm_90
        # SASS, yet slower at every point measured on the H200 (session 17, bench/attention_sweep.py:
        # b1 / 32768 26.6 against 31.1 µs, b32 / 2048 42.9 against 50.9, docs/kv-cache.md): last.
        if knob(point, ("V_WORDS",)):
            c += 1.0
        c += _log_gap(knob(point, WARPS), warps_t)
        stages = knob(point, STAGES)
        c += 0.5 * _stages_gap(stages, *stages_range)
        # equal otherwise, fewer stages (less shared memory) first
        c += 0.1 * max(0, (stages or stages_range[0]) - stages_range[0])
        return c

    return cost, (
        f"decode attention (length~{length} of {max_length}, {programs} sequence x kv heads, "
        f"group {group}, D={d}): SPLIT_KV~{split_t} to fill {sms} SMs, BLOCK_N~{bn_t}, "
        f"{'tl.dot' if dot_t else 'multiply-and-sum'}{' on widened fp8 K/V' if elem == 1 else ''}"
    )


CLUSTER_SPLIT_KEYS = 256  # keys a split at most where the attention's splits should meet in a cluster


def decode_attention_mma(request: AdviceRequest) -> tuple[CostFn, str]:
    """The CUDA decode attention (templates/decode_attention_mma.py): one block an SM (8 warps
    and their rings take most of its shared memory), so splits until batch x kv heads x splits
    covers the SMs, as for the Triton template; cp.async through the L1 at 8 warps, the form
    measured at 4.02 TB/s (b1 / 131072, split 16, H200: bench/RESULTS.md session 26; past the L1
    3.44, 4 warps through it 3.42); chunks of 16 keys, which every build measured faster than 32
    (session 28: 23.7 against 24.1 µs at b1 / 32768, 36.8 against 41.7 at b32 / 2048, 127.3
    against 141.5 at b32 / 8192), 32 ranked second; a ring of 2 slots. A split takes at least
    32 KiB of each cache: 256 fp8 keys, 128 bf16 keys (a bf16 cache, session 32: the same bytes
    a warp's chunks)."""
    q, kv = _shape(request, 0), _shape(request, 1)
    batch = q[0] if len(q) == 4 else 1
    kv_heads, max_length = (kv[-3], kv[-2]) if len(kv) >= 3 else (1, 1)
    max_length, length = _decode_lengths(request, max_length)
    sms = int(request.target.get("num_sms") or 132)
    split_vals = _numbers(knob(request.space, ("SPLIT",))) or [1]
    programs = batch * kv_heads
    element_bytes = 1 if request.region.inputs[1].dtype == "float8_e4m3fn" else 2
    # at least 32 KiB a split (256 fp8 keys: a chunk for each of 8 warps): shorter shares are all
    # fill and drain
    split_t = _decode_splits(split_vals, programs, length, sms, min_keys=256 // element_bytes)
    # More blocks than SMs (b32: 256 (sequence, kv head) blocks): at 8 warps one block fills an
    # SM, so they run in two waves; at 4 warps three blocks share an SM and all run at once
    # (session 28, b32 / 2048: 36.8 µs at 4 warps; session 26: 47.3 at 8, the template 46.7)
    waves = programs * split_t > sms
    warps_t = 4 if waves else 8
    # The splits meeting in a thread-block cluster (MEET=cluster, 2 to 8 splits) save the global
    # meeting's round trip, a fixed cost that weighs where each split's keys are few: on the H200
    # at b1 / 2048 (16 splits of 128 bf16 keys) 8 splits in a cluster ran 7.11 µs folded against 7.52
    # for 16 in global memory, while at b1 / 32768 fp8 8 in a cluster lost to 16 (25.93 against
    # 21.90: long rows want the splits; session 37). So where a split holds at most
    # CLUSTER_SPLIT_KEYS keys a cluster point aims at the largest cluster, else at the same
    # split; either way just after the same point meeting in global memory (not yet measured in a
    # build: the build's timing decides).
    from coopt.templates.decode_attention_mma import MAX_CLUSTER

    cluster_split_t = min(split_t, MAX_CLUSTER) if length <= CLUSTER_SPLIT_KEYS * split_t else split_t

    def cost(point: dict) -> float:
        cluster = knob(point, ("MEET",)) == "cluster"
        c = 2 * _log_gap(knob(point, ("SPLIT",)), cluster_split_t if cluster else split_t)
        c += 1.0 if knob(point, ("COPY",)) != "ca" else 0.0
        c += _log_gap(knob(point, WARPS), warps_t)
        c += 0.3 * _log_gap(knob(point, ("CHUNK",)), 16)
        c += 0.5 * max(0, (knob(point, STAGES) or 2) - 2)
        c += 0.1 if cluster else 0.0
        return c

    cache = "fp8" if element_bytes == 1 else "bf16" if request.region.inputs[2].dtype != "float8_e4m3fn" else "values-only"
    return cost, (f"CUDA {cache} decode attention (length~{length}, {programs} sequence x kv heads): SPLIT~{split_t} "
                  f"to fill {sms} SMs, {warps_t} warps" + (" (several blocks an SM: no waves)" if waves else "")
                  + ", cp.async through the L1")


def gemv_cuda(request: AdviceRequest) -> tuple[CostFn, str]:
    """The CUDA batch-1 GEMV (templates/gemv_cuda.py): 16 warps of a row or 8 of two rows (the
    same bytes in flight), one or two blocks an SM, rings of 6 slabs (4 for a GLU's two rows),
    each warp starting at its own slab where rows are short (K <= 4096). Session 31's sweep
    (bench/gemm.py --shapes b1cuda --family gemv_cuda, rings on 128-byte boundaries) had those
    forms within ~1 % of the best on q|k|v (14.6 µs), gate|up (55.7) and the head (238);
    STAGGER gained up to 10 µs of the head's but cost down (K 14336) 1-3 µs of its 30; 4 warps
    and one row at 8 warps were no faster. Which of them wins changes with the region (the o
    GEMV: 10.1 µs at two blocks an SM against 11.2 at one, session 30), and a build measures
    only its top-k distinct kernels (candidates.diverse_top_k: warps and ring depth set aside),
    so the ranking puts one and two blocks, one and two rows, first; a block's warps come to 16
    an SM where the rows allow."""
    glu = bool(request.region.attrs.get("glu"))
    b = _shape(request, 1)
    short_rows = not b or b[-1] <= 4096
    stages_t = 4 if glu else 6

    def cost(point: dict) -> float:
        warps, blocks = knob(point, WARPS) or 16, knob(point, ("BLOCKS",)) or 1
        c = 0.5 * max(0.0, _log_gap(warps, 16) - 1)  # 8 and 16 alike, fewer worse
        rows_t = 2 if glu or warps < 16 else 1
        c += 0.7 * abs((knob(point, ("ROWS",)) or rows_t) - rows_t)
        stages = knob(point, STAGES) or stages_t
        c += 0.25 * abs(stages - stages_t) + (1.5 if stages <= 4 and not glu else 0.0)
        c += 0.3 * (blocks - 1) + 0.1 * _log_gap(warps * blocks, 16)
        c += 0.5 * abs((knob(point, ("STAGGER",)) or 0) - int(short_rows))
        return c

    return cost, ("CUDA batch-1 GEMV: 16 warps of a row or 8 of two rows, one or two blocks an SM, rings of 6 slabs, "
                  + ("each warp starting at its own slab" if short_rows else "rows read in order (long rows)"))


def row_reduction(request: AdviceRequest) -> tuple[CostFn, str]:
    x = _shape(request, 0)
    n = x[-1] if x else 1
    bn_vals = _numbers(knob(request.space, BLOCK_N) or knob(request.space, BLOCK))

    # A row that fits in one block is read once (single pass); a looped kernel re-reads it
    # from memory for the second pass. Past 8192 elements the registers run out, so loop
    # over 4096-wide chunks.
    single_pass = n <= 8192
    bn_t = _smallest_at_least(bn_vals, n) if single_pass else _largest_at_most(bn_vals, 4096)

    def cost(point: dict) -> float:
        bn = knob(point, BLOCK_N)
        bn = knob(point, BLOCK) if bn is None else bn
        c = _log_gap(bn, bn_t)
        if single_pass and isinstance(bn, (int, float)) and bn < n:
            c += 3.0  # a second pass over the row costs more than any tile-size mismatch
        if isinstance(bn, (int, float)) and bn > 0:
            # Warps grow with the elements a program holds (never more than the row); capped at
            # 8 as in Triton's layer-norm tutorial (more warps add cross-warp reduction cost).
            c += _log_gap(knob(point, WARPS), _warps_for(min(bn, 2 ** math.ceil(math.log2(n))), 8))
        return c

    mode = "single pass" if single_pass else "looped"
    return cost, f"row reduction (N={n}): {mode}, BLOCK_N~{bn_t}"


def elementwise(request: AdviceRequest) -> tuple[CostFn, str]:
    numel = _prod(_shape(request, 0, outputs=True))
    sms = int(request.target.get("num_sms") or 132)
    block_vals = _numbers(knob(request.space, BLOCK))

    # 1024 elements per program is the memory-bound sweet spot; when there are at least 8
    # waves of larger blocks, larger blocks cut per-program overhead. Never plan a block much
    # larger than the tensor.
    block_t = 1024
    if numel >= 8 * sms * 4096:
        block_t = 4096
    elif numel >= 8 * sms * 2048:
        block_t = 2048
    block_t = min(block_t, max(min(block_vals) if block_vals else 1, 2 ** math.ceil(math.log2(numel))))

    def cost(point: dict) -> float:
        block = knob(point, BLOCK)
        c = _log_gap(block, block_t)
        if isinstance(block, (int, float)) and block > 0:
            c += _log_gap(knob(point, WARPS), _warps_for(block, 8))
        return c

    return cost, f"elementwise (numel={numel}): BLOCK~{block_t}"


def rope(request: AdviceRequest) -> tuple[CostFn, str]:
    shape = _shape(request, 0)
    rows = _prod(shape[:-1]) if shape else 1
    d = shape[-1] if shape else 128
    sms = int(request.target.get("num_sms") or 132)
    # like an elementwise pass: about 1024 elements per program, but keep >= 4 programs per SM
    # when there are rows enough (a decode step has only B x H rows: one row per program)
    rows_t = max(1, min(1024 // max(d, 1), rows // (4 * sms) or 1))

    return _rows_cost(rows_t, d, max_warps=8), f"rope (rows={rows}, D={d}): BLOCK_R~{rows_t}"


def kv_write(request: AdviceRequest) -> tuple[CostFn, str]:
    shape = _shape(request, 3)  # k [B, Hkv, T, D]
    rows = _prod(shape[:-1]) if shape else 1
    d = shape[-1] if shape else 128
    # A decode step writes B x Hkv rows: a launch-bound kernel, so few rows per program (one per
    # SM is plenty); a prefill writes T times more and wants ~1024 elements (K and V) per program.
    rows_t = max(1, min(1024 // max(d, 1), rows))

    return _rows_cost(rows_t, d, max_warps=4), f"kv_write (rows={rows}, D={d}): BLOCK_R~{rows_t}"


def _rows_cost(rows_t: int, d: int, *, max_warps: int) -> CostFn:
    """Cost of a kernel taking BLOCK_R rows of D elements per program: BLOCK_R near rows_t,
    warps matched to the elements of a program."""

    def cost(point: dict) -> float:
        block_r = knob(point, ("BLOCK_R",))
        c = _log_gap(block_r, rows_t)
        if isinstance(block_r, (int, float)) and block_r > 0:
            c += _log_gap(knob(point, WARPS), _warps_for(block_r * d, max_warps))
        return c

    return cost


RULES: dict[str, Callable[[AdviceRequest], tuple[CostFn, str]]] = {
    "matmul_epilogue": matmul_epilogue,
    "attention": attention,
    "decode_attention": decode_attention,
    "decode_attention_mma": decode_attention_mma,
    "gemv_cuda": gemv_cuda,
    "row_reduction": row_reduction,
    "elementwise": elementwise,
    "rope": rope,
    "kv_write": kv_write,
}
