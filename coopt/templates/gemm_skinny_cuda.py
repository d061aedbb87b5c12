"""gemm_skinny_cuda: a decode-batch GEMM (y = epilogue(x W^T), x 2-64 rows) in CUDA C++, its K
split over the blocks of a thread-block cluster.

The same regions as the Triton `matmul_epilogue` family (templates/matmul_epilogue.py documents
the schema), narrowed to what this kernel implements: a static batch of 2-64 activation rows, bf16
a, b and outputs, b [N, K] row-major, an optional bias, the RMSNorm statistics prologue
(fuse-norm-statistics' consumer: a is h * g, the rows' 1 / rms from the producer's chunk sums of
squares), an optional GLU ([gate; up] rows), an epilogue program over acc and extra inputs of [M,
N] or [N] elements (a residual add), one output, and the row statistics outputs
(fuse-norm-statistics' producer: h * g and the chunk sums of h^2 for the next norm). Not the
RMSNorm computed in the kernel (a b32 build's norms take the statistics form; NORM_FIRST and the
Triton kernel serve the rest).

Why: at batch 32 a decode layer's GEMVs run in the Triton template at ~3.7 TB/s against the
batch-1 CUDA GEMV's ~4.5 (bench/NOTES-decode.md, session 34): their fixed costs and ramps. At 4.3
TB/s the b32 / 2048 fp8 and values-only steps would meet their 1.10x targets. x (32 x K bf16: 256
KB at K 4096) fits no SM's shared memory and re-reading it from L2 for every weight row costs as
many bytes as the weights, so the kernel splits K over a cluster (bench/cuda_gemm_skinny_probe.py
times the plain form):

- each block stages its K / CLUSTER slice of x once; each warp streams 32-row groups of W's slice
  slab by slab (KW columns) through its own cp.async ring (pieces XOR-swizzled by row), A = W
  rows and B = x rows by ldmatrix, mma.sync m16n8k16 bf16 with fp32 accumulators; the ring's
  first slabs go out before griddepcontrol.wait (a weight is no kernel's output);
- a cluster owns a contiguous share of the row groups, num_warps of them a round; each round's
  partial sums go to shared memory, the cluster meets (split barriers), and each block sums its
  units of the round's outputs over the cluster's blocks through distributed shared memory (in
  rank order: deterministic), then runs the epilogue and stores. PARTS=2 double-buffers the
  partials so a round's meeting is waited for only after the next round's loop;
- the grid is one wave of clusters (the driver's count of co-resident clusters).

**Slower than the Triton template where measured** (session 36, on an H100: no H200 was lent):
its GPU tests pass (the probe's and the family's), but the probe's best point streamed the five
b32 shapes 6-30 % slower than the template's first advised point (qkv 24.3 against 20.4 µs, o
17.9 / 15.2, gate|up 89.9 / 83.9, down 48.7 / 44.0, head 376 / 353; bench/RESULTS.md session 36).
So the family still matches only where COOPT_GEMM_SKINNY_CUDA=1, until an H200 measures it
faster. Verification needs the GPU anyway: the family offers no point where torch sees no CUDA
device (CPU CI renders every form and compiles it for sm_90a (NVRTC or nvcc:
tests/conftest.py compile_for_hopper); tests/templates/test_gemm_skinny_cuda.py).

Knobs: CLUSTER (blocks a cluster: K's split), num_warps (groups a round a block), num_stages
(slabs in a warp's ring), KW (columns a slab: 64 or 128), PARTS (partials buffers: 1 or 2).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from coopt.ir.region import RegionSummary
from coopt.targets import Target
from coopt.templates.base import TemplateFamily, cuda_point_problem, render_template
from coopt.templates.ewprogram import render_program
from coopt.templates.matmul_epilogue import (MatmulEpilogueFamily, _first_extra, _n_extra, _norm_prologue,
                                             _row_squares, _stats_prologue)

FLAG = "COOPT_GEMM_SKINNY_CUDA"  # "1": the family matches (until a GPU has run it)
GROUP_ROWS = 32  # weight rows a warp's group: two m16 tiles
MAX_M = 64


@dataclass(frozen=True)
class Layout:
    """How a point lays a problem out (the kernel's compile-time numbers; names as its macros)."""

    m: int  # activation rows
    m_pad: int  # rows the tensor cores see: 16, 32 or 64
    k: int
    n_out: int  # output columns
    opg: int  # outputs a group: 32, or 16 for a GLU's gate and up halves
    unit: int  # outputs a batch row one block sums at a time
    v: int  # consecutive outputs a thread sums and stores
    grain: int  # groups a cluster's share is made of
    lanes: int  # threads of a sum-of-squares chunk (producing), else 0
    shared: int  # bytes of dynamic shared memory a block


def layout(m: int, k: int, n_out: int, glu: bool, chunk: int, params: dict) -> Layout:
    """The layout of `params` for an [m, k] x [n_out (x 2 with a GLU), k] problem whose row
    statistics (if `chunk`) cover `chunk` columns; ValueError with the reason where the kernel
    cannot run it."""
    c, warps, stages, kw, parts = (params[knob] for knob in ("CLUSTER", "num_warps", "num_stages", "KW", "PARTS"))
    # rows the tensor cores see: 16, 32 or 64 (48 would leave no even split of a unit's outputs)
    m_pad, opg, threads = next(r for r in (16, 32, 64, m) if m <= r), 16 if glu else 32, 32 * warps

    def need(ok: bool, why: str) -> None:
        if not ok:
            raise ValueError(why)

    need(c in (1, 2, 4, 8, 16) and stages >= 2 and kw in (64, 128) and parts in (1, 2),
         "CLUSTER 1-16 (a power of 2), 2 or more slabs a ring, KW 64 or 128, PARTS 1 or 2")
    need(2 <= m <= MAX_M, f"M={m}: the kernel takes 2-{MAX_M} activation rows")
    need(k % (c * kw) == 0, f"K={k} is not whole slabs of {kw} columns in {c} shares")
    need(threads % m_pad == 0, f"{threads} threads do not split evenly over {m_pad} batch rows")
    need(n_out % opg == 0, f"N={n_out} is not whole groups of {opg} outputs")
    outputs_a_round = warps * opg
    need(outputs_a_round % c == 0, f"{outputs_a_round} outputs a round do not split over {c} blocks")
    unit = max(outputs_a_round // c, chunk)
    tpm = threads // m_pad
    need(outputs_a_round % unit == 0 and unit % tpm == 0, f"{unit} outputs a unit over {tpm} threads a row")
    v = unit // tpm
    need(v >= 2 and v % 2 == 0 and opg % v == 0, f"{v} outputs a thread in the reduction (needs an even divisor of {opg})")
    lanes, grain = 0, 1
    if chunk:
        need(n_out % chunk == 0 and chunk % v == 0 and unit % chunk == 0, f"chunks of {chunk} over {v} outputs a thread")
        lanes = chunk // v
        need(lanes & (lanes - 1) == 0 and lanes <= 32 and tpm % lanes == 0,
             f"a chunk's {lanes} threads are not consecutive lanes of one warp")
        grain = max(1, chunk // opg)
        need(chunk % opg == 0 or opg % chunk == 0, f"chunks of {chunk} across groups of {opg}")
        need(warps % grain == 0, f"{warps} warps a round are not whole chunks of {grain} groups")
    shared = m_pad * (k // c + 8) * 2 + warps * stages * GROUP_ROWS * kw * 2 + parts * m_pad * (warps * GROUP_ROWS + 4) * 4
    return Layout(m, m_pad, k, n_out, opg, unit, v, grain, lanes, shared)


def _static_ints(shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def extra_kinds(region: RegionSummary) -> list[str]:
    """Each extra epilogue input as "full" ([M, N] elements: a residual) or "column" ([N])."""
    m, width = math.prod(region.inputs[0].shape[:-1]), region.outputs[0].shape[-1]
    first = _first_extra(region)
    kinds = []
    for spec in region.inputs[first:first + _n_extra(region)]:
        if not _static_ints(spec.shape) or spec.dtype != "bfloat16" or spec.shape[-1:] != (width,):
            raise ValueError("needs bf16 extra inputs of [M, N] or [N] elements")
        size = math.prod(spec.shape)
        kinds.append("column" if size == width else "full" if size == m * width else "")
        if not kinds[-1]:
            raise ValueError("needs bf16 extra inputs of [M, N] or [N] elements")
    return kinds


def epilogue_lines(region: RegionSummary) -> tuple[list[str], str]:
    """The epilogue program as CUDA statements over v_acc (v_acc_hi) and the extras' element
    (at_full for [M, N] extras, n for [N]), and the expression of its output."""
    names = {"acc": "v_acc", "acc_hi": "v_acc_hi"} if region.attrs.get("glu") else {"acc": "v_acc"}
    for i, kind in enumerate(extra_kinds(region)):
        names[f"in{i}"] = f"lo_bf16(in{i}[{'at_full' if kind == 'full' else 'n'}])"
    lines = render_program(region.attrs.get("epilogue", []), names, dialect="cuda")
    return lines, names[region.attrs["outputs"][0]]


def skinny_problem(region: RegionSummary) -> str | None:
    """Why the kernel cannot implement a matmul_epilogue region (None: it can)."""
    if not MatmulEpilogueFamily().matches(region):
        return "not a matmul_epilogue region the GEMM family takes"
    attrs = region.attrs
    a, b = region.inputs[0], region.inputs[1]
    produce = _row_squares(region)
    outputs = region.outputs[:1]
    if attrs.get("b_layout") != "nk":
        return "needs b as [N, K] (an nn.Linear weight)"
    if any(t.dtype != "bfloat16" for t in (a, b, *outputs)) or (produce and region.outputs[1].dtype != "bfloat16"):
        return "needs bf16 activations, weight and outputs"
    if not _static_ints(a.shape) or not 2 <= math.prod(a.shape[:-1]) <= MAX_M:
        return f"needs a static batch of 2-{MAX_M} activation rows (static leading dims)"
    if not _static_ints(b.shape) or b.shape[1] % 64:
        return "needs a static weight whose K is a multiple of 64"
    if _norm_prologue(region) is not None:
        return "computes no RMSNorm itself (the statistics form of fuse-norm-statistics, or the Triton kernel)"
    if len(attrs.get("outputs", [])) != 1:
        return "needs one output"
    if produce and produce.get("output", 0) != 0:
        return "its row statistics must be of its output"
    names = region.input_names  # empty where unknown (a bench's or test's hand-made region)
    if names and not (len(names) > 1 and names[1]):
        return "reads its weight before its PDL wait: it must be a model parameter"
    try:
        epilogue_lines(region)
    except (KeyError, ValueError) as error:
        return f"its epilogue program has no CUDA form ({error})"
    return None


class GemmSkinnyCudaFamily(TemplateFamily):
    name = "gemm_skinny_cuda"

    def matches(self, region: RegionSummary) -> bool:
        return (os.environ.get(FLAG) == "1" and region.family == "matmul_epilogue"
                and skinny_problem(region) is None)

    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        return {"CLUSTER": [2, 4, 8, 16], "num_warps": [4, 6, 8, 12], "num_stages": [2, 3, 4, 6], "KW": [64, 128],
                "PARTS": [1, 2]}

    @staticmethod
    def _layout(region: RegionSummary, params: dict) -> Layout:
        glu, produce = bool(region.attrs.get("glu")), _row_squares(region)
        m, (n_b, k) = math.prod(region.inputs[0].shape[:-1]), region.inputs[1].shape
        return layout(m, k, n_b // 2 if glu else n_b, glu, produce["chunk"] if produce else 0, params)

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        problem = skinny_problem(region) or self.outside_space(region, params, target)
        if problem is not None:
            return problem
        if not target.arch.startswith("sm_9"):
            return "written for Hopper (sm_9x): thread-block clusters, distributed shared memory, griddepcontrol"
        try:
            shared = self._layout(region, params).shared
        except ValueError as error:
            return str(error)
        return cuda_point_problem(shared, target)

    def render(self, region: RegionSummary, params: dict) -> str:
        stats, produce = _stats_prologue(region), _row_squares(region)
        lines, out_name = epilogue_lines(region)
        return render_template(
            "cuda/gemm_skinny.py.j2",
            region_name=region.name,
            p=params,
            L=self._layout(region, params),
            glu=bool(region.attrs.get("glu")),
            stats={"chunks": region.inputs[stats["squares_input"]].shape[0], "eps": f"{float(stats['eps'])!r}f"} if stats else None,
            stats_shape=tuple(region.inputs[stats["squares_input"]].shape) if stats else None,
            bias=bool(region.attrs.get("has_bias")),
            extras=extra_kinds(region),
            program=lines,
            out_name=out_name,
            produce={"chunk": produce["chunk"]} if produce else None,
        )
