"""Time matmul_epilogue points against cuBLAS on the MLP and decode GEMM shapes (needs a GPU).

    python bench/gemm.py --quick                  # ~24 curated points, < 3 min with compilation
    python bench/gemm.py --quick --shapes skinny  # the GEMV variant on decode-sized GEMMs
    python bench/gemm.py                          # every legal point (hours: narrow it down)
    python bench/gemm.py --shapes up,down --variants tma --limit 40 --json gemm.json
    python bench/gemm.py --shapes layer --variants stream-k --advised 2  # stream-K GEMVs beside their twins
    python bench/gemm.py --shapes b1cuda --family both --variants gemv --sample 1 --advised 3  # the CUDA GEMV's points

Shapes (bf16, M x N x K): `up` 4096x16384x4096 + bias, gelu (the MLP up-projection); `down`
4096x4096x16384 + bias + residual; `decode` M = 1, 8, 32 with N = 4096 / 14336, K = 4096 (a
plain linear); `skinny` the Llama-3-8B decode GEMMs: 1x4096x4096 (attention projection),
1x14336x4096 (MLP up), 1x4096x14336 (MLP down), 32x4096x4096 (batch 32) and 1x128256x4096 (the
vocabulary projection); `stats32` the batch-32 GEMVs whose RMSNorm takes its rows' statistics
from the GEMV before it (fuse-norm-statistics, in the default pipeline at 32 rows: the output
head, q|k|v, gate|up + SwiGLU read h * g and the chunk sums of h^2); `fused` the same decode
GEMVs with what fuse-decode-gemv puts in them: an RMSNorm prologue (`norm`: q|k|v 6144 wide,
lm_head) and SwiGLU over the merged gate|up
(`norm_swiglu`: N = 14336 outputs from a [2 x 14336, 4096] weight), against eager running
F.rms_norm, the GEMM, silu and mul as separate kernels; `b1cuda` the batch-1 GEMVs with and without
their norm, for `--family gemv_cuda` (the CUDA GEMV's legal points, then CUDA_WIDE's deeper
rings) or `--family both` (beside the template's). Each point is rendered by the family, checked against eager PyTorch,
then timed with triton.testing.do_bench (median, L2 flushed). References: `cublas` is the bare
matmul (torch.matmul), `eager` the whole region (F.linear plus the epilogue) as the model runs it. `b32cuda` is a b32 layer's GEMVs and the head
as the default pipeline builds them (norm statistics in and out).

Skinny shapes (M <= 64) are weight-bandwidth bound and their kernels run for microseconds: they
are also timed replayed in a CUDA graph (triton.testing.do_bench_cudagraph; the same signature in
triton 3.6 and 3.9), as a decode step runs, so Python launch overhead is off the GPU timeline.
Graph replays do not flush L2, so the captured calls rotate through enough copies of the inputs
that no weight is still in L2 when it is read again. Their GB/s are also given as a share of
bench/bandwidth.py's reference: the 4.2 TB/s a device-to-device copy reaches on the H200, this
run's measured copy on any other GPU.

Compilation dominates a cold run: points are first compiled in parallel worker processes (one
launch each on the GPU, filling Triton's cache), then checked and timed one by one here.
`--list` prints the points without a GPU. Full mode covers ~1450 points per large shape: at a few
seconds of compilation each, narrow it with --variants / --limit on a time-limited machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from bandwidth import reference_bandwidth

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# -- shapes -----------------------------------------------------------------------------------
# name -> (M, N, K, epilogue): "gelu" = +bias, gelu; "residual" = +bias, + x; "plain" = no bias.
SHAPES = {
    "up": [(4096, 16384, 4096, "gelu")],
    "down": [(4096, 4096, 16384, "residual")],
    "decode": [(m, n, 4096, "plain") for m in (1, 8, 32) for n in (4096, 14336)],
    "skinny": [(1, 4096, 4096, "plain"), (1, 14336, 4096, "plain"), (1, 4096, 14336, "plain"),
               (32, 4096, 4096, "plain"), (1, 128256, 4096, "plain")],
    # fuse-decode-gemv's regions; N is the output width (the swiglu weight has 2N rows)
    # one decode layer's four GEMV regions (q|k|v + norm, o + residual, gate|up + norm + SwiGLU,
    # down + residual) at batch 1 and 32: what `bench/gemm.py --shapes layer --variants gemv
    # --sample 40` samples to see whether the advisor's first points are the space's best
    "layer": [(m, n, k, epilogue) for m in (1, 32) for n, k, epilogue in
              ((6144, 4096, "norm"), (4096, 4096, "residual"), (14336, 4096, "norm_swiglu"), (4096, 14336, "residual"))],
    # batch 32 as the default pipeline builds it (fuse-norm-statistics): the output head and the
    # norm GEMVs read h * g and their rows' chunk sums of squares from the GEMV before them
    "stats32": [(32, 128256, 4096, "stats"), (32, 6144, 4096, "stats"), (32, 14336, 4096, "stats_swiglu")],
    # the batch-32 residual GEMVs (o + residual, down + residual), the two furthest from their
    # bytes in a b32 step (session 28: 12.9 and 33.5 µs against 8.0 and 28.0 at 4.2 TB/s)
    "residual32": [(32, 4096, 4096, "residual"), (32, 4096, 14336, "residual")],
    # a b32 decode layer's four GEMVs and the head as the default pipeline builds them: the norms'
    # consumers (q|k|v, gate|up + SwiGLU, the head) and the residual GEMVs producing the next
    # norm's h * g and chunk sums (o, down)
    "b32cuda": [(32, 6144, 4096, "stats"), (32, 4096, 4096, "producer"), (32, 14336, 4096, "stats_swiglu"),
                (32, 4096, 14336, "producer"), (32, 128256, 4096, "stats")],
    # the batch-1 GEMVs of a layer and the head, with and without their RMSNorm prologue, for the
    # CUDA family (`--family gemv_cuda`): does the norm cost it, and which rings stream best
    "b1cuda": [(1, 128256, 4096, "norm"), (1, 14336, 4096, "norm_swiglu"), (1, 6144, 4096, "norm"),
               (1, 6144, 4096, "plain"), (1, 14336, 4096, "swiglu"), (1, 4096, 14336, "residual")],
    "fused": [(1, 6144, 4096, "norm"), (1, 14336, 4096, "norm_swiglu"), (32, 6144, 4096, "norm"),
              (32, 14336, 4096, "norm_swiglu"), (1, 128256, 4096, "norm")],
}
STATS_CHUNK = 64  # fuse-norm-statistics' default chunk (columns a sum of squares covers)
SKINNY_M = 64  # shapes with at most this many rows are also timed under CUDA graphs
L2_BYTES = 60 << 20  # the H200's L2 as torch reports it

# -- the curated quick subset -------------------------------------------------------------------
_PLAIN = {"GROUP_M": 8, "SPLIT_K": 1, "PERSISTENT": False, "USE_TMA": False, "EPILOGUE_SUBTILE": 1}


def _point(bm, bn, bk, warps, stages, **variant):
    return {**_PLAIN, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, **variant}


_TMA_PERSISTENT = {"PERSISTENT": True, "USE_TMA": True}
QUICK_LARGE = [
    # the plain kernel: 128x256 is the point measured at 0.952 ms on `up` (2026-11-30)
    _point(128, 256, 64, 8, 3),
    _point(128, 128, 64, 8, 4),
    # persistent grid, pointer loads (cp.async)
    _point(128, 256, 64, 8, 3, PERSISTENT=True, EPILOGUE_SUBTILE=2),
    _point(128, 128, 64, 8, 4, PERSISTENT=True),
    # one program per tile, tensor copies (TMA) in and out
    _point(128, 256, 64, 8, 3, USE_TMA=True),
    _point(128, 256, 64, 8, 4, USE_TMA=True, EPILOGUE_SUBTILE=2),
    _point(128, 128, 64, 8, 5, USE_TMA=True),
    # persistent + TMA: the heuristic's first picks (`up`: s4 halves; `down`: s3 halves)
    _point(128, 256, 64, 8, 4, **_TMA_PERSISTENT, EPILOGUE_SUBTILE=2),
    _point(128, 256, 64, 8, 3, **_TMA_PERSISTENT, EPILOGUE_SUBTILE=2),
    _point(128, 256, 64, 8, 3, **_TMA_PERSISTENT),
    _point(128, 128, 64, 8, 4, **_TMA_PERSISTENT),
    _point(128, 128, 64, 8, 5, **_TMA_PERSISTENT),
    _point(128, 128, 64, 4, 4, **_TMA_PERSISTENT),
    _point(128, 128, 128, 8, 3, **_TMA_PERSISTENT, EPILOGUE_SUBTILE=2),
    _point(128, 256, 128, 8, 2, **_TMA_PERSISTENT, EPILOGUE_SUBTILE=2),
    _point(64, 256, 64, 8, 4, **_TMA_PERSISTENT, EPILOGUE_SUBTILE=2),
]
QUICK_DECODE = [
    # the plain kernel on 16-row tiles (what decode ran before the GEMV kernel)
    _point(16, 32, 128, 4, 4),
    _point(16, 64, 128, 4, 4),
    _point(16, 32, 128, 4, 4, SPLIT_K=2),
    _point(16, 64, 128, 4, 5, SPLIT_K=4),
    _point(32, 64, 128, 4, 4),  # legal for M = 32 only
]


def _gemv(bm, bn, bk, split, stages, warps=4):
    return _point(bm, bn, bk, warps, stages, GEMV=True, GROUP_M=1, SPLIT_K=split)


# The GEMV kernel (bench of 2026-11-30, H200, CUDA graphs: the first points of each group are the
# heuristic's picks). Each shape keeps the points `check` accepts: BLOCK_M = 1 needs M <= 4,
# SPLIT_K needs fewer than 2 x 132 column tiles.
QUICK_GEMV = [
    # one row, multiply-and-sum: 1x4096x4096 3.1 TB/s, N or K 14336 4.0, N 128256 4.5
    _gemv(1, 16, 512, 1, 3), _gemv(1, 32, 256, 1, 3),
    _gemv(1, 16, 512, 1, 4), _gemv(1, 32, 256, 1, 4), _gemv(1, 16, 256, 1, 3), _gemv(1, 16, 256, 1, 4),
    _gemv(1, 32, 512, 1, 3), _gemv(1, 64, 256, 1, 3),
    _gemv(1, 64, 128, 1, 4),  # 64 programs for N = 4096: half the SMs idle
    # split K (the arrival counters): ~5% slower per doubling at N = 4096
    _gemv(1, 16, 256, 2, 4), _gemv(1, 16, 512, 2, 4), _gemv(1, 32, 256, 2, 4), _gemv(1, 32, 512, 2, 3),
    _gemv(1, 32, 256, 4, 3), _gemv(1, 32, 256, 4, 4), _gemv(1, 32, 128, 4, 5), _gemv(1, 64, 256, 8, 3),
    # tl.dot on 16 rows (M <= 16), rows past M masked
    _gemv(16, 32, 256, 1, 4), _gemv(16, 32, 512, 1, 3), _gemv(16, 64, 256, 1, 3), _gemv(16, 128, 256, 1, 3),
    _gemv(16, 32, 256, 1, 3), _gemv(16, 16, 512, 1, 3), _gemv(16, 64, 256, 2, 3), _gemv(16, 64, 256, 2, 4),
    _gemv(16, 32, 256, 4, 3), _gemv(16, 32, 256, 4, 4),
    # tl.dot on 32 rows: 32x4096x4096 2.7 TB/s (cuBLAS 2.5)
    _gemv(32, 32, 256, 1, 4), _gemv(32, 32, 512, 1, 3), _gemv(32, 64, 256, 1, 3), _gemv(32, 128, 256, 1, 3),
    _gemv(32, 64, 512, 1, 2), _gemv(32, 64, 256, 2, 3), _gemv(32, 64, 128, 2, 4), _gemv(32, 32, 128, 4, 4),
    _gemv(32, 32, 256, 4, 3), _gemv(32, 16, 256, 4, 4),
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the curated subset (~24 points)")
    parser.add_argument("--shapes", default="up,down,decode", help="comma list of: " + ",".join(SHAPES))
    parser.add_argument("--variants", default="all", choices=["all", "plain", "persistent", "tma", "gemv", "stream-k"],
                        help="full mode: keep only points of this kernel variant; stream-k: the advisor's first "
                             "--advised GEMV points, each beside its stream-K twins")
    parser.add_argument("--family", default="matmul_epilogue",
                        choices=["matmul_epilogue", "gemv_cuda", "both"],
                        help="whose points: the Triton template's (the modes above), the CUDA GEMV's (its legal "
                             "points, then a wider grid of warps and ring depths), or both")
    parser.add_argument("--limit", type=int, default=None, help="full mode: at most this many points per shape")
    parser.add_argument("--advised", type=int, default=3,
                        help="quick and --sample modes: also the heuristic advisor's first N points per shape")
    parser.add_argument("--sample", type=int, default=None,
                        help="full mode: a seeded random sample of this many legal points per shape (plus --advised)")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="parallel compile processes")
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    parser.add_argument("--list", action="store_true", help="print the points per shape and exit (no GPU needed)")
    return parser.parse_args()


# -- regions, inputs, references ----------------------------------------------------------------
def make_region(m: int, n: int, k: int, epilogue: str):
    from coopt.ir.region import RegionSummary, TensorSpec

    swiglu = epilogue.endswith("swiglu")
    inputs = [TensorSpec((m, k), "bfloat16"), TensorSpec((2 * n if swiglu else n, k), "bfloat16")]
    program, has_bias = [], epilogue in ("gelu", "residual")
    if has_bias:
        inputs.append(TensorSpec((n,), "bfloat16"))
    extra_attrs = {}
    if epilogue.startswith("norm"):  # the RMSNorm prologue's weight
        inputs.append(TensorSpec((k,), "bfloat16"))
        extra_attrs["prologue"] = {"kind": "rms_norm", "eps": 1e-5, "has_weight": True}
    elif epilogue.startswith("stats"):  # fuse-norm-statistics' consumer: a = h * g, the rows' chunk sums of h^2
        inputs.append(TensorSpec((k // STATS_CHUNK, m), "float32"))
        extra_attrs["prologue"] = {"kind": "rms_norm_stats", "eps": 1e-5, "squares_input": len(inputs) - 1}
    outputs = [TensorSpec((m, n), "bfloat16")]
    if epilogue == "producer":  # fuse-norm-statistics' producer: h = acc + residual, then h * g and h's chunk sums
        inputs += [TensorSpec((m, n), "bfloat16"), TensorSpec((n,), "bfloat16")]
        program = [["y", "add", ["acc", "in0"]]]
        outputs += [TensorSpec((m, n), "bfloat16"), TensorSpec((n // STATS_CHUNK, m), "float32")]
        extra_attrs["row_squares"] = {"chunk": STATS_CHUNK, "weight_input": len(inputs) - 1, "output": 0}
    if swiglu:
        extra_attrs["glu"] = True
        program = [["t0", "silu", ["acc"]], ["y", "mul", ["t0", "acc_hi"]]]
    if epilogue == "gelu":
        program = [["y", "gelu", ["acc"]]]
    elif epilogue == "residual":
        inputs.append(TensorSpec((m, n), "bfloat16"))
        program = [["y", "add", ["acc", "in0"]]]
    return RegionSummary(
        name=f"gemm_{m}x{n}x{k}_{epilogue}", family="matmul_epilogue", inputs=tuple(inputs), outputs=tuple(outputs),
        attrs={"b_layout": "nk", "has_bias": has_bias, "epilogue": program, "outputs": ["y"] if program else ["acc"],
               **extra_attrs},
    )


def make_inputs(region, seed: int = 0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = region.inputs[0].shape[-1]
    tensors = []
    for i, spec in enumerate(region.inputs):
        x = torch.randn(spec.shape, generator=gen, device="cuda", dtype=torch.float32)
        if spec.dtype == "float32":  # a stats prologue's chunk sums of squares: positive, fp32
            tensors.append(x.abs())
            continue
        if i == 1:
            x = x / math.sqrt(k)  # keep the product O(1), as a trained weight would
        elif len(spec.shape) == 1 and "prologue" in region.attrs:
            x = 1 + 0.1 * x  # a norm weight
        tensors.append(x.to(torch.bfloat16))
    return tensors


def eager(region, inputs):
    """The region as the model runs it: F.linear (cuBLAS) then the epilogue (with fuse-decode-gemv's
    forms: F.rms_norm before, silu(gate) * up after, each its own kernel)."""
    import torch.nn.functional as F

    program = region.attrs["epilogue"]
    bias = inputs[2] if region.attrs["has_bias"] else None
    x = inputs[0]
    prologue = region.attrs.get("prologue") or {}
    if prologue.get("kind") == "rms_norm":
        x = F.rms_norm(x, (x.shape[-1],), inputs[2], 1e-5)
    y = F.linear(x, inputs[1], bias)
    if prologue.get("kind") == "rms_norm_stats":  # (h * g) @ W / rms(h), rms from the chunk sums
        squares = inputs[prologue["squares_input"]]
        y = (y.float() * (squares.sum(0) / x.shape[-1] + 1e-5).rsqrt()[:, None]).to(y.dtype)
    if region.attrs.get("glu"):
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    if program and program[0][1] == "gelu":
        y = F.gelu(y)
    elif program and program[0][1] == "add":  # the residual, after a, b and a bias where there is one
        y = y + inputs[2 + int(region.attrs["has_bias"])]
    return y


def traffic_bytes(region) -> int:
    """Bytes every input and output must cross DRAM at least once (the GB/s denominator)."""
    from coopt.ir.region import DTYPE_BYTES

    specs = (*region.inputs, *region.outputs)
    return sum(math.prod(s.shape) * DTYPE_BYTES[s.dtype] for s in specs)


# -- points ------------------------------------------------------------------------------------------
def select_points(region, args) -> list[dict]:
    from coopt.targets import H200
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    family = MatmulEpilogueFamily()
    m = region.inputs[0].shape[0]
    if args.quick:
        curated = QUICK_GEMV + QUICK_DECODE if m <= SKINNY_M else QUICK_LARGE
        points = [{**_PLAIN, **p} for p in curated if family.check(region, p, H200) is None]
        return points + [p for p in advised_points(region, args.advised) if p not in points]
    if args.variants == "stream-k":
        return stream_k_pairs(region, args.advised)
    points = family.legal_points(region, H200)
    keep = {
        "all": lambda p: True,
        "plain": lambda p: not (p["PERSISTENT"] or p["USE_TMA"]),
        "persistent": lambda p: p["PERSISTENT"] and not p["USE_TMA"],
        "tma": lambda p: p["USE_TMA"],
        "gemv": lambda p: p.get("GEMV"),
    }[args.variants]
    points = [p for p in points if keep(p)]
    if args.sample is not None:  # the advisor's first points, then a fixed random draw from the rest (0: none)
        advised = [p for p in advised_points(region, args.advised) if keep(p)]
        rest = [p for p in points if p not in advised]
        return advised + random.Random(0).sample(rest, min(args.sample, len(rest)))
    return points[: args.limit] if args.limit else points


# gemv_cuda points past the family's space: deeper rings keep more of each row's
# bytes in flight with fewer rows at once (what the family's space could grow into)
CUDA_WIDE = {"num_warps": [8, 16], "ROWS": [1, 2], "num_stages": [4, 8, 12, 16], "BLOCKS": [1], "STAGGER": [0, 1]}


CUDA_KNOBS = ("num_warps", "ROWS", "num_stages", "BLOCKS", "STAGGER")  # a point as WARPS:ROWS:STAGES:BLOCKS:STAGGER


def cuda_point(fields: list[str]) -> dict:
    """A gemv_cuda point from its five knob values (the probes' WARPS:ROWS:STAGES:BLOCKS:STAGGER)."""
    return dict(zip(CUDA_KNOBS, map(int, fields), strict=True))


def cuda_points(region) -> list[dict]:
    """gemv_cuda's legal points for the region, then the CUDA_WIDE grid's points that fit an SM."""
    from coopt.targets import H200
    from coopt.templates.base import cuda_point_problem
    from coopt.templates.gemv_cuda import GemvCudaFamily, gemv_problem, shared_bytes

    if gemv_problem(region) is not None:
        return []
    points = GemvCudaFamily().legal_points(region, H200)
    glu, (n_rows, k) = bool(region.attrs.get("glu")), region.inputs[1].shape
    for values in itertools.product(*CUDA_WIDE.values()):
        params = dict(zip(CUDA_WIDE, values))
        if (glu and params["ROWS"] != 2) or n_rows % params["ROWS"] or params in points:
            continue
        if cuda_point_problem(shared_bytes(params, k, glu), H200) is None:
            points.append(params)
    return points


def family_points(region, args) -> list[tuple[str, dict]]:
    """(family name, point) pairs --family asks for."""
    template = [] if args.family == "gemv_cuda" else [("matmul_epilogue", p) for p in select_points(region, args)]
    cuda = [] if args.family == "matmul_epilogue" else [("gemv_cuda", p) for p in cuda_points(region)]
    return template + cuda


def stream_k_pairs(region, count: int) -> list[dict]:
    """The advisor's first `count` GEMV points of one program a tile (no SPLIT_K), each followed by
    its stream-K twins: the same tile with the weight's (tile, K step) pairs shared out equally
    among STREAM_K programs an SM, timed side by side; at fewer pipeline stages where the twin's
    programs would not fit an SM's shared memory at the point's own."""
    from coopt.targets import H200
    from coopt.templates.matmul_epilogue import STREAM_K_PROGRAMS_PER_SM, MatmulEpilogueFamily

    family = MatmulEpilogueFamily()
    single = [p for p in advised_points(region, 4 * count) if p.get("GEMV") and p["SPLIT_K"] == 1 and not p["STREAM_K"]]
    points = []
    for base in single[:count]:
        points.append(base)
        for n in STREAM_K_PROGRAMS_PER_SM:
            twins = ({**base, "STREAM_K": n, "num_stages": stages} for stages in range(base["num_stages"], 1, -1))
            points += [twin for twin in twins if family.check(region, twin, H200) is None][:1]
    return points


def advised_points(region, count: int) -> list[dict]:
    """The heuristic advisor's first `count` points for the region (what a build tries first)."""
    try:
        from coopt.llm_advisor import AdviceRequest, HeuristicAdvisor
    except ImportError as error:  # its OpenAI advisor needs pydantic, absent on the GPU image
        print(f"no advised points ({error}): only the curated ones", flush=True)
        return []
    from coopt.targets import H200
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    family = MatmulEpilogueFamily()
    legal = family.legal_points(region, H200)
    request = AdviceRequest(region, family.name, family.param_space(region, H200), tuple(legal), H200.facts())
    chosen, tiles = [], set()
    for params in HeuristicAdvisor().advise(request).ranked:
        tile = tuple(sorted((k, v) for k, v in params.items() if k not in ("num_warps", "num_stages")))
        if len(chosen) < count and tile not in tiles:  # distinct tiles, as a build's top-k
            chosen.append({**_PLAIN, **params})
            tiles.add(tile)
    return chosen


def label(params: dict) -> str:
    if "ROWS" in params:  # a gemv_cuda point
        return (f"cuda w{params['num_warps']} r{params['ROWS']} s{params['num_stages']} b{params['BLOCKS']}"
                + (" stagger" if params.get("STAGGER") else ""))
    text = f"{params['BLOCK_M']}x{params['BLOCK_N']}x{params['BLOCK_K']} w{params['num_warps']} s{params['num_stages']}"
    text += f" g{params['GROUP_M']}" + (f" splitk{params['SPLIT_K']}" if params["SPLIT_K"] > 1 else "")
    flags = [name for name, on in (("persistent", params.get("PERSISTENT")), ("tma", params.get("USE_TMA"))) if on]
    if params.get("EPILOGUE_SUBTILE", 1) > 1:
        flags.append(f"subtile{params['EPILOGUE_SUBTILE']}")
    if params.get("GEMV"):
        flags.append("gemv" + ("-fma" if params["BLOCK_M"] == 1 else "-dot"))
        flags += [name.lower() for name in ("NORM_FIRST", "SWAP_AB") if params.get(name)]
        if params.get("STREAM_K"):
            flags.append(f"streamk{params['STREAM_K']}")
    return text + (" " + "+".join(flags) if flags else "")


def _warm(job) -> str | None:
    """Worker process: compile one point by running it once on the GPU (fills the shared cache)."""
    path, shape = job
    try:
        from coopt.runtime.kernel_loader import load_module_from_file

        region = make_region(*shape)
        load_module_from_file(path).run(*make_inputs(region))
        import torch

        torch.cuda.synchronize()
        return None
    except Exception as error:  # reported by the timing pass as well
        return f"{type(error).__name__}: {str(error)[:200]}"


# -- timing ------------------------------------------------------------------------------------------
def input_copies(inputs, bytes_read: int | None = None) -> list:
    """The inputs and enough copies of them that the bytes one call reads (default: all of input
    1, the weight) come to 3x the L2 over all copies: a CUDA graph replays without flushing the
    L2, so consecutive captured calls must read other data."""
    if bytes_read is None:
        bytes_read = inputs[1].numel() * inputs[1].element_size()
    copies = max(1, math.ceil(3 * L2_BYTES / bytes_read))
    return [list(inputs)] + [[t.clone() for t in inputs] for _ in range(copies - 1)]


def graph_ms(call, input_sets, rep: int = 50) -> float:
    """Median ms of one call replayed in a CUDA graph that captures a few thousand calls, each on
    the next input set (triton.testing.do_bench_cudagraph, triton 3.6 and 3.9 alike)."""
    import torch
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()  # the copies are ready before the graph's side stream reads them
    rotation = itertools.cycle(input_sets)
    return do_bench_cudagraph(lambda: call(*next(rotation)), rep=rep, return_mode="median")


def timings(call, inputs, input_sets=None) -> tuple:
    """(do_bench ms) or, given input sets, (do_bench ms, CUDA-graph ms): medians of one call.

    do_bench flushes the L2 before each call and times it with events, launch overhead included
    where the CPU falls behind; the graph variant is `graph_ms`.
    """
    from triton.testing import do_bench

    ms = do_bench(lambda: call(*inputs), return_mode="median")
    return (ms,) if input_sets is None else (ms, graph_ms(call, input_sets))


class PointTimes:
    """A probe's timed points: record() times one graph-replayed over the input sets and, unless
    it is timing only (error=None), checks it before and after timing with error() (relative
    error: under 2e-2 passes); prints a row and keeps it (a compile or launch failure is a row
    too). best[(case, kind)]: each kind's fastest passing time, in µs."""

    def __init__(self, width: int = 44):
        self.rows, self.best, self.width = [], {}, width

    def record(self, case: str, kind: str, name: str, call, sets, traffic: int, error=None) -> None:
        try:
            checks = [error()] if error else []
            us = graph_ms(call, sets) * 1e3
            checks += [error()] if error else []  # after thousands of replays
        except Exception as failure:
            print(f"  {name:{self.width}s} FAILED: {type(failure).__name__}: {str(failure)[:300]}", flush=True)
            self.rows.append({"case": case, "kind": kind, "point": name, "failed": str(failure)[:300]})
            return
        err = max(checks) if checks else None
        wrong = err is not None and not err < 2e-2
        self.rows.append({"case": case, "kind": kind, "point": name, "us": us, "tb_per_s": traffic / us / 1e6,
                          "err": err, "wrong": wrong})
        print(f"  {name:{self.width}s} {us:8.2f} us {traffic / us / 1e6:5.2f} TB/s  "
              + ("timing only" if err is None else f"err {err:.1e}") + ("  WRONG" if wrong else ""), flush=True)
        if not wrong:
            self.best[(case, kind)] = min(self.best.get((case, kind), us), us)

    def print_best(self) -> None:
        print("\nbest of each kind, µs")
        for (case, kind), us in sorted(self.best.items()):
            print(f"  {case:14s} {kind:18s} {us:8.2f}")


def relative_error(out, expected) -> float:
    return (out.float() - expected).abs().max().item() / expected.abs().max().item()


def reporter(rows: list, shape, traffic: int):
    """report(name, timings, err, versus): print one line and append it to `rows`."""
    m, n, k, _ = shape

    def bandwidth(ms: float) -> str:
        gbs = traffic / ms / 1e6
        return f"{gbs:6.0f} GB/s {100 * gbs * 1e9 / reference_bandwidth():3.0f}%"

    def report(name: str, measured: tuple, err=None, versus=None):
        ms, graph_ms = measured[0], (measured[1] if len(measured) > 1 else None)
        rows.append({"shape": shape, "point": name, "ms": ms, "graph_ms": graph_ms, "gbs": traffic / ms / 1e6,
                     "graph_gbs": traffic / graph_ms / 1e6 if graph_ms else None,
                     "tflops": 2 * m * n * k / ms / 1e9, "err": err})
        text = f"  {name:52s} {ms * 1e3:8.1f} us {bandwidth(ms)}"
        if graph_ms is None:
            text += f" {2 * m * n * k / ms / 1e9:7.1f} TFLOP/s"
        else:
            text += f" | graph {graph_ms * 1e3:7.1f} us {bandwidth(graph_ms)}"
        if err is not None:
            text += f"  err {err:.1e}"
        if versus:
            text += "  " + " ".join(f"{ref[-1] / measured[-1]:5.2f}x {what}" for ref, what in zip(versus, ("cublas", "eager")))
        print(text, flush=True)

    return report


# -- the run -----------------------------------------------------------------------------------------
def print_points(groups: dict, label) -> None:
    """--list: each group's points (no GPU needed)."""
    for name, points in groups.items():
        print(f"{name}: {len(points)} points")
        for params in points:
            print("   ", label(params))


def announce_gpu(script: str, **extra) -> bool:
    """Print the GPU and versions as one JSON line; False (after saying why) without CUDA."""
    import torch
    import triton

    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return False
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                      "floor_tb_s": round(reference_bandwidth() / 1e12, 3), **extra}), flush=True)
    return True


def main() -> int:
    args = parse_args()
    shapes = list(dict.fromkeys(shape for name in args.shapes.split(",") for shape in SHAPES[name]))
    if args.list:
        print_points({shape: [p for _, p in family_points(make_region(*shape), args)] for shape in shapes}, label)
        return 0
    if not announce_gpu("bench/gemm.py", mode="quick" if args.quick else "full"):
        return 2
    import torch

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.templates.registry import template_families

    work_dir = Path(tempfile.mkdtemp(prefix="coopt_gemm_"))

    # 1. render every (shape, point) and compile the Triton ones in parallel (NVRTC compiles a
    # CUDA point in the process that runs it: nothing a worker could leave behind)
    plan = []
    for shape in shapes:
        region = make_region(*shape)
        for i, (family, params) in enumerate(family_points(region, args)):
            path = work_dir / f"{region.name}__{i}.py"
            path.write_text(template_families()[family].render(region, params))
            plan.append((shape, family, params, str(path)))
    started = time.time()
    triton_jobs = [(path, shape) for shape, family, _, path in plan if family == "matmul_epilogue"]
    print(f"compiling {len(triton_jobs)} Triton kernels in {args.jobs} processes ...", flush=True)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        warmed = dict(zip([path for path, _ in triton_jobs], pool.map(_warm, triton_jobs)))
    warm_errors = [warmed.get(path) for *_, path in plan]
    print(f"compiled in {time.time() - started:.0f} s", flush=True)

    # 2. per shape: references, then every point (checked, timed, checked again)
    rows = []
    for shape in shapes:
        m, n, k, epilogue = shape
        region = make_region(*shape)
        inputs = make_inputs(region)
        with torch.no_grad():
            expected = eager(region, inputs).float()
        # decode-sized: also replayed in a CUDA graph, rotating through copies past L2
        input_sets = input_copies(inputs) if m <= SKINNY_M else None
        report = reporter(rows, shape, traffic_bytes(region))
        print(f"\n{m}x{n}x{k} {epilogue} (bf16): {2 * m * n * k / 1e12:.3f} TFLOP, "
              f"{traffic_bytes(region) / 1e6:.1f} MB" + (f", graphs rotate {len(input_sets)} input copies" if input_sets else ""),
              flush=True)
        cublas = timings(lambda a, b, *_: torch.matmul(a, b.T), inputs, input_sets)
        reference = timings(lambda *xs: eager(region, xs), inputs, input_sets)
        report("cublas (torch.matmul, no epilogue)", cublas)
        report("eager (F.linear + epilogue)", reference)
        results = []
        for (s, _, params, path), warm_error in zip(plan, warm_errors):
            if s != shape:
                continue
            name = label(params)
            try:
                run = load_module_from_file(path).run
                err = relative_error(run(*inputs)[0], expected)
                if not err < 2e-2:
                    print(f"  {name:52s} WRONG: max rel err {err:.2e}", flush=True)
                    continue
                measured = timings(run, inputs, input_sets)
                # thousands of calls later (cached workspace, arrival counters): still right
                err = max(err, relative_error(run(*inputs)[0], expected))
                if not err < 2e-2:
                    print(f"  {name:52s} WRONG after timing: max rel err {err:.2e}", flush=True)
                    continue
            except Exception as error:
                print(f"  {name:52s} FAILED: {warm_error or f'{type(error).__name__}: {str(error)[:200]}'}", flush=True)
                continue
            results.append((measured[-1], name, measured, err))
        for _, name, measured, err in sorted(results):
            report(name, measured, err, versus=(cublas, reference))
        if args.json:  # after every shape: a run cut short by a time limit keeps what it measured
            args.json.write_text(json.dumps(rows, indent=1))
    print(f"\ntotal {time.time() - started:.0f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
