"""matmul_epilogue's GEMV-only forms (fuse-decode-gemv): an RMSNorm prologue and a GLU epilogue.

Kernels run in Triton's interpreter without a GPU (on the GPU machine, for real); references are
computed in float64 from the same inputs. bf16 tl.dot is upcast under the interpreter (the
template's UPCAST_DOT), and its fp32 -> bf16 conversions truncate: bf16 is compared at bf16
tolerance relative to the output's size.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from template_helpers import assert_gemv_points_compile
from template_helpers import run_candidate as _run_candidate

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILY = MatmulEpilogueFamily()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EPS = 1e-5
SWIGLU = [["t0", "silu", ["acc"]], ["t1", "mul", ["t0", "acc_hi"]]]

run_candidate = partial(_run_candidate, FAMILY, H200)


def gemv(bm, bn, bk, split=1, stages=3, warps=4):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "SPLIT_K": split,
            "num_warps": warps, "num_stages": stages, "GEMV": True}


def fused_region(lead, n, k, dtype="float32", *, norm=True, norm_weight=True, glu=False, has_bias=False,
                 b_layout="nk", extras=(), epilogue=None, outputs=None, dims=None) -> RegionSummary:
    """[*lead, k] -> [*lead, n]; with glu the weight holds 2n rows (columns for "kn")."""
    width = 2 * n if glu else n
    inputs = [TensorSpec((*lead, k), dtype), TensorSpec((width, k) if b_layout == "nk" else (k, width), dtype)]
    if has_bias:
        inputs.append(TensorSpec((n,), dtype))
    if norm and norm_weight:
        inputs.append(TensorSpec((k,), dtype))
    inputs += [TensorSpec(tuple(shape), dtype) for shape in extras]
    if epilogue is None:
        epilogue = SWIGLU if glu else []
    attrs = {"b_layout": b_layout, "has_bias": has_bias, "epilogue": [list(i) for i in epilogue],
             "outputs": list(outputs or ([epilogue[-1][0]] if epilogue else ["acc"]))}
    if norm:
        attrs["prologue"] = {"kind": "rms_norm", "eps": EPS, "has_weight": norm_weight}
    if glu:
        attrs["glu"] = True
    return RegionSummary("fused", "matmul_epilogue", tuple(inputs), (TensorSpec((*lead, n), dtype),), attrs, dims=dims or {})


def make_inputs(region: RegionSummary, magnitude: float = 1.0, concrete: dict | None = None, seed: int = 0):
    """Normal values; the activation (input 0) times `magnitude`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for i, spec in enumerate(region.inputs):
        values = torch.randn(spec.concrete(concrete or {}), generator=gen) * (magnitude if i == 0 else 1.0)
        tensors.append(values.to(DTYPES[spec.dtype]).to(DEVICE))
    return tensors


def reference(region: RegionSummary, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the matmul result before the epilogue program, the extras), in float64: the norm, the
    product (+ bias), and for GLU silu(low half) * high half."""
    attrs = region.attrs
    x, b = inputs[0].double(), inputs[1].double()
    rest = list(inputs[2:])
    bias = rest.pop(0).double() if attrs["has_bias"] else None
    prologue = attrs.get("prologue")
    if prologue:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + prologue["eps"])
        if prologue["has_weight"]:
            x = x * rest.pop(0).double()
    product = x @ (b.T if attrs["b_layout"] == "nk" else b)
    if bias is not None:
        product = product + bias
    if attrs.get("glu"):
        n = product.shape[-1] // 2
        product = torch.nn.functional.silu(product[..., :n]) * product[..., n:]
    return product, [t.double() for t in rest]


def check_close(actual: torch.Tensor, expected: torch.Tensor):
    assert actual.shape == expected.shape and actual.device.type == DEVICE
    expected = expected.to(actual.device)
    scale = expected.abs().max().item() + 1e-30
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-5 * scale)
    else:  # bf16 output: rounding (truncation in the interpreter) of the result and of x * g
        torch.testing.assert_close(actual.double(), expected, rtol=1.6e-2, atol=1.6e-2 * scale)


# K = 301 (odd): 9 full BLOCK_K=32 steps and a partial one, split 4 ways (the last split short);
# BLOCK_K=128 leaves a masked tail without splits. N = 50 is not a multiple of BLOCK_N.
POINTS = {
    "fma": gemv(1, 32, 128, stages=4),
    "fma_split": gemv(1, 16, 32, split=4),
    "dot": gemv(16, 32, 128, stages=2),
    "dot_split": gemv(16, 16, 32, split=4),
}
# Stream-K (14 programs under the interpreter) over 10 K steps of 32: ranges end inside tiles.
# Not with the RMSNorm in the loop (check()): the GLU forms only.
STREAM_POINTS = {"fma_stream": {**gemv(1, 16, 32), "STREAM_K": 2}, "dot_stream": {**gemv(16, 16, 32), "STREAM_K": 4}}


def _cases():
    for m in (1, 3, 16):
        for point in sorted(POINTS):
            if POINTS[point]["BLOCK_M"] > 1 or m <= 4:  # BLOCK_M=1: at most 4 rows
                yield m, point


@pytest.mark.parametrize("m,point", list(_cases()))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_prologue_matches_torch(m, point, dtype, load_candidate):
    region = fused_region((m,), 50, 301, dtype)
    for magnitude in (1.0, 1e3):  # the norm divides the magnitude out again
        inputs = make_inputs(region, magnitude)
        (out,) = run_candidate(load_candidate, region, POINTS[point], inputs, stem=f"norm_{point}_{m}_{magnitude:g}")
        check_close(out, reference(region, inputs)[0])


@pytest.mark.parametrize("m,point", list(_cases()))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_with_rms_norm_matches_torch(m, point, dtype, load_candidate):
    region = fused_region((m,), 50, 301, dtype, glu=True)
    inputs = make_inputs(region, 30.0, seed=1)
    (out,) = run_candidate(load_candidate, region, POINTS[point], inputs, stem=f"glu_norm_{point}_{m}")
    check_close(out, reference(region, inputs)[0])


@pytest.mark.parametrize("point", sorted(POINTS) + sorted(STREAM_POINTS))
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_swiglu_alone_in_both_weight_layouts(point, b_layout, load_candidate):
    region = fused_region((3,), 50, 301, "bfloat16", norm=False, glu=True, b_layout=b_layout)
    inputs = make_inputs(region, seed=2)
    params = {**POINTS, **STREAM_POINTS}[point]
    (out,) = run_candidate(load_candidate, region, params, inputs, stem=f"glu_{point}_{b_layout}")
    check_close(out, reference(region, inputs)[0])


@pytest.mark.parametrize("point", ["fma_split", "dot"])
def test_norm_with_bias_and_residual_epilogue(point, load_candidate):
    # the scale applies to the product, before the bias and the epilogue program
    region = fused_region((3,), 50, 301, has_bias=True, extras=[(3, 50)],
                          epilogue=[["t", "gelu_tanh", ["acc"]], ["y", "add", ["t", "in0"]]])
    inputs = make_inputs(region, 1e-3, seed=3)  # mean(x^2) ~ 1e-6: eps matters
    (out,) = run_candidate(load_candidate, region, POINTS[point], inputs)
    product, (residual,) = reference(region, inputs)
    check_close(out, torch.nn.functional.gelu(product, approximate="tanh") + residual)


@pytest.mark.parametrize("point", ["fma", "dot_split"])
def test_glu_with_an_epilogue_after_the_product(point, load_candidate):
    region = fused_region((3,), 50, 301, glu=True, extras=[(50,)],
                          epilogue=[*SWIGLU, ["y", "mul", ["t1", "in0"]]], outputs=["y"])
    inputs = make_inputs(region, seed=4)
    (out,) = run_candidate(load_candidate, region, POINTS[point], inputs)
    product, (scale,) = reference(region, inputs)
    check_close(out, product * scale)


@pytest.mark.parametrize("point", ["fma_split", "dot_split"])
def test_norm_without_weight(point, load_candidate):
    region = fused_region((3,), 50, 301, norm_weight=False)
    inputs = make_inputs(region, seed=5)
    (out,) = run_candidate(load_candidate, region, POINTS[point], inputs)
    check_close(out, reference(region, inputs)[0])


# NORM_FIRST: the RMSNorm in a kernel of its own (one program per row), then the plain GEMV
FIRST_POINTS = {
    "dot_first": {**gemv(16, 32, 128, stages=2), "NORM_FIRST": True},
    "fma_first_split": {**gemv(1, 16, 32, split=4), "NORM_FIRST": True},
    "fma_first_stream": {**gemv(1, 16, 32), "NORM_FIRST": True, "STREAM_K": 2},
}


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("point", sorted(FIRST_POINTS))
@pytest.mark.parametrize("glu", [False, True])
def test_norm_first_matches_torch(m, point, glu, load_candidate):
    if FIRST_POINTS[point]["BLOCK_M"] == 1 and m > 4:
        pytest.skip("BLOCK_M=1: at most 4 rows")
    region = fused_region((m,), 50, 301, "bfloat16", glu=glu)
    assert FAMILY.check(region, FIRST_POINTS[point], H200) is None
    inputs = make_inputs(region, 1e3, seed=6)
    (out,) = run_candidate(load_candidate, region, FIRST_POINTS[point], inputs, stem=f"first_{point}_{m}_{glu}")
    check_close(out, reference(region, inputs)[0])


@pytest.mark.parametrize("k", [301, 4500])
@pytest.mark.parametrize("norm_weight", [False, True])
def test_norm_first_fp32_rows_in_one_pass_and_in_blocks(k, norm_weight, load_candidate):
    # K = 301: the row kernel's one pass (x and g held in registers); K = 4500: it walks two
    # blocks of 4096 (masked tail) twice, in fp32 (no rounding)
    region = fused_region((3,), 20, k, "float32", norm_weight=norm_weight)
    point = FIRST_POINTS["dot_first"]
    assert FAMILY.check(region, point, H200) is None
    inputs = make_inputs(region, 1e-3, seed=7)  # mean(x^2) ~ 1e-6: eps matters
    (out,) = run_candidate(load_candidate, region, point, inputs, stem=f"first_fp32_{k}_{norm_weight}")
    check_close(out, reference(region, inputs)[0])


# SWAP_AB: the weight slab on the dot's left (64-row) side, the activation rows on its right
SWAP = {**gemv(16, 64, 128, stages=2), "SWAP_AB": True}


@pytest.mark.parametrize("m", [3, 16, 20])
@pytest.mark.parametrize("form", ["plain", "norm", "norm_first", "glu_norm", "glu_split"])
def test_swap_ab_matches_torch(m, form, load_candidate):
    # N = 150: a ragged last 64-row slab; K = 301: a masked K tail; 20 rows: two row tiles of 16
    norm, glu = form != "plain", form.startswith("glu")
    region = fused_region((m,), 150, 301, "bfloat16", norm=norm, glu=glu)
    point = {**SWAP, "NORM_FIRST": form == "norm_first", **({"SPLIT_K": 2, "BLOCK_K": 64} if form == "glu_split" else {})}
    assert FAMILY.check(region, point, H200) is None, FAMILY.check(region, point, H200)
    inputs = make_inputs(region, 30.0, seed=8)
    (out,) = run_candidate(load_candidate, region, point, inputs, stem=f"swap_{form}_{m}")
    check_close(out, reference(region, inputs)[0])


def test_swap_ab_fp32_and_legality(load_candidate):
    region = fused_region((5,), 100, 200, "float32", norm=False)
    inputs = make_inputs(region, seed=9)
    (out,) = run_candidate(load_candidate, region, SWAP, inputs)
    check_close(out, reference(region, inputs)[0])
    # a weight slab of 64+ rows on the left, activation tiles of 16+ rows on the right
    assert "SWAP_AB" in FAMILY.check(region, {**SWAP, "BLOCK_N": 32}, H200)
    assert "SWAP_AB" in FAMILY.check(fused_region((1,), 100, 200, "float32", norm=False),
                                     {**gemv(1, 64, 128), "SWAP_AB": True}, H200)


def test_stream_k_rejections():
    norm = fused_region((1,), 4096, 4096, "bfloat16")
    stream = {**gemv(1, 16, 512), "STREAM_K": 2}
    assert "RMSNorm outside the GEMV loop" in FAMILY.check(norm, stream, H200)
    assert FAMILY.check(norm, {**stream, "NORM_FIRST": True}, H200) is None
    assert "SPLIT_K=1" in FAMILY.check(norm, {**stream, "NORM_FIRST": True, "SPLIT_K": 2, "BLOCK_K": 256}, H200)
    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    plain = fused_region((16,), 4096, 4096, "bfloat16", norm=False)
    assert "form of the GEMV kernel" in FAMILY.check(plain, {**tile, "STREAM_K": 2}, H200)
    # 4 programs of a 4-stage 32x32x256 pipeline (~96 KB each) do not fit an SM's shared memory
    deep = {**gemv(32, 32, 256, stages=4), "STREAM_K": 4}
    assert "shared memory" in FAMILY.check(fused_region((32,), 4096, 4096, "bfloat16", norm=False), deep, H200)
    # in the space, offered only as twins of GEMV points without SPLIT_K and with the norm outside the loop
    points = FAMILY.legal_points(norm, H200)
    twins = [p for p in points if p.get("STREAM_K")]
    assert twins and all(p["NORM_FIRST"] and p["SPLIT_K"] == 1 for p in twins)


def test_norm_first_is_only_for_gemv_norm_regions():
    first = {**gemv(16, 32, 128), "NORM_FIRST": True}
    plain = fused_region((16,), 4096, 4096, "bfloat16", norm=False, glu=True)
    assert "NORM_FIRST" not in FAMILY.param_space(plain, H200)
    assert "norm prologue" in FAMILY.check(plain, first, H200)
    norm = fused_region((16,), 4096, 4096, "bfloat16")
    assert FAMILY.param_space(norm, H200)["NORM_FIRST"] == [False, True]
    assert FAMILY.check(norm, first, H200) is None
    # its GEMV kernel is the plain one: no norm weight slice in the pipeline's shared memory
    deep = {**gemv(16, 32, 256, stages=4)}
    assert FAMILY._gemv_smem(norm, {**deep, "NORM_FIRST": True}) == FAMILY._gemv_smem(
        fused_region((16,), 4096, 4096, "bfloat16", norm=False), deep)
    assert FAMILY._gemv_smem(norm, deep) > FAMILY._gemv_smem(norm, {**deep, "NORM_FIRST": True})


def test_split_workspace_holds_squares_and_both_halves(load_candidate):
    # Symbolic rows: calls of one module with other M share (and grow) the cached workspace; the
    # counters are back at zero after every launch.
    region = fused_region(("S",), 50, 301, "bfloat16", glu=True, dims={"S": (1, 4)})
    module = load_candidate(FAMILY.render(region, POINTS["fma_split"]), "norm_glu_twice")
    for rows, seed in ((2, 0), (4, 1), (1, 2)):
        inputs = make_inputs(region, 30.0, {"S": rows}, seed=seed)
        (out,) = module.run(*inputs)
        check_close(out, reference(region, inputs)[0])
        partials, arrivals = module._WORKSPACES[inputs[0].device]
        assert partials.numel() >= 4 * rows * (2 * 50) + 4 * rows and not arrivals.any()


# -- legality and ranking -----------------------------------------------------------------

def test_only_gemv_points_are_legal():
    for region in (fused_region((1,), 4096, 4096, "bfloat16"),
                   fused_region((1,), 4096, 4096, "bfloat16", norm=False, glu=True)):
        points = FAMILY.legal_points(region, H200)
        assert points and all(p["GEMV"] for p in points)
        tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
        assert "GEMV kernel only" in FAMILY.check(region, tile, H200)
        with pytest.raises(ValueError, match="GEMV kernel only"):
            FAMILY.render(region, tile)
    # prefill-sized rows: no GEMV, so nothing but the reference
    assert FAMILY.legal_points(fused_region((4096,), 4096, 4096, "bfloat16"), H200) == []


def test_glu_slabs_count_twice():
    plain = fused_region((1,), 4096, 4096, "bfloat16", norm=False)
    glu = fused_region((1,), 4096, 4096, "bfloat16", norm=False, glu=True)
    assert FAMILY._mnk(glu) == FAMILY._mnk(plain)  # N is the output's width
    wide = gemv(1, 32, 512)  # 128 weights a thread: one slab fits, two spill
    assert FAMILY.check(plain, wide, H200) is None
    assert "spills" in FAMILY.check(glu, wide, H200)
    deep = gemv(1, 64, 512, stages=4, warps=8)
    assert FAMILY._gemv_smem(glu, deep) > FAMILY._gemv_smem(plain, deep)
    norm = fused_region((1,), 4096, 4096, "bfloat16")
    assert FAMILY._gemv_smem(norm, deep) == FAMILY._gemv_smem(plain, deep) + 3 * 512 * 2  # a g slice a stage


def test_fused_dot_tiles_that_spill_are_rejected():
    # measured on sm_90: 32x64x256 with norm + GLU spills at 2 stages, 32x32x512 uses 240 registers
    region = fused_region((32,), 4096, 4096, "bfloat16", glu=True)
    assert "spill" in FAMILY.check(region, gemv(32, 64, 256, stages=2), H200)
    assert "spill" in FAMILY.check(region, gemv(32, 32, 512, stages=2), H200)
    assert FAMILY.check(region, gemv(32, 32, 256, stages=2), H200) is None
    # the same tiles without the fused forms keep their old legality
    plain = fused_region((32,), 4096, 4096, "bfloat16", norm=False)
    assert FAMILY.check(plain, gemv(32, 64, 256, stages=2), H200) is None


def test_matches_rejects_malformed_regions():
    assert FAMILY.matches(fused_region((1,), 50, 64, glu=True))
    with_bias = fused_region((1,), 50, 64, glu=True, has_bias=True)
    assert not FAMILY.matches(with_bias)  # the merged gate|up has no bias
    odd = fused_region((1,), 50, 64, glu=True)
    odd = RegionSummary(**{**odd.__dict__, "inputs": (odd.inputs[0], TensorSpec((99, 64), "float32"), *odd.inputs[2:])})
    assert not FAMILY.matches(odd)  # b must hold exactly two output widths
    unknown = fused_region((1,), 50, 64)
    unknown = RegionSummary(**{**unknown.__dict__, "attrs": {**unknown.attrs, "prologue": {"kind": "layer_norm"}}})
    assert not FAMILY.matches(unknown)


def test_heuristic_ranks_gemv_tiles_for_fused_decode_regions():
    from coopt.llm_advisor import AdviceRequest, HeuristicAdvisor

    def ranked(region):
        legal = tuple(FAMILY.legal_points(region, H200))
        request = AdviceRequest(region, FAMILY.name, FAMILY.param_space(region, H200), legal, H200.facts())
        return HeuristicAdvisor().advise(request).ranked

    qkv = ranked(fused_region((1,), 6144, 4096, "bfloat16"))[0]
    assert (qkv["BLOCK_M"], qkv["SPLIT_K"]) == (1, 1) and qkv["BLOCK_N"] in (16, 32) and qkv["BLOCK_K"] in (256, 512)
    gate_up = ranked(fused_region((1,), 14336, 4096, "bfloat16", glu=True))
    first = gate_up[0]
    # 14336 output columns, two slabs a program: BLOCK_N 16-32 fill the SMs without splitting K
    assert (first["BLOCK_M"], first["SPLIT_K"], first["num_warps"]) == (1, 1, 4)
    assert first["BLOCK_N"] in (16, 32) and first["BLOCK_K"] in (256, 512)
    rows32 = ranked(fused_region((32,), 14336, 4096, "bfloat16", glu=True))[0]
    assert rows32["BLOCK_M"] == 32 and rows32["GEMV"]
    # the norm: in the loop for one row (the separate kernel measured next), ahead of the GEMV
    # for tl.dot tiles; there the in-loop form comes right behind on swapped tiles (measured
    # even), after every separate one otherwise
    assert not qkv["NORM_FIRST"] and not first["NORM_FIRST"]
    one_row = ranked(fused_region((1,), 6144, 4096, "bfloat16"))
    assert one_row[1] == {**one_row[0], "NORM_FIRST": True}
    rows32 = ranked(fused_region((32,), 6144, 4096, "bfloat16"))
    assert rows32[0]["NORM_FIRST"] and rows32[0]["BLOCK_M"] == 32
    # 32 rows: the weight on the wgmma's 64-row side first (measured fastest on every layer GEMV)
    assert rows32[0]["SWAP_AB"]
    counted = [p for p in rows32 if p["MEET"] == "count"]  # (a split point's flag-meeting twin is next)
    assert counted[1] == {**rows32[0], "NORM_FIRST": False}
    inline = [i for i, point in enumerate(rows32) if not point["NORM_FIRST"] and not point["SWAP_AB"]]
    assert inline and min(inline) > 3


def test_golden_rendering_norm_glu(golden):
    # a decode step's gate|up: RMSNorm prologue, SwiGLU, split K (squares and both halves meet)
    region = fused_region(("B", 1), 512, 256, "bfloat16", glu=True, dims={"B": (1, 4)})
    fma_split, dot = gemv(1, 16, 64, split=2), gemv(16, 32, 256, stages=4)
    assert FAMILY.check(region, fma_split, H200) is None and FAMILY.check(region, dot, H200) is None
    golden("matmul_epilogue_gemv_norm_glu_split.py", FAMILY.render(region, fma_split))
    golden("matmul_epilogue_gemv_norm_glu_dot.py", FAMILY.render(region, dot))
    dot_first = {**dot, "NORM_FIRST": True}
    assert FAMILY.check(region, dot_first, H200) is None
    golden("matmul_epilogue_gemv_norm_first_glu_dot.py", FAMILY.render(region, dot_first))
    swap = {**gemv(16, 64, 128, stages=2), "NORM_FIRST": True, "SWAP_AB": True}
    assert FAMILY.check(region, swap, H200) is None
    golden("matmul_epilogue_gemv_swap_glu_dot.py", FAMILY.render(region, swap))


def test_heuristic_ranks_the_same_tiles_first_for_the_statistics_forms():
    from coopt.llm_advisor import AdviceRequest, HeuristicAdvisor

    def first(region):
        legal = tuple(FAMILY.legal_points(region, H200))
        request = AdviceRequest(region, FAMILY.name, FAMILY.param_space(region, H200), legal, H200.facts())
        return HeuristicAdvisor().advise(request).ranked[0]

    # b32 Llama-3-8B: the o + residual GEMV's first pick is already 64 wide, so the row
    # statistics' BLOCK_N constraint leaves it as it was; q|k|v's is the NORM_FIRST one's tiles
    plain_o = fused_region((32,), 4096, 4096, "bfloat16", norm=False, extras=[(32, 4096)], epilogue=RESIDUAL, outputs=["y"])
    assert first(producer_region(32, 4096, 4096)) == first(plain_o)
    stats_qkv, norm_qkv = first(consumer_region(32, 6144, 4096)), first(fused_region((32,), 6144, 4096, "bfloat16"))
    assert norm_qkv["NORM_FIRST"] and stats_qkv == {k: v for k, v in norm_qkv.items() if k != "NORM_FIRST"}


def test_golden_rendering_norm_statistics(golden):
    # a b32 step's o + residual storing the row statistics (split K: the last arriver stores
    # them), and the gate|up reading them (SwiGLU, swapped tl.dot tiles)
    producer, consumer = producer_region(32, 512, 256), consumer_region(32, 256, 512, glu=True)
    split, swap = gemv(16, 64, 64, split=2, stages=2), {**gemv(32, 64, 128, stages=2), "SWAP_AB": True}
    assert FAMILY.check(producer, split, H200) is None and FAMILY.check(consumer, swap, H200) is None
    golden("matmul_epilogue_gemv_row_squares_split.py", FAMILY.render(producer, split))
    golden("matmul_epilogue_gemv_norm_stats_glu_swap.py", FAMILY.render(consumer, swap))


# -- Hopper compilation (no GPU needed) -------------------------------------------------------

# The heuristic's first picks for a Llama-3-8B decode step's q|k|v (norm) and gate|up (norm + GLU),
# split-K forms (squares beside the partials) and 32 rows on tl.dot.
HOPPER_CASES = {
    "qkv_norm": (fused_region((1,), 512, 4096, "bfloat16"), [gemv(1, 32, 256, stages=4), gemv(1, 16, 512, split=4)]),
    "gate_up": (fused_region((1,), 512, 4096, "bfloat16", glu=True),
                [gemv(1, 16, 256, stages=2), gemv(1, 16, 512, stages=3), gemv(1, 32, 256, split=2, stages=3)]),
    "gate_up_rows32": (fused_region((32,), 512, 4096, "bfloat16", glu=True),
                       [gemv(32, 32, 256, stages=2), gemv(32, 64, 128, stages=3), gemv(16, 32, 512, split=2, stages=3)]),
    "glu_only_fp32": (fused_region((1,), 512, 4096, "float32", norm=False, glu=True), [gemv(1, 16, 128, split=4)]),
    "norm_rows16_fp32": (fused_region((16,), 512, 4096, "float32"), [gemv(16, 32, 64, stages=3)]),
    "norm_first_rows32": (fused_region((32,), 512, 4096, "bfloat16", glu=True),
                          [{**gemv(32, 64, 256, stages=3), "NORM_FIRST": True}]),
    "swap_rows32": (fused_region((32,), 512, 4096, "bfloat16", glu=True),
                    [{**gemv(32, 64, 256, stages=2), "NORM_FIRST": True, "SWAP_AB": True},
                     {**gemv(16, 128, 128, stages=3), "NORM_FIRST": True, "SWAP_AB": True}]),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_fused_gemv_points_compile_for_hopper(tmp_path):
    assert_gemv_points_compile(FAMILY, HOPPER_CASES, make_inputs, tmp_path, H200)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_norm_statistics_points_compile_for_hopper(tmp_path):
    # a b32 Llama-3-8B step's o + residual (row statistics) and gate|up (statistics prologue,
    # SwiGLU): the advisor's kinds of points, swapped tl.dot tiles and split K among them
    cases = {
        "row_squares_rows32": (producer_region(32, 512, 4096), [
            {**gemv(32, 64, 256, split=2, stages=3), "SWAP_AB": True}, gemv(16, 128, 128, split=2, stages=3)]),
        "row_squares_rows1": (producer_region(1, 512, 4096), [gemv(1, 64, 128, stages=3)]),
        "stats_qkv_rows32": (consumer_region(32, 512, 4096), [{**gemv(32, 64, 256, stages=4), "SWAP_AB": True}]),
        "stats_gate_up_rows32": (consumer_region(32, 512, 4096, glu=True), [
            {**gemv(32, 64, 256, stages=2), "SWAP_AB": True}, gemv(16, 32, 512, split=2, stages=3)]),
        # stream-K twins (session 21: the statistics' chunk loop and the tile's program range
        # once shared a name, which the interpreter ran and Triton's compiler refused)
        "row_squares_rows1_stream": (producer_region(1, 512, 4096), [{**gemv(1, 64, 128, stages=3), "STREAM_K": 2}]),
        "stats_qkv_rows1_stream": (consumer_region(1, 512, 4096), [{**gemv(1, 32, 256, stages=4), "STREAM_K": 2}]),
        "stats_gate_up_rows32_stream": (consumer_region(32, 512, 4096, glu=True),
                                        [{**gemv(16, 64, 256, stages=2), "STREAM_K": 1}]),
    }
    assert_gemv_points_compile(FAMILY, cases, make_inputs, tmp_path, H200)


# -- norm statistics (fuse-norm-statistics): the producer writes h * g and chunk sums of h^2, ----
# -- the consumer's norm scales by rsqrt(their total / K + eps) -----------------------------------

CHUNK = 64
RESIDUAL = [["y", "add", ["acc", "in0"]]]
# BLOCK_N a multiple of the chunk; K = 301 leaves masked K tails; N = 192 = 3 chunks, so a
# 128-wide tile's second chunk lies past N
STATS_POINTS = {
    "fma": gemv(1, 64, 128, stages=4),
    "fma_split": gemv(1, 64, 32, split=4),
    "dot": gemv(16, 64, 128, stages=2),
    "dot_split": gemv(16, 128, 32, split=4),
    "dot32_split": gemv(32, 64, 64, split=2, stages=2),
    "swap": {**gemv(16, 64, 128, stages=2), "SWAP_AB": True},
    "fma_stream": {**gemv(1, 64, 32), "STREAM_K": 2},
    "dot_stream": {**gemv(16, 64, 32, stages=2), "STREAM_K": 4},
}


def producer_region(m, n, k, dtype="bfloat16") -> RegionSummary:
    """h = a @ b^T + residual, plus h * g and sq [n / 64, m] (inputs a, b, residual, g)."""
    inputs = (TensorSpec((m, k), dtype), TensorSpec((n, k), dtype), TensorSpec((m, n), dtype), TensorSpec((n,), dtype))
    outputs = (TensorSpec((m, n), dtype), TensorSpec((m, n), dtype), TensorSpec((n // CHUNK, m), "float32"))
    attrs = {"b_layout": "nk", "has_bias": False, "epilogue": RESIDUAL, "outputs": ["y"],
             "row_squares": {"chunk": CHUNK, "weight_input": 3, "output": 0}}
    return RegionSummary("producer", "matmul_epilogue", inputs, outputs, attrs)


def consumer_region(m, n, k, dtype="bfloat16", *, glu=False) -> RegionSummary:
    """(hg @ b^T) * rsqrt(sum_c sq[c] / k + eps) [then SwiGLU] (inputs hg, b, sq)."""
    region = fused_region((m,), n, k, dtype, norm=False, glu=glu)
    inputs = (*region.inputs[:2], TensorSpec((k // CHUNK, m), "float32"))
    attrs = {**region.attrs, "prologue": {"kind": "rms_norm_stats", "eps": EPS, "squares_input": 2}}
    return RegionSummary("consumer", "matmul_epilogue", inputs, region.outputs, attrs)


def chunk_squares(h: torch.Tensor) -> torch.Tensor:
    """[K / 64, M] float64 sums of h^2 (h as it is, i.e. rounded to its dtype) over 64-column chunks."""
    rows = h.double().reshape(-1, h.shape[-1])
    return rows.pow(2).reshape(rows.shape[0], -1, CHUNK).sum(-1).T


def row_cases(points: dict) -> list[tuple[int, str]]:
    """(rows, point name) for 1, 3, 17 and 32 rows, where the point's BLOCK_M suits them."""
    cases = []
    for m in (1, 3, 17, 32):
        for point in sorted(points):
            bm = points[point]["BLOCK_M"]
            if (bm > 1 or m <= 4) and (bm <= 16 or m > 16):  # BLOCK_M=1: at most 4 rows; 32: no more than M
                cases.append((m, point))
    return cases


@pytest.mark.parametrize("m,point", row_cases(STATS_POINTS))
def test_row_squares_outputs_match_torch_on_the_rounded_h(m, point, load_candidate):
    region = producer_region(m, 192, 301)
    inputs = make_inputs(region, 30.0, seed=10)
    a, b, residual, g = inputs
    h, hg, sq = run_candidate(load_candidate, region, STATS_POINTS[point], inputs, stem=f"rowsq_{point}_{m}")
    check_close(h, a.double() @ b.double().T + residual.double())
    # hg and sq come from h as stored: h * g rounded once (an ulp apart at most, the
    # interpreter truncating), the chunk sums in fp32
    torch.testing.assert_close(hg.float(), (h.float() * g.float()).to(hg.dtype).float(), rtol=8e-3, atol=0)
    assert sq.shape == (3, m) and sq.dtype == torch.float32
    torch.testing.assert_close(sq.double(), chunk_squares(h).to(sq.device), rtol=1e-5, atol=0)


@pytest.mark.parametrize("m,point", row_cases(STATS_POINTS))
@pytest.mark.parametrize("glu", [False, True])
def test_rms_norm_stats_prologue_matches_torch(m, point, glu, load_candidate):
    region = consumer_region(m, 96, 320, glu=glu)
    gen = torch.Generator().manual_seed(11)
    h = (torch.randn((m, 320), generator=gen) * 1e3).to(torch.bfloat16)
    g = torch.randn((320,), generator=gen).to(torch.bfloat16)
    b = torch.randn(tuple(region.inputs[1].shape), generator=gen).to(torch.bfloat16)
    hg = (h.float() * g.float()).to(torch.bfloat16)
    sq = chunk_squares(h).float()
    (out,) = run_candidate(load_candidate, region, STATS_POINTS[point], [hg, b, sq], stem=f"stats_{point}_{m}_{glu}")
    product = hg.double() @ b.double().T * torch.rsqrt(sq.double().sum(0) / 320 + EPS)[:, None]
    if glu:
        product = torch.nn.functional.silu(product[:, :96]) * product[:, 96:]
    check_close(out, product)
    # what it stands for: the RMSNorm of h (times g) before the GEMV, up to hg's rounding
    normed = fused_region((m,), 96, 320, "bfloat16", glu=glu)
    check_close(out, reference(normed, [h, b, g])[0])


@pytest.mark.parametrize("point", ["fma", "dot"])
def test_more_chunks_than_one_load_holds(point, load_candidate):
    # 67 chunks (K 4288): a sweep of two loads of 64, the second 3 chunks and 61 masked
    m, k = (3, 4288) if point == "fma" else (17, 4288)
    region = consumer_region(m, 64, k)
    gen = torch.Generator().manual_seed(14)
    hg = torch.randn((m, k), generator=gen).to(torch.bfloat16)
    b = torch.randn((64, k), generator=gen).to(torch.bfloat16)
    sq = torch.rand((k // CHUNK, m), generator=gen) * 64
    sq[64:] *= 1000  # most of each row's mass in the second load: a sweep that stopped at 64 is far off
    (out,) = run_candidate(load_candidate, region, STATS_POINTS[point], [hg, b, sq], stem=f"stats_long_{point}")
    check_close(out, hg.double() @ b.double().T * torch.rsqrt(sq.double().sum(0) / k + EPS)[:, None])


def test_producer_feeds_consumer_like_the_norm_it_replaces(load_candidate):
    producer, consumer = producer_region(5, 128, 301), consumer_region(5, 64, 128, glu=True)
    p_inputs = make_inputs(producer, 1.0, seed=12)
    h, hg, sq = run_candidate(load_candidate, producer, STATS_POINTS["dot_split"], p_inputs, stem="chain_p")
    w = make_inputs(consumer, seed=13)[1]
    (out,) = run_candidate(load_candidate, consumer, STATS_POINTS["dot"], [hg, w, sq], stem="chain_c")
    check_close(out, reference(fused_region((5,), 64, 128, "bfloat16", glu=True), [h, w, p_inputs[3]])[0])


def test_norm_statistics_forms_are_gemv_only_with_whole_chunks():
    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    for region in (producer_region(32, 4096, 4096), consumer_region(32, 4096, 4096)):
        assert FAMILY.matches(region)
        assert "GEMV kernel only" in FAMILY.check(region, tile, H200)
        with pytest.raises(ValueError, match="GEMV kernel only"):
            FAMILY.render(region, tile)
        points = FAMILY.legal_points(region, H200)
        assert points and all(p["GEMV"] and not p.get("NORM_FIRST") for p in points)
    producer = producer_region(32, 4096, 4096)
    assert "multiple of it" in FAMILY.check(producer, gemv(16, 32, 128), H200)
    assert "multiple of it" in FAMILY.check(producer, gemv(1, 16, 256), H200)
    assert FAMILY.check(producer, gemv(16, 64, 128), H200) is None
    assert all(p["BLOCK_N"] % CHUNK == 0 for p in FAMILY.legal_points(producer, H200))
    consumer = consumer_region(32, 4096, 4096)
    assert "NORM_FIRST" not in FAMILY.param_space(consumer, H200)
    assert "NORM_FIRST" in FAMILY.check(consumer, {**gemv(16, 32, 128), "NORM_FIRST": True}, H200)
    # malformed: N not a multiple of the chunk, or the weight not the last input
    assert not FAMILY.matches(producer_region(32, 100, 64))
    moved = RegionSummary(**{**producer.__dict__, "attrs": {**producer.attrs, "row_squares": {"chunk": 64, "weight_input": 2}}})
    assert not FAMILY.matches(moved)
