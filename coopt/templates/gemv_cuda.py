"""gemv_cuda: a batch-1 decode GEMV (y = epilogue(W x), x one row) in CUDA C++, launched by PDL.

The same regions as the Triton `matmul_epilogue` family (templates/matmul_epilogue.py documents
the schema), narrowed to what this kernel implements: one activation row (static leading dims of
product 1), bf16 a, b and outputs, b [N, K] row-major with K a multiple of 256, an optional bias,
an optional RMSNorm prologue (the norm weight loaded before the PDL wait, x read once after it:
the row's 1 / rms, then x / rms * g staged rounded to bf16 once, as the unfused norm writes it),
an optional GLU ([gate; up] rows, the epilogue program combining acc and acc_hi), and an epilogue
program of elementwise fns over acc and extra inputs of N elements (a residual add), one output.
b and the norm weight must be parameters (they are read before the wait). Where it matches it is
one more family of candidates beside the Triton template's, verified and timed like them; the
build keeps the fastest that verifies.

Why: each of a b1 decode layer's GEMVs pays ~3.9 µs over its bytes (bench/RESULTS.md session 30),
the drain of the kernel before and its own ramp; the Triton template launched with PDL measured
no better (its grid is several programs an SM, so a successor's early programs crowd out its own).
This kernel's grid is one wave (a persistent block an SM, each warp streaming row groups through
its own cp.async ring of 512-byte slabs), it issues its ring's first slabs before
`griddepcontrol.wait` (a weight is no kernel's output) and lets its successor in right after. On
the H200 (bench/cuda_gemv_pdl_probe.py, session 30), o -> gate|up -> down of a Llama-3-8B layer:
95.8-96.6 µs launched with PDL against 98.2-98.7 for the template's three launches (98.5-98.7
with the template's own PDL). Alone (session 31, bench/gemm.py --shapes b1cuda): q|k|v with its
norm 14.6 µs against the template's 15.4, gate|up 55.7 against 57.3, down and the head even.

The kernel has no static __shared__ (the norm's per-warp sums sit after the rings): static
shared memory goes before the dynamic part, and 64 bytes of it put every ring slot off a
128-byte boundary, where each slab's cp.async took twice the write wavefronts (ncu, session 31:
gate|up with its norm 70.5 µs against 57.8 without: what session 30's builds lost every norm
region to).

PDL: the module's kernels launch with it where the build measured the step faster so
(selection.json "pdl" naming PDL_KIND "gemv_cuda": tune/launch.py), or where COOPT_PDL says; the
kernel waits before it reads x, the bias or the extra inputs (b and g, parameters, go before),
and is correct either way. The launch step measures it: on session 31's b1 / 32768 selection
(two-block GEMVs among them) PDL cost 280 µs a step, and the build kept it off.

Verification needs the GPU: the family offers no point where torch sees no CUDA device (CPU CI
renders the kernel and compiles it for sm_90a (NVRTC or nvcc: tests/conftest.py compile_for_hopper);
tests/templates/test_gemv_cuda.py).

Knobs: num_warps (8 or 16: warps of the one block an SM), ROWS (weight rows a warp streams
together; a GLU group is always its gate and up rows), num_stages (slabs in a warp's ring),
BLOCKS (blocks an SM: 2 leaves less room for the successor's blocks under PDL), STAGGER (1: each
warp starts its rows at its own slab, so the grid's reads at a moment are not all at one offset of
rows 8 KB apart).
"""

from __future__ import annotations

import math

from coopt.ir.region import RegionSummary
from coopt.targets import Target
from coopt.templates.base import TemplateFamily, cuda_point_problem, render_template
from coopt.templates.ewprogram import render_program
from coopt.templates.matmul_epilogue import MatmulEpilogueFamily, _first_extra, _n_extra, _norm_prologue

SLAB = 256  # bf16 elements of a row a warp copies at once (16 bytes a lane)
SLAB_BYTES = 2 * SLAB


def _static_ints(shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def gemv_problem(region: RegionSummary) -> str | None:
    """Why the kernel cannot implement a matmul_epilogue region (None: it can)."""
    if not MatmulEpilogueFamily().matches(region):
        return "not a matmul_epilogue region the GEMM family takes"
    attrs = region.attrs
    a, b = region.inputs[0], region.inputs[1]
    if attrs.get("b_layout") != "nk":
        return "needs b as [N, K] (an nn.Linear weight)"
    if any(t.dtype != "bfloat16" for t in (a, b, *region.outputs)):
        return "needs bf16 activations, weight and output"
    if not _static_ints(a.shape) or math.prod(a.shape[:-1]) != 1:
        return "needs one activation row (static leading dims of product 1: batch-1 decode)"
    if not _static_ints(b.shape) or b.shape[1] % SLAB:
        return f"needs a static weight whose K is a multiple of {SLAB}"
    if attrs.get("prologue") is not None and _norm_prologue(region) is None:
        return "its prologue is not an RMSNorm of the row"
    names = region.input_names  # empty where unknown (a bench's or test's hand-made region)
    if names and not all(i < len(names) and names[i] for i in read_before_wait(region)):
        return "reads its weight and norm weight before its PDL wait: they must be the model's parameters"
    if attrs.get("row_squares") is not None:
        return "writes row statistics (fuse-norm-statistics' producer form)"
    if len(region.outputs) != 1 or len(attrs.get("outputs", [])) != 1:
        return "needs one output"
    width = region.outputs[0].shape[-1]
    extras = region.inputs[_first_extra(region):_first_extra(region) + _n_extra(region)]
    if any(not _static_ints(t.shape) or math.prod(t.shape) != width or t.dtype != "bfloat16" for t in extras):
        return "needs bf16 extra inputs of the output's N elements"
    try:
        epilogue_lines(region)
    except (KeyError, ValueError) as error:
        return f"its epilogue program has no CUDA form ({error})"
    return None


def read_before_wait(region: RegionSummary) -> list[int]:
    """Inputs the kernel reads before griddepcontrol.wait: b, and the norm weight where there is
    one (after b and the bias). Only parameters may be: no kernel before writes them."""
    norm = _norm_prologue(region)
    has_g = bool(norm and norm.get("has_weight"))
    return [1] + ([2 + int(bool(region.attrs.get("has_bias")))] if has_g else [])


def epilogue_lines(region: RegionSummary) -> tuple[list[str], str]:
    """The epilogue program as CUDA statements over v_acc (v_acc_hi) and the extras' element n,
    and the expression of its output."""
    names = {"acc": "v_acc", "acc_hi": "v_acc_hi"} if region.attrs.get("glu") else {"acc": "v_acc"}
    names.update({f"in{i}": f"lo_bf16(in{i}[n])" for i in range(_n_extra(region))})
    lines = render_program(region.attrs.get("epilogue", []), names, dialect="cuda")
    return lines, names[region.attrs["outputs"][0]]


def shared_bytes(params: dict, k: int, glu: bool) -> int:
    """x staged for the block in bf16 (normalised where there is a norm), every warp's ring, then
    the norm's per-warp sums of squares (one float a warp, room kept with or without a norm)."""
    rows = 2 if glu else params["ROWS"]
    return 2 * k + params["num_warps"] * params["num_stages"] * rows * SLAB_BYTES + 4 * params["num_warps"]


class GemvCudaFamily(TemplateFamily):
    name = "gemv_cuda"

    def matches(self, region: RegionSummary) -> bool:
        return region.family == "matmul_epilogue" and gemv_problem(region) is None

    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        return {"num_warps": [8, 16], "ROWS": [1, 2], "num_stages": [4, 6, 8], "BLOCKS": [1, 2], "STAGGER": [0, 1]}

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        problem = gemv_problem(region) or self.outside_space(region, params, target)
        if problem is not None:
            return problem
        if not target.arch.startswith("sm_9"):
            return "written for Hopper (sm_9x): griddepcontrol (PDL) and cp.async rings"
        glu, n_rows = bool(region.attrs.get("glu")), region.inputs[1].shape[0]
        if glu and params["ROWS"] != 2:
            return "a GLU row group is its gate and up rows: ROWS=2"
        if not glu and n_rows % params["ROWS"]:
            return f"N={n_rows} is not a multiple of ROWS={params['ROWS']}"
        k = region.inputs[1].shape[1]
        return cuda_point_problem(shared_bytes(params, k, glu), target)

    def pdl_ready(self, region: RegionSummary, params: dict) -> bool:
        """One block an SM, and 8 warps for a GLU: only chains of such GEMVs gained from PDL
        (session 31, bench/gemv_cuda_pdl_chain.py: 2.5-2.9 µs a layer's o -> gate|up -> down; a
        16-warp gate|up or a two-block grid lost 15-50 µs, its blocks crowding out the next's)."""
        return params.get("BLOCKS") == 1 and (not region.attrs.get("glu") or params.get("num_warps") == 8)

    def render(self, region: RegionSummary, params: dict) -> str:
        norm = _norm_prologue(region)
        glu = bool(region.attrs.get("glu"))
        n_rows, k = region.inputs[1].shape
        lines, out_name = epilogue_lines(region)
        rows = 2 if glu else params["ROWS"]
        return render_template(
            "cuda/gemv.py.j2",
            region_name=region.name,
            p=params,
            k=k,
            n_rows=n_rows,
            n_out=region.outputs[0].shape[-1],
            groups=n_rows // rows,
            norm=norm is not None,
            norm_weight=bool(norm and norm.get("has_weight")),
            eps=f"{float(norm['eps']) if norm else 0.0!r}f",
            glu=glu,
            bias=bool(region.attrs.get("has_bias")),
            extras=_n_extra(region),
            program=lines,
            out_name=out_name,
            shared_bytes=shared_bytes(params, k, glu),
        )
