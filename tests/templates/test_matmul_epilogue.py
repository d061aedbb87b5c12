"""matmul_epilogue family: every knob value runs, edges are correct, the space is bounded.

Kernels run in Triton's interpreter without a GPU (on the GPU machine, for real): shapes stay
small. References are computed in fp32 from the same (possibly bf16) inputs.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from template_helpers import assert_gemv_points_compile, compile_for_hopper, covering_points
from template_helpers import run_candidate as _run_candidate

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILY = MatmulEpilogueFamily()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}

run_candidate = partial(_run_candidate, FAMILY, H200)

GELU_RESIDUAL = [["t", "gelu_tanh", ["acc"]], ["y", "add", ["t", "in0"]]]


def make_region(lead, n, k, dtype="float32", b_layout="nk", has_bias=False, extras=(), epilogue=(),
                outputs=("acc",), out_dtypes=None, dims=None) -> RegionSummary:
    """A matmul_epilogue region for a [*lead, k] @ weight -> [*lead, n]; extras are shapes."""
    b_shape = (n, k) if b_layout == "nk" else (k, n)
    inputs = [TensorSpec((*lead, k), dtype), TensorSpec(b_shape, dtype)]
    if has_bias:
        inputs.append(TensorSpec((n,), dtype))
    inputs += [TensorSpec(tuple(shape), dtype) for shape in extras]
    out_dtypes = out_dtypes or [dtype] * len(outputs)
    return RegionSummary(
        name="linear", family="matmul_epilogue", inputs=tuple(inputs),
        outputs=tuple(TensorSpec((*lead, n), d) for d in out_dtypes),
        attrs={"b_layout": b_layout, "has_bias": has_bias, "epilogue": [list(i) for i in epilogue],
               "outputs": list(outputs)},
        dims=dims or {},
    )


def make_inputs(region: RegionSummary, concrete: dict | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for spec in region.inputs:
        shape = spec.concrete(concrete or {})
        tensors.append(torch.randn(shape, generator=gen).to(DTYPES[spec.dtype]).to(DEVICE))
    return tensors


def reference(region: RegionSummary, inputs) -> torch.Tensor:
    """fp32 matmul (+ bias): the epilogue is applied by each test."""
    a, b = inputs[0].float(), inputs[1].float()
    acc = a @ (b.T if region.attrs["b_layout"] == "nk" else b)
    if region.attrs["has_bias"]:
        acc = acc + inputs[2].float()
    return acc


def check_close(actual: torch.Tensor, expected: torch.Tensor):
    assert actual.shape == expected.shape and actual.device.type == DEVICE
    scale = expected.abs().max().item() + 1e-6
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * scale)
    else:  # bf16 output: rounding (truncation in the interpreter) of the result
        torch.testing.assert_close(actual.float(), expected, rtol=1.6e-2, atol=1e-2 * scale)


# -- every knob value -------------------------------------------------------------------

# Big enough that every tile size is legal (M <= 128, N <= 256), K long enough for SPLIT_K=8
# with BLOCK_K=32 (>= 2 steps per split), few enough tiles that SPLIT_K is legal at all.
COVERAGE_REGION = {
    "float32": make_region((4, 25), 200, 520, "float32", has_bias=True),
    "bfloat16": make_region((100,), 200, 520, "bfloat16", b_layout="kn", extras=[(100, 200)],
                            epilogue=[["y", "add", ["acc", "in0"]]], outputs=["y"]),
}


def test_space_values_are_all_legal_somewhere():
    for dtype, region in COVERAGE_REGION.items():
        space = FAMILY.param_space(region, H200)
        points = FAMILY.legal_points(region, H200)
        used = {(k, v) for p in points for k, v in p.items()}
        unused = {(k, v) for k, values in space.items() for v in values} - used
        # tensor descriptors are for 16-bit operands only
        assert unused == ({("USE_TMA", True)} if dtype == "float32" else set())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_covering_points_match_torch(dtype, load_candidate):
    region = COVERAGE_REGION[dtype]
    inputs = make_inputs(region)
    expected = reference(region, inputs)
    if dtype == "bfloat16":
        expected = expected + inputs[2].float()
    for i, params in enumerate(covering_points(FAMILY.legal_points(region, H200))):
        (out,) = run_candidate(load_candidate, region, params, inputs, stem=f"cover_{dtype}_{i}")
        check_close(out, expected)


# -- shapes and layouts -----------------------------------------------------------------

@pytest.mark.parametrize("m,n,k", [(1, 7, 33), (7, 33, 100), (33, 100, 7), (100, 1, 1)])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_odd_shapes(m, n, k, b_layout, dtype, load_candidate):
    region = make_region((m,), n, k, dtype, b_layout=b_layout, has_bias=True)
    inputs = make_inputs(region)
    (out,) = run_candidate(load_candidate, region, SMALL, inputs)
    check_close(out, reference(region, inputs))


def test_split_k_with_ragged_k(load_candidate):
    # 300 = 9 full BLOCK_K=32 steps + a partial one, split 4 ways (the last split is shorter)
    region = make_region((5,), 40, 300, has_bias=True, extras=[(5, 40)], epilogue=GELU_RESIDUAL, outputs=["y"])
    inputs = make_inputs(region)
    params = {**SMALL, "SPLIT_K": 4}
    (out,) = run_candidate(load_candidate, region, params, inputs)
    expected = torch.nn.functional.gelu(reference(region, inputs), approximate="tanh") + inputs[3]
    check_close(out, expected)


def test_strided_operands_are_read_in_place(load_candidate):
    region = make_region((33,), 40, 48, b_layout="kn")
    a = torch.randn(48, 33, device=DEVICE).T  # column-major a
    b = torch.randn(60, 48, device=DEVICE)[:40].T  # [K, N] view of a row-major [N, K] slice
    (out,) = run_candidate(load_candidate, region, SMALL, [a, b])
    check_close(out, a @ b)


# -- epilogues --------------------------------------------------------------------------

def test_bias_relu(load_candidate):
    region = make_region((33,), 100, 64, has_bias=True, epilogue=[["y", "relu", ["acc"]]], outputs=["y"])
    inputs = make_inputs(region)
    (out,) = run_candidate(load_candidate, region, SMALL, inputs)
    check_close(out, torch.relu(reference(region, inputs)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_3d_input_gelu_tanh_residual(dtype, load_candidate):
    region = make_region(("B", 7), 33, 40, dtype, has_bias=True, extras=[("B", 7, 33)],
                         epilogue=GELU_RESIDUAL, outputs=["y"], dims={"B": (1, 4)})
    inputs = make_inputs(region, {"B": 3})
    (out,) = run_candidate(load_candidate, region, SMALL, inputs)
    expected = torch.nn.functional.gelu(reference(region, inputs), approximate="tanh") + inputs[3].float()
    check_close(out, expected)


def test_broadcast_extras_and_two_outputs(load_candidate):
    # a row vector [N] and a per-row column [B, S, 1]; outputs in two dtypes
    region = make_region((2, 9), 50, 24, extras=[(50,), (2, 9, 1)],
                         epilogue=[["s", "mul", ["acc", "in0"]], ["y", "sub", ["s", "in1"]]],
                         outputs=["acc", "y"], out_dtypes=["bfloat16", "float32"])
    inputs = make_inputs(region)
    acc, y = run_candidate(load_candidate, region, SMALL, inputs)
    expected = reference(region, inputs)
    check_close(acc, expected)
    check_close(y, expected * inputs[2] - inputs[3])


def test_empty_rows(load_candidate):
    region = make_region((0,), 8, 16)
    (out,) = run_candidate(load_candidate, region, SMALL, make_inputs(region))
    assert out.shape == (0, 8)


# -- Hopper variants: persistent grid, tensor descriptors (TMA), warp specialization ------
#
# Under the interpreter the persistent grid has 3 programs (each walks several tiles) and tensor
# descriptors are emulated: these tests check the numerics of every variant's loads, edges,
# epilogue split and stores; the copy engine, wgmma and pipelining themselves are checked by
# compiling for sm_90 below.

TILE64 = {**SMALL, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_stages": 3}
VARIANTS = {
    "persistent": {**TILE64, "PERSISTENT": True},
    "persistent_subtile": {**TILE64, "BLOCK_N": 128, "PERSISTENT": True, "EPILOGUE_SUBTILE": 2},
    "tma": {**TILE64, "USE_TMA": True},
    "tma_persistent": {**TILE64, "PERSISTENT": True, "USE_TMA": True},
    "tma_subtile": {**TILE64, "BLOCK_N": 128, "USE_TMA": True, "EPILOGUE_SUBTILE": 2},
    "tma_persistent_subtile": {**TILE64, "BLOCK_N": 128, "PERSISTENT": True, "USE_TMA": True, "EPILOGUE_SUBTILE": 2},
}


def ragged_two_output_region(b_layout: str) -> RegionSummary:
    # M, N, K off every tile size (K=120: a partial last K step); rows stay 16-byte aligned for
    # TMA (N and K multiples of 8); bias, a broadcast row, GELU and two outputs in two dtypes.
    return make_region((3, 50), 200, 120, "bfloat16", b_layout=b_layout, has_bias=True, extras=[(200,)],
                       epilogue=[["t", "gelu_tanh", ["acc"]], ["y", "mul", ["t", "in0"]]],
                       outputs=["acc", "y"], out_dtypes=["bfloat16", "float32"])


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_on_ragged_shapes(variant, b_layout, load_candidate):
    region = ragged_two_output_region(b_layout)
    inputs = make_inputs(region)
    module = load_candidate(FAMILY.render(region, VARIANTS[variant]), f"{variant}_{b_layout}")
    assert FAMILY.check(region, VARIANTS[variant], H200) is None
    if VARIANTS[variant].get("USE_TMA"):  # the descriptor path is the one that runs
        assert module._tma_ready(inputs[0].reshape(150, 120), inputs[1], torch.empty(150, 200, device=DEVICE))
    acc, y = module.run(*inputs)
    expected = reference(region, inputs)
    check_close(acc, expected)
    check_close(y, torch.nn.functional.gelu(expected, approximate="tanh") * inputs[3].float())


def test_tma_falls_back_to_pointers_on_unaligned_operands(load_candidate):
    region = make_region((72,), 64, 96, "bfloat16", has_bias=True)
    params = VARIANTS["tma_persistent"]
    module = load_candidate(FAMILY.render(region, params), "tma_fallback")
    a = torch.randn(96, 72, device=DEVICE).to(torch.bfloat16).T  # column-major: inner stride 72
    b = torch.randn(64, 97, device=DEVICE).to(torch.bfloat16)[:, :96]  # rows 194 B apart
    bias = torch.randn(64, device=DEVICE).to(torch.bfloat16)
    assert not module._tma_ready(a, b) and not module._tma_ready(a.contiguous(), b)
    (out,) = module.run(a, b, bias)
    check_close(out, reference(region, [a, b, bias]))


def test_variant_rejections():
    bf16 = make_region((4096,), 4096, 4096, "bfloat16")
    big = {**SMALL, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    tma = {**big, "PERSISTENT": True, "USE_TMA": True}
    assert FAMILY.check(bf16, tma, H200) is None
    assert FAMILY.check(bf16, {**tma, "EPILOGUE_SUBTILE": 2, "num_stages": 4}, H200) is None
    # the TMA store buffer (64 KiB for a 128x256 bf16 tile) counts against shared memory
    assert "shared memory" in FAMILY.check(bf16, {**tma, "num_stages": 4}, H200)
    assert "16-bit" in FAMILY.check(make_region((4096,), 4096, 4096), {**tma, "num_warps": 8}, H200)
    assert "16-byte" in FAMILY.check(make_region((4096,), 4096, 4100, "bfloat16"), tma, H200)
    assert "16-byte" in FAMILY.check(make_region((4096,), 4100, 4096, "bfloat16"), tma, H200)  # outputs
    assert FAMILY.check(make_region(("S",), 4096, 4096, "bfloat16"), tma, H200) is None  # run() checks S
    assert "SPLIT_K" in FAMILY.check(bf16, {**tma, "SPLIT_K": 2}, H200)
    assert "tensor-core tiles" in FAMILY.check(bf16, {**SMALL, "PERSISTENT": True}, H200)
    assert "applies to" in FAMILY.check(bf16, {**big, "EPILOGUE_SUBTILE": 2}, H200)
    assert "BLOCK_N >= 128" in FAMILY.check(bf16, {**tma, "BLOCK_N": 64, "num_warps": 4, "EPILOGUE_SUBTILE": 2}, H200)


# -- GEMV: the skinny-GEMM kernel for decode-sized M ------------------------------------
#
# Under the interpreter programs run one after another, so the last split of a tile is always
# the one with the highest index; what the arrival counters do under real concurrency (stores
# before a release, acquire, L2 reads) is checked by compiling for sm_90 below and by
# bench/gemm.py on the GPU.

def gemv(bm, bn, bk, split=1, stages=3, warps=4):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "SPLIT_K": split,
            "num_warps": warps, "num_stages": stages, "GEMV": True}


# K = 300: 9 full BLOCK_K=32 steps and a partial one, split 4 ways (the last split shorter);
# BLOCK_K=128 leaves a masked tail without splits. N = 50 is not a multiple of BLOCK_N.
GEMV_POINTS = {
    "fma_split": gemv(1, 16, 32, split=4),
    "fma": gemv(1, 32, 128, stages=4),
    "dot_split": gemv(16, 16, 32, split=4),
    "dot": gemv(16, 64, 128, stages=2),
    # stream-K: 14 programs under the interpreter over 4-16 tiles of 10 K steps; their ranges
    # (2-11 steps) end inside tiles, which 2-6 programs then share
    "fma_stream": {**gemv(1, 16, 32), "STREAM_K": 2},
    "dot_stream": {**gemv(16, 16, 32), "STREAM_K": 2},
}


@pytest.mark.parametrize("m,point", [(m, point) for m in (1, 3, 16) for point in sorted(GEMV_POINTS)
                                     if GEMV_POINTS[point]["BLOCK_M"] > 1 or m <= 4])  # BLOCK_M=1: <= 4 rows
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemv_matches_torch(m, point, dtype, load_candidate):
    params = GEMV_POINTS[point]
    plain = make_region((m,), 50, 300, dtype)
    (out,) = run_candidate(load_candidate, plain, params, make_inputs(plain), stem=f"gemv_{point}_{m}")
    check_close(out, reference(plain, make_inputs(plain)))
    # bias, GELU and a residual: the same epilogue as every other kernel of the family
    region = make_region((m,), 50, 300, dtype, has_bias=True, extras=[(m, 50)], epilogue=GELU_RESIDUAL, outputs=["y"])
    inputs = make_inputs(region, seed=1)
    (out,) = run_candidate(load_candidate, region, params, inputs, stem=f"gemv_{point}_{m}_epilogue")
    check_close(out, torch.nn.functional.gelu(reference(region, inputs), approximate="tanh") + inputs[3].float())


@pytest.mark.parametrize("point", ["fma_split", "dot_split"])
def test_gemv_weight_in_kn_layout(point, load_candidate):
    region = make_region((3,), 50, 300, "bfloat16", b_layout="kn", has_bias=True)
    inputs = make_inputs(region)
    (out,) = run_candidate(load_candidate, region, GEMV_POINTS[point], inputs)
    check_close(out, reference(region, inputs))


def test_gemv_calls_reuse_the_workspace(load_candidate):
    # Symbolic rows: calls of one module with other M share (and grow) the cached workspace.
    region = make_region(("S",), 50, 300, "bfloat16", has_bias=True, dims={"S": (1, 4)})
    module = load_candidate(FAMILY.render(region, GEMV_POINTS["fma_split"]), "gemv_twice")
    for rows, seed in ((2, 0), (2, 1), (4, 2), (1, 3)):
        inputs = make_inputs(region, {"S": rows}, seed=seed)
        (out,) = module.run(*inputs)
        check_close(out, reference(region, inputs))
        partials, arrivals = module._WORKSPACES[inputs[0].device]
        # every counter back at zero: the next launch needs no clearing
        assert partials.numel() >= 4 * rows * 50 and not arrivals.any()
    # the same tensors on a call that fits: nothing allocated but the output
    assert module._workspace(inputs[0].device, 4 * 50, 4) == module._WORKSPACES[inputs[0].device]


@pytest.mark.parametrize("point", ["fma_stream", "dot_stream"])
def test_gemv_stream_k_slots_hold_every_tile_meeting(point, load_candidate):
    # Symbolic rows, so one module sees several tile counts: each call's slots (from the host's
    # bound) cover the most programs whose ranges share a tile, counted here by brute force
    region = make_region(("S",), 50, 300, "bfloat16", dims={"S": (1, 16)})
    params = GEMV_POINTS[point]
    module = load_candidate(FAMILY.render(region, params), f"gemv_stream_{point}")
    k_tiles = -(-300 // params["BLOCK_K"])
    for rows, seed in ((1, 0), (3, 1), (16, 2), (2, 3)):
        inputs = make_inputs(region, {"S": rows}, seed=seed)
        (out,) = module.run(*inputs)
        check_close(out, reference(region, inputs))
        tiles = -(-rows // params["BLOCK_M"]) * -(-50 // params["BLOCK_N"])
        work = tiles * k_tiles
        programs = module._stream_programs(inputs[0].device, work)
        owners = [max(p for p in range(programs) if p * work // programs <= step) for step in range(work)]
        sharing = max(len(set(owners[t * k_tiles:(t + 1) * k_tiles])) for t in range(tiles))
        partials, arrivals = module._WORKSPACES[inputs[0].device]
        assert sharing > 1 and partials.numel() >= tiles * sharing * params["BLOCK_M"] * params["BLOCK_N"]
        assert not arrivals.any()  # every counter back at zero: the next launch needs no clearing


def test_gemv_without_split_has_no_workspace(load_candidate):
    region = make_region((1,), 50, 300, "bfloat16")
    module = load_candidate(FAMILY.render(region, GEMV_POINTS["fma"]), "gemv_no_split")
    assert not hasattr(module, "_WORKSPACES") and not hasattr(module, "_workspace")


def test_gemv_offered_for_decode_sized_m_only():
    def offers(region):
        offered = FAMILY.param_space(region, H200).get("GEMV", [False])
        assert (True in offered) == any(p.get("GEMV") for p in FAMILY.legal_points(region, H200))
        return True in offered

    assert offers(make_region((1,), 4096, 4096, "bfloat16"))
    assert offers(make_region((64,), 4096, 4096, "bfloat16"))
    assert offers(make_region((2, 8), 4096, 4096, "bfloat16"))  # M = 16
    assert offers(make_region(("S",), 4096, 4096, "bfloat16", dims={"S": (1, 64)}))
    assert not offers(make_region((65,), 4096, 4096, "bfloat16"))
    assert not offers(make_region((4096,), 4096, 4096, "bfloat16"))
    assert not offers(make_region(("S",), 4096, 4096, "bfloat16"))  # unbounded, no example
    assert not offers(make_region(("S",), 4096, 4096, "bfloat16", dims={"S": (1, 2048)}))
    # planned for its example (a decode step) even when the range reaches prefill sizes
    decode_step = RegionSummary(**{**make_region(("S",), 4096, 4096, "bfloat16", dims={"S": (1, 2048)}).__dict__,
                                   "example_dims": {"S": 1}})
    assert offers(decode_step)
    # the tensor-core kernels keep exactly their old space
    large = FAMILY.param_space(make_region((4096,), 4096, 4096, "bfloat16"), H200)
    assert "GEMV" not in large and large["BLOCK_M"] == [16, 32, 64, 128] and large["BLOCK_K"] == [32, 64, 128]


def test_gemv_space_values_are_all_legal_somewhere():
    # three rows: BLOCK_M=1 is legal, 32..128 exceed the problem; Hopper variants need big tiles
    region = make_region((3,), 200, 1100, "bfloat16")
    space = FAMILY.param_space(region, H200)
    points = FAMILY.legal_points(region, H200)
    used = {(k, v) for p in points for k, v in p.items()}
    unused = {(k, v) for k, values in space.items() for v in values} - used
    assert unused == {("BLOCK_M", 32), ("BLOCK_M", 64), ("BLOCK_M", 128), ("PERSISTENT", True),
                      ("USE_TMA", True), ("EPILOGUE_SUBTILE", 2)}
    # every point names every knob of the space (advisors' answers are screened so); each
    # stream-K point is the twin of a legal point of one program a tile and K split
    assert all(set(p) == set(space) for p in points)
    twins = [p for p in points if p["STREAM_K"]]
    assert twins and all(p["SPLIT_K"] == 1 and p["GEMV"] and {**p, "STREAM_K": 0} in points for p in twins)


def test_gemv_covering_points_match_torch(load_candidate):
    region = make_region((3,), 200, 1100, "bfloat16", has_bias=True)
    inputs = make_inputs(region)
    points = [p for p in FAMILY.legal_points(region, H200) if p["GEMV"]]
    for i, params in enumerate(covering_points(points)):
        (out,) = run_candidate(load_candidate, region, params, inputs, stem=f"gemv_cover_{i}")
        check_close(out, reference(region, inputs))


def test_gemv_rejections():
    decode = make_region((1,), 4096, 4096, "bfloat16")
    best = gemv(1, 16, 512)
    assert FAMILY.check(decode, best, H200) is None
    assert "decode-sized" in FAMILY.check(make_region((4096,), 4096, 4096, "bfloat16"), best, H200)
    assert "GROUP_M=1" in FAMILY.check(decode, {**best, "GROUP_M": 8}, H200)
    assert "kernel of its own" in FAMILY.check(decode, {**best, "PERSISTENT": True}, H200)
    assert "kernel of its own" in FAMILY.check(decode, {**best, "USE_TMA": True}, H200)
    assert "at most 4 rows" in FAMILY.check(make_region((8,), 4096, 4096, "bfloat16"), best, H200)
    assert FAMILY.check(make_region((8,), 4096, 4096, "bfloat16"), {**best, "BLOCK_M": 16}, H200) is None
    assert "exceeds the problem" in FAMILY.check(make_region((8,), 4096, 4096, "bfloat16"), {**best, "BLOCK_M": 32}, H200)
    assert "shared memory" in FAMILY.check(make_region((64,), 4096, 4096, "bfloat16"), gemv(64, 128, 512, stages=5), H200)
    assert "spills registers" in FAMILY.check(decode, gemv(1, 128, 256, stages=2), H200)  # 256 weights a thread
    assert "idle" in FAMILY.check(decode, gemv(1, 16, 256, warps=8), H200)
    assert "K-steps" in FAMILY.check(decode, gemv(1, 32, 512, split=8), H200)  # 8 K steps in all
    assert "two each" in FAMILY.check(make_region((1,), 128256, 4096, "bfloat16"), gemv(1, 32, 256, split=2), H200)
    # the GEMV tiles are the GEMV kernel's only
    for tile in ((1, 32, 128), (16, 16, 128), (16, 32, 256)):
        params = {**SMALL, "BLOCK_M": tile[0], "BLOCK_N": tile[1], "BLOCK_K": tile[2]}
        assert "GEMV tile" in FAMILY.check(decode, params, H200)


def heuristic_ranking(m: int, n: int, k: int) -> list[dict]:
    """The heuristic advisor's ranking of every legal point of a bf16 [m, k] x [k, n] region."""
    from coopt.llm_advisor import AdviceRequest, HeuristicAdvisor

    region = make_region((m,), n, k, "bfloat16")
    legal = tuple(FAMILY.legal_points(region, H200))
    request = AdviceRequest(region, FAMILY.name, FAMILY.param_space(region, H200), legal, H200.facts())
    return list(HeuristicAdvisor().advise(request).ranked)


def test_heuristic_ranks_gemv_first_for_decode():
    def first(m, n, k):
        return heuristic_ranking(m, n, k)[0]

    def tile(p):
        return p["BLOCK_M"], p["BLOCK_N"], p["BLOCK_K"], p["SPLIT_K"], p["num_warps"], p["num_stages"]

    # the measured winners of bench/gemm.py --quick --shapes skinny (H200, CUDA graphs)
    assert first(1, 4096, 4096)["GEMV"] and tile(first(1, 4096, 4096)) == (1, 16, 512, 1, 4, 3)
    assert tile(first(1, 14336, 4096)) == (1, 32, 256, 1, 4, 3)
    assert tile(first(1, 4096, 14336)) == (1, 16, 512, 1, 4, 3)
    assert tile(first(1, 128256, 4096)) == (1, 32, 256, 1, 4, 3)
    assert first(32, 4096, 4096)["GEMV"] and first(32, 4096, 4096)["BLOCK_M"] == 32
    large = first(4096, 4096, 4096)  # unchanged: the persistent TMA kernel
    assert not large.get("GEMV") and large["PERSISTENT"] and large["USE_TMA"]


def test_heuristic_measures_the_swapped_head_winner_at_32_rows():
    # H200, 32 rows (bench/gemm.py --shapes stats32, session 23): the output head's fastest point,
    # 256x128 swapped at 3 stages (245.8 µs), ranked fifth behind 128x256 at 2 stages (274.6), out
    # of the four tiles a build measures; swapped tiles now take 256-byte weight rows as full rows
    ranked = heuristic_ranking(32, 128256, 4096)
    tiles = list(dict.fromkeys((p["BLOCK_M"], p["BLOCK_N"], p["BLOCK_K"], p["SPLIT_K"], p.get("SWAP_AB"),
                                p.get("NORM_FIRST")) for p in ranked))
    assert (32, 256, 128, 1, True, None) in tiles[:4]
    assert ranked[0]["SWAP_AB"] and ranked[0]["BLOCK_K"] == 128
    # one row is unchanged: the multiply-and-sum kernel's 512-byte rows
    assert heuristic_ranking(1, 128256, 4096)[0]["BLOCK_K"] == 256


def test_heuristic_ranks_stream_k_behind_its_twin():
    # slower than its twin on the H200 (session 21): out of a build's top 3, each after the point it is a form of
    # (fewer programs an SM first)
    for m, n, k in ((1, 6144, 4096), (32, 4096, 4096)):
        legal = FAMILY.legal_points(make_region((m,), n, k, "bfloat16"), H200)
        ranked = heuristic_ranking(m, n, k)
        position = {tuple(sorted(p.items())): i for i, p in enumerate(ranked)}
        assert not any(p.get("STREAM_K") for p in ranked[:3])
        twins = [p for p in ranked if p.get("STREAM_K")]
        assert twins
        for twin in twins:
            plain = {**twin, "STREAM_K": 0}
            assert position[tuple(sorted(plain.items()))] < position[tuple(sorted(twin.items()))]
            fewer = {**twin, "STREAM_K": twin["STREAM_K"] // 2}
            if fewer["STREAM_K"] and fewer in legal:
                assert position[tuple(sorted(fewer.items()))] < position[tuple(sorted(twin.items()))]


# -- the space stays bounded and legal ---------------------------------------------------

def test_check_rejections():
    big = make_region((4096,), 4096, 4096, "float32")
    huge_tile = {**SMALL, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 3}
    assert "shared memory" in FAMILY.check(big, huge_tile, H200)
    bf16 = make_region((4096,), 4096, 4096, "bfloat16")
    wide = {**SMALL, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_stages": 4}
    assert "spills" in FAMILY.check(bf16, {**wide, "num_warps": 4}, H200)
    assert FAMILY.check(bf16, {**wide, "num_warps": 8}, H200) is None
    assert "idle" in FAMILY.check(bf16, {**SMALL, "num_warps": 8}, H200)
    decode = make_region((1,), 4096, 4096, "bfloat16")
    assert "exceeds the problem" in FAMILY.check(decode, {**SMALL, "BLOCK_M": 32}, H200)
    assert FAMILY.check(decode, {**SMALL, "SPLIT_K": 8}, H200) is None
    assert "K-steps" in FAMILY.check(make_region((1,), 4096, 256, "bfloat16"), {**SMALL, "SPLIT_K": 8}, H200)
    assert "fill" in FAMILY.check(bf16, {**SMALL, "SPLIT_K": 2}, H200)
    # symbolic M: bounded by its range, unbounded when the range is unknown
    ranged = make_region(("S",), 64, 64, dims={"S": (1, 8)})
    assert "exceeds the problem" in FAMILY.check(ranged, {**SMALL, "BLOCK_M": 32}, H200)
    assert FAMILY.check(make_region(("S",), 64, 64), {**SMALL, "BLOCK_M": 128}, H200) is None
    flattened = make_region(("4*s0",), 64, 64, dims={"s0": (1, 2)})  # sympy-printed dim expression
    assert "at most 8" in FAMILY.check(flattened, {**SMALL, "BLOCK_M": 32}, H200)


def test_space_is_bounded():
    region = make_region((4096,), 4096, 4096, "bfloat16")
    space = FAMILY.param_space(region, H200)
    assert all(len(v) <= 5 for v in space.values())
    points = FAMILY.legal_points(region, H200)
    assert 0 < len(points) < 2000  # about 2/3 of them the tile-loop (PERSISTENT / USE_TMA) variants
    decode = FAMILY.legal_points(make_region((1,), 4096, 4096, "bfloat16"), H200)
    assert 0 < len(decode) < 3000  # the GEMV points of a decode-sized region, their stream-K and flag-meeting twins included
    plain = [p for p in decode if not p["GEMV"]]
    assert {p["BLOCK_M"] for p in plain} == {16} and {p["SPLIT_K"] for p in plain} == {1, 2, 4, 8}
    assert {p["BLOCK_M"] for p in decode if p["GEMV"]} == {1, 16}


def test_matches():
    region = make_region((8,), 8, 8)
    assert FAMILY.matches(region)
    assert not FAMILY.matches(RegionSummary(**{**region.__dict__, "family": "attention"}))
    fp8 = RegionSummary(**{**region.__dict__, "inputs": (TensorSpec((8, 8), "float8_e4m3fn"), region.inputs[1])})
    assert not FAMILY.matches(fp8)


def test_docstring_examples():
    import doctest

    from coopt.templates import matmul_epilogue

    result = doctest.testmod(matmul_epilogue)
    assert result.attempted > 0 and result.failed == 0


def test_golden_rendering(golden):
    region = make_region(("B", 128), 512, 256, "bfloat16", has_bias=True, extras=[("B", 128, 512)],
                         epilogue=GELU_RESIDUAL, outputs=["y"], dims={"B": (1, 8)})
    params = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 2, "num_warps": 4, "num_stages": 3}
    golden("matmul_epilogue.py", FAMILY.render(region, params))


def test_golden_rendering_tma_persistent(golden):
    region = make_region(("B", 128), 512, 256, "bfloat16", has_bias=True, extras=[("B", 128, 512)],
                         epilogue=GELU_RESIDUAL, outputs=["y"], dims={"B": (1, 8)})
    params = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 1, "num_warps": 8,
              "num_stages": 4, "PERSISTENT": True, "USE_TMA": True, "EPILOGUE_SUBTILE": 2}
    assert FAMILY.check(region, params, H200) is None
    golden("matmul_epilogue_tma_persistent.py", FAMILY.render(region, params))


def test_golden_rendering_gemv(golden):
    # decode: a batch of at most 4 single-token rows, bias, GELU and a residual
    region = make_region(("B", 1), 512, 256, "bfloat16", has_bias=True, extras=[("B", 1, 512)],
                         epilogue=GELU_RESIDUAL, outputs=["y"], dims={"B": (1, 4)})
    split, dot = gemv(1, 32, 64, split=2), gemv(16, 32, 256, stages=4)
    assert FAMILY.check(region, split, H200) is None and FAMILY.check(region, dot, H200) is None
    golden("matmul_epilogue_gemv_split.py", FAMILY.render(region, split))
    golden("matmul_epilogue_gemv_dot.py", FAMILY.render(region, dot))


# -- Hopper compilation (no GPU needed) ---------------------------------------------------

# The large-GEMM points the heuristic ranks first (bench/NOTES-gemm.md), beyond the covering set:
# for an up-projection (bias, GELU) and a down-projection (bias, residual: the persistent kernel
# needs shared memory for the residual's layout change, so fewer stages fit).
_WIDE = {**SMALL, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
_TMA_PERSISTENT = {**_WIDE, "PERSISTENT": True, "USE_TMA": True}
HOPPER_POINTS = {
    "up": [_TMA_PERSISTENT, {**_TMA_PERSISTENT, "EPILOGUE_SUBTILE": 2, "num_stages": 4}],
    "down": [{**_TMA_PERSISTENT, "EPILOGUE_SUBTILE": 2},
             {**_WIDE, "USE_TMA": True, "EPILOGUE_SUBTILE": 2, "num_stages": 4},
             {**_TMA_PERSISTENT, "BLOCK_N": 128, "num_stages": 5}],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_covering_points_compile_for_hopper(tmp_path):
    jobs, expected = [], {}

    def add(label, dtype, region, params):
        assert FAMILY.check(region, params, H200) is None, (label, FAMILY.check(region, params, H200))
        jobs.append((label, FAMILY.render(region, params), make_inputs(region)))
        expected[label] = (dtype, params)

    for dtype in ("float32", "bfloat16"):
        region = make_region((256,), 512, 512, dtype, has_bias=True, extras=[(256, 512)],
                             epilogue=GELU_RESIDUAL, outputs=["y"])
        for i, params in enumerate(covering_points(FAMILY.legal_points(region, H200))):
            add(f"{dtype}_{i}", dtype, region, params)
    up = make_region((256,), 512, 512, "bfloat16", has_bias=True, epilogue=[["y", "gelu", ["acc"]]], outputs=["y"])
    down = make_region((256,), 512, 512, "bfloat16", has_bias=True, extras=[(256, 512)],
                       epilogue=[["y", "add", ["acc", "in0"]]], outputs=["y"])
    for name, region in (("up", up), ("down", down)):
        for i, params in enumerate(HOPPER_POINTS[name]):
            add(f"{name}_{i}", "bfloat16", region, params)
    # a TMA point whose launch falls back to pointers (K = 100: rows of a are 200 B apart)
    ragged_k = make_region((256,), 512, "K", "bfloat16", has_bias=True, dims={"K": (1, 4096)})
    params = HOPPER_POINTS["down"][2]
    assert FAMILY.check(ragged_k, params, H200) is None
    jobs.append(("fallback", FAMILY.render(ragged_k, params), make_inputs(ragged_k, {"K": 100})))
    expected["fallback"] = ("bfloat16", {**params, "USE_TMA": False})
    compiled = compile_for_hopper(jobs, tmp_path, machine_code=True)
    for label, (dtype, params) in expected.items():
        kernels, tma = compiled[label], params.get("USE_TMA", False)
        name = "_tiles_kernel" if params.get("PERSISTENT") or tma else "_matmul_kernel"
        assert set(kernels) == {name} | ({"_split_k_reduce_kernel"} if params["SPLIT_K"] > 1 else set())
        main = kernels[name]
        assert all(k["pdl"] for k in kernels.values()), f"a launch without programmatic dependent launch: {params}"
        # (rows 200 B apart leave cp.async nothing 16-byte aligned to pipeline)
        assert main["pipelined"] or label == "fallback", f"operand loads not pipelined for {dtype} {params}"
        assert main["wgmma"] == (dtype == "bfloat16" and params["BLOCK_M"] >= 64), f"wgmma use for {dtype} {params}"
        assert main["tma"] == tma, f"bulk tensor copies for {dtype} {params}"
        assert main["shared"] <= H200.smem_per_block_bytes, f"check() underestimated shared memory: {params}"
        if main.get("hgmma") is not None:  # the SASS, where cuobjdump runs
            assert (main["hgmma"] > 0) == main["wgmma"] and (main["utmaldg"] > 0) == tma
            # Tensor copies leave registers to spare when the epilogue holds at most 64 fp32
            # values a thread at a time; 128 (a 128x256 tile in one piece over 8 warps, or
            # 128x128 over 4) spill with GELU (bench/NOTES-gemm.md).
            slice_values = params["BLOCK_M"] * params["BLOCK_N"] // params.get("EPILOGUE_SUBTILE", 1)
            if tma and slice_values // (32 * params["num_warps"]) <= 64:
                assert main["spill_instructions"] == 0, f"spills for {params}"


# The GEMV points the heuristic ranks first for decode GEMMs (measured best or within 3% on the
# H200: bench/gemm.py --quick --shapes skinny,decode), a split-K one (the arrival counters) and
# an fp32 one.
GEMV_HOPPER_POINTS = {
    "one_row": [gemv(1, 16, 512), gemv(1, 32, 256), gemv(1, 32, 256, split=4, stages=4),
                {**gemv(1, 16, 512), "STREAM_K": 4}],
    "rows32": [gemv(32, 32, 256, stages=4), gemv(32, 32, 512), gemv(16, 64, 256, split=2, stages=4),
               {**gemv(32, 32, 256, stages=4), "STREAM_K": 2}],
    "fp32": [gemv(1, 32, 128, split=4, stages=4)],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_gemv_points_compile_for_hopper(tmp_path):
    regions = {
        "one_row": make_region((1,), 512, 4096, "bfloat16", has_bias=True, extras=[(1, 512)],
                               epilogue=GELU_RESIDUAL, outputs=["y"]),
        "rows32": make_region((32,), 512, 4096, "bfloat16"),
        "fp32": make_region((1,), 512, 4096, "float32", has_bias=True),
    }
    cases = {name: (region, GEMV_HOPPER_POINTS[name]) for name, region in regions.items()}
    assert_gemv_points_compile(FAMILY, cases, make_inputs, tmp_path, H200)
