"""matmul_epilogue: C = A @ B' (+ bias), then an elementwise epilogue, in one Triton kernel.

Region schema (coopt.ir.region): inputs a [..., K], b ([N, K] "nk" or [K, N] "kn"), [bias [N]],
extra epilogue tensors broadcastable to [..., N]; attrs {"b_layout", "has_bias", "epilogue",
"outputs"}. The leading dims of `a` are flattened into M; b is read through its strides (an
nn.Linear weight is never transposed in memory).

Knobs (all explicit lists, pruned by `check`):
    BLOCK_M, BLOCK_N, BLOCK_K  output / reduction tile
    GROUP_M                    row-tiles that share a column of B while it is hot in L2
    SPLIT_K                    K split across programs, for small-M (decode) shapes that would
                               leave SMs idle: fp32 partials and a reduce/epilogue kernel (the
                               GEMV kernel instead meets its splits in the same launch)
    num_warps, num_stages      launch options (num_stages = software-pipeline depth)

Hopper variants (knobs of the same kernel family; see bench/NOTES-gemm.md for what they compile to):
    PERSISTENT                 one program per SM walks the output tiles in grouped order; the
                               tile and K loops are fused, so the next tile's loads overlap the
                               epilogue. Needs SPLIT_K=1 and BLOCK_M, BLOCK_N >= 64.
    USE_TMA                    operands load and outputs store through tensor descriptors (the
                               copy engine: `cp.async.bulk.tensor`), which frees the registers
                               and issue slots that pointer loads use. 16-bit operands of one
                               dtype only; `check` rejects static sizes whose rows are not
                               16-byte aligned, and run() falls back to pointer loads/stores in
                               the same kernel when a launch's tensors are not aligned (symbolic
                               sizes, strided views).
    EPILOGUE_SUBTILE           1 or 2: the epilogue runs on BLOCK_N / 2 wide halves (half the
                               TMA store buffer, so one more operand stage fits).

Warp specialization is not a knob: in Triton 3.6 and 3.9 it compiles for Hopper only with 4
warps and pointer stores, and fails for larger tiles in 3.9 (bench/NOTES-gemm.md).

Skinny-GEMM variant (decode: M <= 64 rows against a weight of thousands of rows and columns):
    GEMV                       `_gemv_kernel`, one launch that streams the weight at bandwidth:
                               a 1-D grid of cdiv(M, BLOCK_M) x SPLIT_K x cdiv(N, BLOCK_N)
                               programs (row tiles adjacent, so they share each weight slab in
                               L2), each reducing a K-slice of a [BLOCK_N, K] weight slab through
                               a `tl.range(num_stages)` software pipeline. BLOCK_M = 1 multiplies
                               and sums on CUDA cores (no 16-row padding of the activation tile);
                               BLOCK_M >= 16 uses tl.dot with rows past M masked (never loaded).
                               With SPLIT_K > 1 the splits of a tile meet in the same launch: each
                               stores its fp32 partial to a workspace and bumps the tile's arrival
                               counter; the last to arrive sums the partials in split order
                               (deterministic), runs the epilogue and zeroes the counter. The
                               workspace is allocated once per device and kept on the module, so
                               a call allocates only its outputs and a CUDA graph can capture it.
                               Offered only where the region is planned for M <= 64 (its example
                               M, else its bound); BLOCK_M = 1 (at most 4 rows), BLOCK_N = 16 and
                               BLOCK_K >= 256 exist for this kernel only, GROUP_M is 1.
                               Measured on the H200 in CUDA graphs (bench/gemm.py --quick
                               --shapes skinny; M x N x K, bf16, TB/s of weight streamed, cuBLAS
                               in brackets): 1x4096x4096 3.1 (2.7), 1x4096x14336 4.0 (3.7),
                               1x14336x4096 4.0 (3.9), 1x128256x4096 4.5 (4.4), 32x4096x4096
                               2.7 (2.5).
    SWAP_AB (tl.dot tiles)     the dot computes acc^T = B_slab @ A_rows^T: BLOCK_N (>= 64)
                               weight rows on the tensor cores' 64-row side, BLOCK_M activation
                               rows on the narrow side (on sm_90 a wgmma instead of mma on
                               rows padded to 16), transposed back before the epilogue.
    STREAM_K (GEMV points)     programs an SM (1, 2 or 4; 0 off; SPLIT_K=1): one wave of SMs x
                               STREAM_K programs, each owning an equal contiguous range of the
                               (tile, K step) pairs,
                               so every SM streams the same share of the weight (one program a
                               tile leaves q|k|v's 384 programs uneven on 132 SMs and a tail
                               where few run). Tiles shared by programs meet as SPLIT_K's do, a
                               slot per program in the tile's order (deterministic). Not with the
                               RMSNorm computed in the kernel (its row sums would need meeting too;
                               NORM_FIRST and the producer's statistics serve). Unmeasured on a
                               GPU so far: the heuristic ranks it out of a build's top 3 until
                               bench/gemm.py --variants stream-k has measured it.
    MEET (GEMV points of       how a tile's splits meet: "count" (each stores its fp32 partial,
    SPLIT_K > 1)               then bumps the tile's arrival counter; the last sums) or "flag"
                               (the last split is the merger, fixed in advance: the others store
                               each partial value beside a flag in one 64-bit word and leave, the
                               merger polls the words until all carry the flag, empties them and
                               sums; one L2 round trip after its loop instead of three). Same
                               sums in the same order. "flag" runs only where the grid has at most
                               one program an SM (else the launch takes the count meeting), and
                               not with a GLU or the in-kernel norm's row sums.

Fused forms of the GEMV kernel (attrs "prologue" / "glu" / "row_squares", regions of
fuse-decode-gemv and fuse-norm-statistics): only
GEMV points are legal for them, so such a region exists only where M is decode-sized.
    RMSNorm prologue           inputs a, b, [bias], g [K]: the K loop sums each row's squares
                               (fp32) and multiplies x by g on load; 1/rms(row) scales the fp32
                               accumulator before bias and epilogue (it factors out of the dot).
                               BLOCK_M = 1 keeps x * g in fp32; tl.dot rounds x * g to a's dtype
                               once (the reference rounds the normed row once too). SPLIT_K
                               stores each split's row sums beside its partials and the last
                               split adds them up in order, like the partials.
                               NORM_FIRST=True runs the norm in a kernel of its own before
                               the plain GEMV (one program per row writes the normed rows in
                               a's dtype): on tl.dot tiles the in-loop prologue measured 2x
                               slower than eager norm + cuBLAS at 32 rows on the H200.
    Row statistics             attrs "row_squares" {"chunk": C, "weight_input": i, "output": o}
    (producer of a norm's      (fuse-norm-statistics): inputs ..., g [N] last (i); outputs ...,
    input)                     hg = h * g [..., N] in h's dtype, sq [N / C, M] fp32, h being
                               output o as rounded to its dtype. The epilogue (direct and the
                               split-K last arriver alike) stores hg and the tile's chunk sums
                               of h^2: BLOCK_N must be a multiple of C (check()), so every
                               chunk sum has one writer (no atomics, no meeting).
    RMSNorm statistics         prologue {"kind": "rms_norm_stats", "eps", "squares_input": j}:
    prologue (consumer)        inputs a = hg, b, [bias], sq [K / C, M] fp32 (j), extras. Each
                               program sums its rows' chunk sums (fp32; up to 64 chunks a load,
                               all loads of an unrolled sweep in flight together) once at its
                               start, after the PDL wait, independent of the weight stream;
                               rsqrt(sum / K + eps) scales the fp32 accumulator where the
                               in-loop norm's 1/rms does (before bias, GLU and the epilogue).
                               No NORM_FIRST, no work in the K loop.
    GLU epilogue               b = [gate | up] halves of 2N rows: each program streams the same
                               BLOCK_N rows of both (two slabs a K step, counted twice in the
                               register and shared-memory checks) into acc and acc_hi, which the
                               epilogue program combines (silu(acc) * acc_hi) into [M, N].
                               Measured on sm_90 (triton 3.9), a [BLOCK_K] lane accumulator for
                               the squares cost 157 registers against 48 kept as [1, BLOCK_K] in
                               the slab's layout; tl.dot tiles of the fused forms have their own
                               register estimates (_MAX_GEMV_FUSED_*).

What Triton's interpreter (CPU tests) runs: every point, TMA ones included (it emulates tensor
descriptors, zero padding and clipped stores); bf16 dots are upcast to fp32 there, and the
persistent grid has 3 programs so each walks several tiles. What it cannot show (copy engine,
wgmma, pipelining, registers, shared memory) is checked by compiling for sm_90.

Example (an MLP up-projection with SiLU, for 1..2048 tokens):
    >>> from coopt.ir.region import RegionSummary, TensorSpec
    >>> from coopt.targets import H200
    >>> region = RegionSummary(
    ...     "mlp_up", "matmul_epilogue",
    ...     inputs=(TensorSpec(("S", 4096), "bfloat16"), TensorSpec((11008, 4096), "bfloat16")),
    ...     outputs=(TensorSpec(("S", 11008), "bfloat16"),),
    ...     attrs={"b_layout": "nk", "has_bias": False, "epilogue": [["y", "silu", ["acc"]]], "outputs": ["y"]},
    ...     dims={"S": (1, 2048)})
    >>> family = MatmulEpilogueFamily()
    >>> params = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 1,
    ...           "num_warps": 4, "num_stages": 3}
    >>> family.check(region, params, H200)
    '128x256 fp32 accumulator over 4 warps spills registers'
    >>> family.check(region, {**params, "num_warps": 8}, H200) is None
    True
    >>> "def run(a, b):" in family.render(region, {**params, "num_warps": 8})
    True
"""

from __future__ import annotations

import math

from coopt.ir.region import DTYPE_BYTES, RegionSummary, TensorSpec, gemv_prologue
from coopt.targets import Target
from coopt.templates.base import TemplateFamily, dim_range, next_pow2, render_template
from coopt.templates.ewprogram import render_program

_TL_DTYPE = {"float32": "tl.float32", "bfloat16": "tl.bfloat16", "float16": "tl.float16"}
_TORCH_DTYPE = {"float32": "torch.float32", "bfloat16": "torch.bfloat16", "float16": "torch.float16"}

# Registers per thread above which a tile spills (ptxas for sm_90, triton 3.9). bf16/fp16 run on
# wgmma with operands in shared memory: the fp32 accumulator counts. fp32 (IEEE, no tensor
# cores) also holds operand slices in registers.
_MAX_ACC_REGS_PER_THREAD = {"bf16/fp16": 128, "fp32": 64}
_MAX_FP32_ACC_AND_OPERAND_REGS = 144

# The variants' knobs; a point without them (older advice, caches) is the plain kernel.
VARIANT_DEFAULTS = {"PERSISTENT": False, "USE_TMA": False, "EPILOGUE_SUBTILE": 1, "GEMV": False, "NORM_FIRST": False,
                    "SWAP_AB": False, "STREAM_K": 0, "MEET": "count"}
# Programs an SM of the stream-K GEMV (0: one program a tile and K split).
STREAM_K_PROGRAMS_PER_SM = (1, 2, 4)
# GEMV is offered where the region is planned for at most this many rows: beyond it the weight
# is no longer the only traffic that matters and the tensor-core tiles win.
GEMV_MAX_M = 64
# Weight elements a thread holds per K step in the multiply-and-sum (BLOCK_M = 1) kernel: 128
# (a 32x512 bf16 slab over 4 warps) compiles to 114-144 registers without spills on sm_90
# (triton 3.6 and 3.9); twice that spills.
_MAX_GEMV_FMA_ELEMENTS_PER_THREAD = 128
# The tl.dot GEMV (BLOCK_M >= 16) of a fused region (norm prologue, GLU) on 16-bit operands:
# registers a thread holds per K step, estimated as fp32 accumulators + the activation tile (fp32
# with a norm prologue, which squares and scales it; packed 16-bit without) + the weight slabs
# (packed 16-bit). Compiled for sm_90 (triton 3.9): estimates up to 208 used 94-216 registers
# without spills; 224 (32x64x256, norm + GLU) spilled at 2 stages, 272 used 240 of 255.
_MAX_GEMV_FUSED_DOT_REGS = 208
# The same on the IEEE fp32 path, estimated as for the tile kernels (accumulators + operands, all
# fp32): up to 88 compiled to 56-128 registers; 112 with norm + GLU used 255 and spilled hundreds.
_MAX_GEMV_FUSED_FP32_REGS = 96
# Barriers and alignment padding the compiler adds to the tile loop's shared memory (<= 1.1 KB
# measured for sm_90 with triton 3.6 and 3.9).
_TILE_LOOP_SMEM_SLACK = 2048


def _norm_prologue(region: RegionSummary) -> dict | None:
    """attrs["prologue"] when it is an RMSNorm of a's rows, else None."""
    return gemv_prologue(region, "rms_norm")


def _stats_prologue(region: RegionSummary) -> dict | None:
    """attrs["prologue"] when the norm takes its rows' sums of squares from the producer
    (fuse-norm-statistics: a is h * g already, the chunk sums an input), else None."""
    return gemv_prologue(region, "rms_norm_stats")


def _row_squares(region: RegionSummary) -> dict | None:
    """attrs["row_squares"]: the region also writes h * g and h's chunk sums of squares."""
    stats = region.attrs.get("row_squares")
    return stats if isinstance(stats, dict) else None


def _inline_norm(region: RegionSummary, params: dict) -> dict | None:
    """The norm prologue the GEMV kernel applies itself (None with NORM_FIRST: a kernel before it does)."""
    return None if params.get("NORM_FIRST") else _norm_prologue(region)


def _first_extra(region: RegionSummary) -> int:
    """Index of the first extra epilogue input: after a, b, [bias], [the norm weight] and [the
    sums of squares of a statistics prologue]."""
    norm = _norm_prologue(region)
    return (2 + int(bool(region.attrs.get("has_bias"))) + int(bool(norm and norm.get("has_weight")))
            + int(_stats_prologue(region) is not None))


def _n_extra(region: RegionSummary) -> int:
    """How many extra epilogue inputs there are (the row statistics' norm weight comes last)."""
    return len(region.inputs) - _first_extra(region) - int(_row_squares(region) is not None)


def _loaded_extras(region: RegionSummary) -> list[TensorSpec]:
    """The extra epilogue inputs that the epilogue program reads (in0, in1, ...)."""
    first, n_extra = _first_extra(region), _n_extra(region)
    used = {a for _, _, args in region.attrs.get("epilogue", []) for a in args if isinstance(a, str)}
    used |= set(region.attrs.get("outputs", []))
    return [spec for i, spec in enumerate(region.inputs[first:first + n_extra]) if f"in{i}" in used]


def _gemv_only(region: RegionSummary) -> str | None:
    """What only the GEMV kernel implements (a norm prologue, a GLU epilogue, row statistics), or None."""
    parts = [what for what, on in (("the RMSNorm prologue", _norm_prologue(region)),
                                   ("the RMSNorm statistics prologue", _stats_prologue(region)),
                                   ("the GLU epilogue", region.attrs.get("glu")),
                                   ("the row statistics outputs", _row_squares(region))) if on]
    return " and ".join(parts) or None


class MatmulEpilogueFamily(TemplateFamily):
    name = "matmul_epilogue"

    # -- shape facts -------------------------------------------------------------------
    @staticmethod
    def _mnk(region: RegionSummary):
        """(M, N, K) ranges; N is the output's width (half of b's for a GLU region)."""
        a, b = region.inputs[0].shape, region.inputs[1].shape
        n_dim, k_dim = (b[0], b[1]) if region.attrs["b_layout"] == "nk" else (b[1], b[0])
        if region.attrs.get("glu"):
            n_dim //= 2  # static: matches() requires it
        return dim_range(region, a[:-1]), dim_range(region, [n_dim]), dim_range(region, [k_dim])

    @staticmethod
    def _ieee_dot(region: RegionSummary) -> bool:
        """fp32 operands keep IEEE fp32 (no TF32); mixed dtypes are computed in fp32 too."""
        a_dtype, b_dtype = region.inputs[0].dtype, region.inputs[1].dtype
        return not (a_dtype == b_dtype and a_dtype in ("bfloat16", "float16"))

    def matches(self, region: RegionSummary) -> bool:
        if region.family != self.name or len(region.inputs) < 2:
            return False
        a, b = region.inputs[0], region.inputs[1]
        if len(a.shape) < 1 or len(b.shape) != 2 or region.attrs.get("b_layout") not in ("nk", "kn"):
            return False
        n_extra = _n_extra(region)
        dtypes_ok = all(s.dtype in _TL_DTYPE for s in (*region.inputs, *region.outputs))
        if region.attrs.get("prologue") is not None and _norm_prologue(region) is None \
                and _stats_prologue(region) is None:
            return False  # a prologue this family does not know
        row_squares = _row_squares(region)
        if row_squares is not None and not self._row_squares_fit(region, row_squares):
            return False
        if region.attrs.get("glu"):
            # b holds both halves ([2N, K] "nk", [K, 2N] "kn"); no bias (the merged gate|up has none)
            n_b = b.shape[0] if region.attrs["b_layout"] == "nk" else b.shape[1]
            width = region.outputs[0].shape[-1] if region.outputs and region.outputs[0].shape else None
            static = isinstance(n_b, int) and isinstance(width, int)
            if region.attrs.get("has_bias") or not (static and n_b == 2 * width):
                return False
        n_outputs = len(region.attrs.get("outputs", [])) + (2 if row_squares is not None else 0)
        return n_extra >= 0 and dtypes_ok and len(region.outputs) == n_outputs

    @staticmethod
    def _row_squares_fit(region: RegionSummary, row_squares: dict) -> bool:
        """The weight is the last input, [N]; N a static multiple of the chunk; h (the output
        it names) stays in its dtype; sq is fp32."""
        width = region.outputs[0].shape[-1] if region.outputs and region.outputs[0].shape else None
        chunk, which = row_squares.get("chunk"), row_squares.get("output", 0)
        return (isinstance(width, int) and isinstance(chunk, int) and chunk > 0 and width % chunk == 0
                and row_squares.get("weight_input") == len(region.inputs) - 1
                and which < len(region.attrs.get("outputs", [])) and region.outputs[-1].dtype == "float32")

    @staticmethod
    def _planned_m(region: RegionSummary) -> int | None:
        """The M a region is tuned for: at its example dims where it has them, else its bound."""
        lead = tuple(region.inputs[0].shape[:-1])
        if region.example_dims and any(isinstance(d, str) for d in lead):
            try:
                return math.prod(TensorSpec(lead, "float32").concrete(region.example_dims))
            except Exception:  # a symbol without an example value: plan for the bound
                pass
        return dim_range(region, lead)[1]

    def _small_m(self, region: RegionSummary) -> bool:
        planned = self._planned_m(region)
        return planned is not None and planned <= GEMV_MAX_M

    def _shape_facts(self, region: RegionSummary):
        """((M, N, K ranges), small M) of the region last asked about: legal_points checks tens
        of thousands of points of one region, and the dim arithmetic would dominate."""
        cached = getattr(self, "_facts_cache", None)
        if cached is None or cached[0] is not region:
            cached = self._facts_cache = (region, (self._mnk(region), self._small_m(region)))
        return cached[1]

    # -- the space -----------------------------------------------------------------------
    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        space = {
            "BLOCK_M": [16, 32, 64, 128],
            "BLOCK_N": [32, 64, 128, 256],
            "BLOCK_K": [32, 64, 128],
            "GROUP_M": [1, 8],
            "SPLIT_K": [1, 2, 4, 8],
            "num_warps": [4, 8],
            "num_stages": [2, 3, 4, 5],
            "PERSISTENT": [False, True],
            "USE_TMA": [False, True],
            "EPILOGUE_SUBTILE": [1, 2],
        }
        if self._shape_facts(region)[1]:  # decode-sized: the GEMV kernel and its tiles too
            space.update(BLOCK_M=[1, *space["BLOCK_M"]], BLOCK_N=[16, *space["BLOCK_N"]],
                         BLOCK_K=[*space["BLOCK_K"], 256, 512], GEMV=[False, True])
            if _norm_prologue(region) is not None:  # the RMSNorm inside the GEMV or a kernel before it
                space["NORM_FIRST"] = [False, True]
            space["SWAP_AB"] = [False, True]  # tl.dot tiles: activation rows or weight rows on the 64-row side
            space["STREAM_K"] = [0, *STREAM_K_PROGRAMS_PER_SM]  # a form of the GEMV points of SPLIT_K=1
            space["MEET"] = ["count", "flag"]  # how a GEMV point's K splits meet (SPLIT_K > 1)
        return space

    def legal_points(self, region: RegionSummary, target: Target, space: dict[str, list] | None = None) -> list[dict]:
        """The legal points of the space less STREAM_K and MEET (each with STREAM_K=0 and
        MEET="count" where the space has the knob: a point names every knob of its space), each
        legal GEMV point of SPLIT_K=1 followed by its legal stream-K twins, each of SPLIT_K > 1 by
        its flag-meeting twin. The twins apply to those points only: in the product they would
        multiply the tens of thousands of points checked."""
        space = dict(self.param_space(region, target) if space is None else space)
        if "STREAM_K" not in space and "MEET" not in space:
            return super().legal_points(region, target, space)
        stream_k = [n for n in space.pop("STREAM_K", []) if n]
        meets = [m for m in space.pop("MEET", []) if m != "count"]
        plain = {"STREAM_K": 0} if stream_k else {}
        plain.update({"MEET": "count"} if meets else {})
        points = []
        for point in super().legal_points(region, target, space):
            points.append({**point, **plain})
            if not point.get("GEMV"):
                continue
            twins = ([{**point, **plain, "STREAM_K": n} for n in stream_k] if point["SPLIT_K"] == 1
                     else [{**point, **plain, "MEET": m} for m in meets])
            points.extend(twin for twin in twins if self.check(region, twin, target) is None)
        return points

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        knobs = {**VARIANT_DEFAULTS, **params}
        if knobs["STREAM_K"] and not knobs["GEMV"]:
            return "STREAM_K is a form of the GEMV kernel (GEMV=True)"
        if knobs["MEET"] != "count":
            reason = self._check_meet(region, knobs)
            if reason:
                return reason
        if knobs["NORM_FIRST"] and not (knobs["GEMV"] and _norm_prologue(region) is not None):
            return "NORM_FIRST runs a region's RMSNorm prologue ahead of the GEMV kernel (GEMV=True and a norm prologue)"
        if knobs["SWAP_AB"] and not (knobs["GEMV"] and params["BLOCK_M"] >= 16 and params["BLOCK_N"] >= 64):
            return "SWAP_AB puts a GEMV's weight slab on the tensor cores' 64-row side (GEMV=True, BLOCK_M >= 16, BLOCK_N >= 64)"
        row_squares = _row_squares(region)
        if row_squares is not None and params["BLOCK_N"] % row_squares["chunk"]:
            # a program's output tile holds whole chunks: each chunk sum has one writer
            return f"row statistics in chunks of {row_squares['chunk']} columns need BLOCK_N a multiple of it"
        if knobs["GEMV"]:
            return self._check_gemv(region, params, target)
        return self._check_tiles(region, params, target)

    def _check_tiles(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        """The tensor-core kernels: the plain grid and the tile loop (PERSISTENT / USE_TMA)."""
        bm, bn, bk = params["BLOCK_M"], params["BLOCK_N"], params["BLOCK_K"]
        warps, stages, split_k = params["num_warps"], params["num_stages"], params["SPLIT_K"]
        (m_lo, m_hi), (n_lo, n_hi), (k_lo, k_hi) = self._shape_facts(region)[0]
        elem = max(DTYPE_BYTES[region.inputs[0].dtype], DTYPE_BYTES[region.inputs[1].dtype])
        if bm < 16 or bn < 32 or bk > 128:
            return f"{bm}x{bn}x{bk} is a GEMV tile (BLOCK_M=1, BLOCK_N=16, BLOCK_K>128 need GEMV=True)"
        gemv_only = _gemv_only(region)
        if gemv_only:
            return f"{gemv_only} run in the GEMV kernel only (GEMV=True)"
        reason = self._check_variant(region, params)
        if reason:
            return reason
        smem = (bm * bk + bk * bn) * elem * stages + self._epilogue_smem(region, params)
        if smem > target.smem_per_block_bytes:
            return f"operand tiles need {smem} B of shared memory > {target.smem_per_block_bytes} B"
        threads = 32 * warps
        fp32 = self._ieee_dot(region)
        if bm * bn // threads > _MAX_ACC_REGS_PER_THREAD["fp32" if fp32 else "bf16/fp16"]:
            return f"{bm}x{bn} fp32 accumulator over {warps} warps spills registers"
        if fp32 and (bm * bn + bm * bk + bk * bn) // threads > _MAX_FP32_ACC_AND_OPERAND_REGS:
            return f"{bm}x{bn}x{bk} fp32 accumulator and operands over {warps} warps spill registers"
        if warps == 8 and bm * bn < 64 * 128:
            return f"8 warps on a {bm}x{bn} tile leave most threads idle"
        # A tile may cover the largest problem, never more (floors keep tl.dot's minimum sizes).
        for knob, size, hi, floor in (("BLOCK_M", bm, m_hi, 16), ("BLOCK_N", bn, n_hi, 32), ("BLOCK_K", bk, k_hi, 32)):
            if hi is not None and size > max(floor, next_pow2(hi)):
                return f"{knob}={size} exceeds the problem (at most {hi})"
        if split_k > 1:
            if -(-k_lo // bk) < 2 * split_k:
                return f"SPLIT_K={split_k} leaves fewer than 2 K-steps of {bk} per split (K >= {k_lo})"
            tiles = -(-m_lo // bm) * -(-n_lo // bn)
            if tiles >= target.num_sms:
                return f"{tiles} output tiles already fill {target.num_sms} SMs without SPLIT_K"
        return None

    def _check_variant(self, region: RegionSummary, params: dict) -> str | None:
        """The Hopper knobs (PERSISTENT, USE_TMA, EPILOGUE_SUBTILE), which GEMV does not take."""
        knobs = {**VARIANT_DEFAULTS, **params}
        persistent, tma, subtile = (knobs[k] for k in ("PERSISTENT", "USE_TMA", "EPILOGUE_SUBTILE"))
        if knobs["GEMV"] and (persistent or tma or subtile != 1):
            return "GEMV is a kernel of its own (PERSISTENT, USE_TMA, EPILOGUE_SUBTILE need GEMV=False)"
        if not (persistent or tma):
            return "EPILOGUE_SUBTILE applies to the PERSISTENT / USE_TMA kernel" if subtile != 1 else None
        if params["SPLIT_K"] > 1:
            return "SPLIT_K runs on the plain grid (PERSISTENT and USE_TMA need SPLIT_K=1)"
        if params["BLOCK_M"] < 64 or params["BLOCK_N"] < 64:
            return "PERSISTENT / USE_TMA target tensor-core tiles (BLOCK_M, BLOCK_N >= 64)"
        if subtile == 2 and params["BLOCK_N"] < 128:
            return "EPILOGUE_SUBTILE=2 splits only tiles with BLOCK_N >= 128"
        if tma:
            return self._check_tma(region)
        return None

    def _check_gemv(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        """The skinny-GEMM kernel: decode-sized M, a [BLOCK_N, BLOCK_K] weight slab per step."""
        bm, bn, bk, split_k = params["BLOCK_M"], params["BLOCK_N"], params["BLOCK_K"], params["SPLIT_K"]
        ((m_lo, m_hi), (n_lo, n_hi), (k_lo, k_hi)), small = self._shape_facts(region)
        if not small:
            return f"GEMV is for decode-sized regions (M planned <= {GEMV_MAX_M}, here {self._planned_m(region)})"
        reason = self._check_variant(region, params)
        if reason:
            return reason
        if params["GROUP_M"] != 1:
            return "GEMV orders programs by weight slab, not in groups of row tiles (GROUP_M=1)"
        if bm == 1 and (m_hi is None or m_hi > 4):
            return "BLOCK_M=1 reads each weight slab once per row: for at most 4 rows"
        for knob, size, hi, floor in (("BLOCK_M", bm, m_hi, 16), ("BLOCK_N", bn, n_hi, 16), ("BLOCK_K", bk, k_hi, 32)):
            if hi is not None and size > max(floor, next_pow2(hi)):
                return f"{knob}={size} exceeds the problem (at most {hi})"
        reason = self._check_gemv_resources(region, params, target)
        if reason:
            return reason
        stream_k = params.get("STREAM_K", 0)
        if stream_k:
            if split_k > 1:
                return "STREAM_K splits K by ranges of its own (SPLIT_K=1)"
            if _inline_norm(region, params) is not None:
                return "STREAM_K needs the RMSNorm outside the GEMV loop (NORM_FIRST or the producer's statistics)"
            if stream_k * self._gemv_smem(region, params) > target.smem_per_block_bytes:
                return f"{stream_k} GEMV programs an SM need more than {target.smem_per_block_bytes} B of shared memory"
        if split_k > 1:
            if -(-k_lo // bk) < 2 * split_k:
                return f"SPLIT_K={split_k} leaves fewer than 2 K-steps of {bk} per split (K >= {k_lo})"
            # Two programs an SM already keep the weight streaming: splitting further only adds
            # partial sums.
            tiles = -(-m_lo // bm) * -(-n_lo // bn)
            if tiles >= 2 * target.num_sms:
                return f"{tiles} GEMV programs already give {target.num_sms} SMs two each without SPLIT_K"
        return None

    @staticmethod
    def _check_meet(region: RegionSummary, knobs: dict) -> str | None:
        """MEET="flag": the GEMV's K splits meet through flagged 64-bit words (matmul_epilogue_gemv.py.j2)."""
        if knobs["MEET"] != "flag":
            return f"MEET is 'count' or 'flag', not {knobs['MEET']!r}"
        if not knobs["GEMV"] or knobs["SPLIT_K"] < 2 or knobs["STREAM_K"]:
            return "MEET='flag' is how a GEMV point's K splits meet (GEMV=True, SPLIT_K > 1, STREAM_K=0)"
        if region.attrs.get("glu") or _inline_norm(region, knobs) is not None:
            return "MEET='flag' carries one fp32 partial a split (no GLU, no RMSNorm summed in the kernel)"
        return None

    def _check_gemv_resources(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        """Shared memory, registers and threads of one GEMV program."""
        bm, bn, bk, warps = params["BLOCK_M"], params["BLOCK_N"], params["BLOCK_K"], params["num_warps"]
        smem = self._gemv_smem(region, params)
        if smem > target.smem_per_block_bytes:
            return f"GEMV pipeline stages need {smem} B of shared memory > {target.smem_per_block_bytes} B"
        threads = 32 * warps
        halves = 2 if region.attrs.get("glu") else 1  # a GLU program streams two slabs per K step
        slabs = f"{halves} x {bn}x{bk}" if halves > 1 else f"a {bn}x{bk}"
        if bm == 1 and halves * bn * bk // threads > _MAX_GEMV_FMA_ELEMENTS_PER_THREAD:
            return f"{slabs} weight slab over {warps} warps spills registers (multiply-and-sum)"
        operand_regs = (halves * bm * bn + bm * bk + halves * bk * bn) // threads
        fused = bool(region.attrs.get("glu")) or _inline_norm(region, params) is not None  # in this kernel
        fp32_cap = _MAX_GEMV_FUSED_FP32_REGS if fused else _MAX_FP32_ACC_AND_OPERAND_REGS
        if bm > 1 and self._ieee_dot(region) and operand_regs > fp32_cap:
            return f"{bm}x{bn}x{bk} fp32 accumulator and operands over {warps} warps spill registers"
        if bm > 1 and not self._ieee_dot(region) and fused:
            norm = _inline_norm(region, params) is not None
            fused_regs = (halves * bm * bn + bm * bk * (1 if norm else 0.5) + halves * bk * bn * 0.5) / threads
            if fused_regs > _MAX_GEMV_FUSED_DOT_REGS:
                return f"{bm}x{bn}x{bk} tiles of {_gemv_only(region)} over {warps} warps spill registers"
        if warps == 8 and halves * bn * bk < 64 * 256:
            return f"8 warps on {slabs} weight slab leave most threads idle"
        return None

    @staticmethod
    def _gemv_smem(region: RegionSummary, params: dict) -> int:
        """Shared memory of the GEMV pipeline: Triton keeps num_stages - 1 activation and weight
        tiles in flight (measured for sm_90 with triton 3.6 and 3.9), plus reduction scratch.
        A GLU region streams two weight slabs a step, a norm prologue a slice of the norm weight;
        the IEEE fp32 tl.dot kernel (BLOCK_M > 1) then also changes the layout of the scaled
        activation tile through shared memory (measured for sm_90; 16-bit operands need none)."""
        a_elem, b_elem = DTYPE_BYTES[region.inputs[0].dtype], DTYPE_BYTES[region.inputs[1].dtype]
        bm, bn, bk = params["BLOCK_M"], params["BLOCK_N"], params["BLOCK_K"]
        halves = 2 if region.attrs.get("glu") else 1
        norm = _inline_norm(region, params)
        g_elem = DTYPE_BYTES[region.inputs[2 + int(bool(region.attrs.get("has_bias")))].dtype] \
            if norm and norm.get("has_weight") else 0
        step = bm * bk * a_elem + halves * bn * bk * b_elem + bk * g_elem
        rescaled = bm * bk * 4 if norm and bm > 1 and MatmulEpilogueFamily._ieee_dot(region) else 0
        # SWAP_AB's wgmma reads both operands from shared memory: num_stages buffers (sm_90, triton 3.9)
        buffers = params["num_stages"] - (0 if params.get("SWAP_AB") else 1)
        return buffers * step + rescaled + _TILE_LOOP_SMEM_SLACK

    def _check_tma(self, region: RegionSummary) -> str | None:
        """Tensor descriptors need 16-bit operands here and 16-byte aligned rows. Symbolic sizes
        are checked by run(), which falls back to pointer loads; static ones are checked here."""
        a, b = region.inputs[0], region.inputs[1]
        if self._ieee_dot(region):
            return "USE_TMA needs 16-bit (bf16 / fp16) operands of one dtype"
        k_dim = a.shape[-1]
        n_dim = b.shape[0] if region.attrs["b_layout"] == "nk" else b.shape[1]
        row_lengths = [("a", k_dim, DTYPE_BYTES[a.dtype]), ("b", b.shape[-1], DTYPE_BYTES[b.dtype])]
        row_lengths += [(f"output {i}", n_dim, DTYPE_BYTES[o.dtype]) for i, o in enumerate(region.outputs)]
        for name, length, size in row_lengths:
            if isinstance(length, int) and length * size % 16:
                return f"USE_TMA: rows of {name} ({length} x {size} B) are not 16-byte aligned"
        return None

    @staticmethod
    def _epilogue_smem(region: RegionSummary, params: dict) -> int:
        """Shared memory the tile-loop kernel needs besides the operand stages (an upper bound
        of what triton 3.6 and 3.9 allocate for sm_90; bench/NOTES-gemm.md has the measurements).

        Each output's [BLOCK_M, BLOCK_N / EPILOGUE_SUBTILE] tile is staged in shared memory (the
        TMA store buffer, or the layout change before pointer stores). The persistent kernel keeps
        the next tile's operands in flight during the epilogue, so extra epilogue inputs also
        need a layout-change buffer of their own (the plain grid reuses the idle operand stages).
        """
        knobs = {**VARIANT_DEFAULTS, **params}
        if not (knobs["PERSISTENT"] or knobs["USE_TMA"]):
            return 0
        tile = params["BLOCK_M"] * params["BLOCK_N"] // knobs["EPILOGUE_SUBTILE"]
        smem = sum(tile * DTYPE_BYTES[o.dtype] for o in region.outputs)
        extras = _loaded_extras(region)
        if knobs["PERSISTENT"] and extras:
            smem += tile * max(DTYPE_BYTES[spec.dtype] for spec in extras)
        return smem + _TILE_LOOP_SMEM_SLACK

    # -- rendering -------------------------------------------------------------------------
    def render(self, region: RegionSummary, params: dict) -> str:
        attrs = region.attrs
        has_bias = bool(attrs.get("has_bias"))
        params = {**VARIANT_DEFAULTS, **params}
        if _gemv_only(region) and not params["GEMV"]:
            raise ValueError(f"{_gemv_only(region)} run in the GEMV kernel only (GEMV=True)")
        norm = _norm_prologue(region) or _stats_prologue(region)
        row_squares = _row_squares(region)
        glu = bool(attrs.get("glu"))
        extras = [f"in{i}" for i in range(_n_extra(region))]
        program = attrs.get("epilogue", [])
        names = {"acc": "acc", **({"acc_hi": "acc_hi"} if glu else {}), **{e: e for e in extras}}
        epilogue_lines = render_program(program, names)
        used = {a for _, _, args in program for a in args if isinstance(a, str)} | set(attrs["outputs"])
        outputs = [
            {"value": names[out], "tl_dtype": _TL_DTYPE[spec.dtype], "torch_dtype": _TORCH_DTYPE[spec.dtype]}
            for out, spec in zip(attrs["outputs"], region.outputs)
        ]
        return render_template(
            "triton/matmul_epilogue.py.j2",
            region_name=region.name,
            params=params,
            b_layout=attrs["b_layout"],
            has_bias=has_bias,
            norm=norm and {"eps": float(norm["eps"]), "has_weight": bool(norm.get("has_weight")),
                           "stats": norm["kind"] == "rms_norm_stats", **self._stats_render(region, norm)},
            row_squares=row_squares and self._row_squares_render(row_squares, outputs),
            glu=glu,
            extras=extras,
            loaded_extras=[e for e in extras if e in used],
            epilogue_lines=epilogue_lines,
            outputs=outputs,
            ieee_dot=self._ieee_dot(region),
        )

    @staticmethod
    def _stats_render(region: RegionSummary, norm: dict) -> dict:
        """A statistics prologue's chunk count (static: K is a weight dim) and the chunks loaded
        at once (a power of two, at most 64 x the row tile in registers)."""
        if norm["kind"] != "rms_norm_stats":
            return {}
        chunks = region.inputs[norm["squares_input"]].shape[0]
        if not isinstance(chunks, int):
            raise ValueError(f"{region.name}: the sums of squares need a static chunk count, got {chunks!r}")
        return {"chunks": chunks, "chunks_at_once": min(next_pow2(chunks), 64)}

    @staticmethod
    def _row_squares_render(row_squares: dict, outputs: list[dict]) -> dict:
        """The template's view of attrs["row_squares"]: the chunk and h, the output it is about."""
        h = outputs[row_squares.get("output", 0)]
        return {"chunk": int(row_squares["chunk"]), "value": h["value"], "tl_dtype": h["tl_dtype"],
                "torch_dtype": h["torch_dtype"]}
