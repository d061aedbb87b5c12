"""gemm_skinny_cuda: the CUDA decode-batch GEMM (K split over a thread-block cluster). On the CPU:
that it matches only behind its flag (no GPU has run it yet), which regions it takes and why it
declines the others, that it offers no point without a GPU, the layouts its points make and the
ones it refuses, that the heuristic's first points are legal for a b32 layer's regions, that every
form compiles for sm_90a without spills (nvcc, where installed), that only weight copies go out
before its PDL wait, and that its module refuses CPU tensors clearly. On the GPU
(@pytest.mark.gpu): agreement with an fp32 reference over drawn forms (bias, residual, the norm
statistics prologue, GLU, the row statistics outputs), batch sizes and points, launched with PDL
and without, back to back."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.protocol import AdviceRequest
from coopt.targets import H200
from coopt.templates import base as template_base
from coopt.templates.gemm_skinny_cuda import FLAG, GemmSkinnyCudaFamily, layout, skinny_problem
from coopt.templates.registry import families_for
from coopt.verify.profiles import resolve_profile
from template_helpers import kernel_source

SKINNY = GemmSkinnyCudaFamily()
POINT = {"CLUSTER": 8, "num_warps": 8, "num_stages": 3, "KW": 64, "PARTS": 2}
FORMS = ("plain", "bias", "residual", "stats", "stats_swiglu", "producer")
CHUNK, EPS = 64, 1e-5


def region(m: int = 32, n: int = 4096, k: int = 4096, form: str = "residual", dtype: str = "bfloat16") -> RegionSummary:
    """A matmul_epilogue region as a b32 build makes them (fuse-norm-statistics: the norms'
    consumers read h * g and the chunk sums of h^2, the residual GEMVs produce them)."""
    glu = form.endswith("swiglu")
    inputs = [TensorSpec((m, 1, k), dtype), TensorSpec((2 * n if glu else n, k), dtype)]
    outputs = [TensorSpec((m, 1, n), dtype)]
    attrs = {"b_layout": "nk", "has_bias": form == "bias", "epilogue": [], "outputs": ["acc"]}
    if form == "bias":
        inputs.append(TensorSpec((n,), dtype))
    if form.startswith("stats"):
        inputs.append(TensorSpec((k // CHUNK, m), "float32"))
        attrs["prologue"] = {"kind": "rms_norm_stats", "eps": EPS, "squares_input": 2}
    if glu:
        attrs.update(glu=True, epilogue=[["t0", "silu", ["acc"]], ["y", "mul", ["t0", "acc_hi"]]], outputs=["y"])
    if form in ("residual", "producer"):
        inputs.append(TensorSpec((m, 1, n), dtype))
        attrs.update(epilogue=[["y", "add", ["acc", "in0"]]], outputs=["y"])
    if form == "producer":
        inputs.append(TensorSpec((n,), dtype))
        outputs += [TensorSpec((m, 1, n), dtype), TensorSpec((n // CHUNK, m), "float32")]
        attrs["row_squares"] = {"chunk": CHUNK, "weight_input": len(inputs) - 1, "output": 0}
    return RegionSummary(f"skinny_{form}", "matmul_epilogue", inputs=tuple(inputs), outputs=tuple(outputs), attrs=attrs)


@pytest.fixture
def enabled(monkeypatch):
    """The family's flag set (it matches nothing until a GPU has run it)."""
    monkeypatch.setenv(FLAG, "1")


@pytest.fixture
def gpu_points(monkeypatch, enabled):
    """As on a GPU machine: the family offers points."""
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: True)


def test_it_matches_only_behind_its_flag(monkeypatch):
    monkeypatch.delenv(FLAG, raising=False)  # a GPU session may run the file with it set
    assert "gemm_skinny_cuda" not in [f.name for f in families_for(region())]
    monkeypatch.setenv(FLAG, "1")
    for form in FORMS:
        assert skinny_problem(region(form=form)) is None, form
        assert [f.name for f in families_for(region(form=form))] == ["matmul_epilogue", "gemm_skinny_cuda"]


@pytest.mark.parametrize(("changed", "why"), [
    (region(m=1), "2-64 activation rows"),
    (region(m=65), "2-64 activation rows"),
    (region(k=4100), "multiple of 64"),
    (region(dtype="float16"), "bf16"),
    (dataclasses.replace(region(), attrs={**region().attrs, "b_layout": "kn"}), "[N, K]"),
    (dataclasses.replace(region(form="plain"), inputs=(*region().inputs[:2], TensorSpec((4096,), "bfloat16")),
                         attrs={**region(form="plain").attrs, "prologue": {"kind": "rms_norm", "eps": EPS,
                                                                            "has_weight": True}}), "RMSNorm"),
    (dataclasses.replace(region(), inputs=(*region().inputs[:2], TensorSpec((2, 1, 4096), "bfloat16"))),
     "[M, N] or [N]"),
    (dataclasses.replace(region(), input_names=("", "", "")), "model parameter"),
])
def test_it_declines_what_the_kernel_does_not_implement_and_says_why(enabled, changed, why):
    problem = skinny_problem(changed)
    assert problem is not None and why in problem, problem
    assert "gemm_skinny_cuda" not in [f.name for f in families_for(changed)]


def test_no_point_without_a_gpu(monkeypatch, enabled):
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: False)
    assert SKINNY.legal_points(region(), H200) == []
    assert "NVIDIA GPU" in SKINNY.check(region(), POINT, H200)
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: True)
    assert SKINNY.check(region(), POINT, H200) is None
    assert "Hopper" in SKINNY.check(region(), POINT, dataclasses.replace(H200, arch="sm_80"))
    assert SKINNY.check(region(), {**POINT, "num_warps": 5}, H200) == "num_warps=5 is not in the space"


def test_a_points_layout():
    # o at b32: 8 warps of 32-row groups a round, 256 outputs a row over 8 blocks: a unit of 32,
    # 8 threads a batch row of 4 outputs each; x's slice 32 x (512 + 8) bf16, 8 rings of 3 x 4
    # KB, two rounds of partials 32 x (256 + 4) floats
    plain = layout(32, 4096, 4096, False, 0, POINT)
    assert (plain.m_pad, plain.opg, plain.unit, plain.v, plain.grain, plain.lanes) == (32, 32, 32, 4, 1, 0)
    assert plain.shared == 32 * 520 * 2 + 8 * 3 * 4096 + 2 * 32 * 260 * 4
    # producing 64-column chunk sums: units of a chunk (4 of the 8 blocks sum a round), 8 outputs a
    # thread, a chunk's 8 threads in one warp, cluster shares of whole chunks (2 groups)
    producer = layout(32, 4096, 4096, False, 64, POINT)
    assert (producer.unit, producer.v, producer.lanes, producer.grain) == (64, 8, 8, 2)
    # a GLU's group is 16 outputs (its gate and up halves); 17 rows run as 32, 33 as 64
    glu = layout(17, 4096, 14336, True, 0, {**POINT, "num_warps": 6})
    assert (glu.m_pad, glu.opg, glu.unit, glu.v) == (32, 16, 12, 2)
    assert layout(33, 4096, 4096, False, 0, {**POINT, "CLUSTER": 4}).m_pad == 64


@pytest.mark.parametrize(("args", "params", "why"), [
    ((16, 4096, 4096, False, 0), {**POINT, "CLUSTER": 16, "num_warps": 4}, "outputs a thread"),  # 8 over 8 threads
    ((32, 3072, 4096, False, 0), {**POINT, "CLUSTER": 16, "KW": 128}, "whole slabs"),  # K 3072: 192 columns a share
    ((32, 4096, 4096, False, 64), {**POINT, "num_warps": 6}, "over 6 threads a row"),  # a chunk of 64 over 6
    ((40, 4096, 4096, False, 0), {**POINT, "num_warps": 3}, "split evenly"),  # 96 threads over 64 rows
])
def test_layouts_the_kernel_cannot_run_are_refused_with_the_reason(args, params, why):
    with pytest.raises(ValueError, match=why):
        layout(*args, params)


@pytest.mark.parametrize(("form", "n", "k"), [("stats", 6144, 4096), ("producer", 4096, 4096),
                                              ("stats_swiglu", 14336, 4096), ("producer", 4096, 14336),
                                              ("stats", 128256, 4096)],
                         ids=["q|k|v", "o", "gate|up", "down", "head"])
def test_a_b32_layers_regions_have_legal_points_and_the_heuristic_ranks_them(gpu_points, form, n, k):
    from coopt.candidates import diverse_top_k

    r = region(32, n, k, form)
    legal = tuple(SKINNY.legal_points(r, H200))
    assert legal, form
    request = AdviceRequest(r, SKINNY.name, SKINNY.param_space(r, H200), legal, H200.facts(), 4)
    built = [p for _, p in diverse_top_k(HeuristicAdvisor().advise(request).ranked, 4)]
    assert built and all(p in legal for p in built)


@pytest.mark.parametrize("m", [2, 16, 17, 33, 48, 64])
@pytest.mark.parametrize("form", ["residual", "producer", "stats_swiglu"])
def test_every_batch_it_takes_has_points(gpu_points, m, form):
    """Rows run as 16, 32 or 64 (48 would split no unit of outputs evenly over its threads: no
    point at all for 33-48 rows)."""
    r = region(m, 4096, 4096, form)
    assert skinny_problem(r) is None and SKINNY.legal_points(r, H200), (m, form)



@pytest.mark.parametrize(("form", "m", "k", "params"), [
    ("plain", 32, 4096, POINT), ("bias", 17, 4096, POINT), ("residual", 64, 4096, {**POINT, "num_warps": 4}),
    ("producer", 17, 4096, POINT),
    ("stats", 32, 4096, {**POINT, "num_warps": 12, "num_stages": 2, "PARTS": 1}),
    ("stats_swiglu", 32, 4096, POINT), ("producer", 32, 4096, POINT),
    ("producer", 32, 14336, {**POINT, "CLUSTER": 16, "num_stages": 4, "PARTS": 1}),
], ids=["plain", "bias-m17", "residual-m64", "producer-m17", "stats-12w", "gate|up", "o", "down"])
def test_every_form_compiles_for_hopper_without_spills(hopper_registers, enabled, form, m, k, params):
    source = kernel_source(SKINNY.render(region(m, 4096, k, form), params))
    assert hopper_registers(source) * params["num_warps"] * 32 <= 65536


def test_only_weight_copies_go_out_before_the_wait(hopper_ptx, enabled):
    """x, the statistics and the residual are the kernel before's outputs: read after
    griddepcontrol.wait; the weight's first slabs are copied before it."""
    ptx = hopper_ptx(kernel_source(SKINNY.render(region(form="stats"), POINT)))
    before, after = ptx.split("griddepcontrol.wait")
    assert "cp.async.cg.shared.global" in before and "ld.global" not in before
    assert "griddepcontrol.launch_dependents" in after
    assert ".reqnctapercluster 8, 1, 1" in ptx and "ld.shared::cluster" in ptx
    assert not re.search(r"\batom\.|\bred\.", ptx)  # no counters: the cluster meets in shared memory


def test_the_module_refuses_cpu_tensors_with_one_line(load_candidate, enabled):
    r = region(form="residual")
    run = load_candidate(SKINNY.render(r, POINT), "skinny_cpu").run
    with pytest.raises(RuntimeError, match="NVIDIA GPU only"):
        run(*(torch.zeros(s.shape, dtype=torch.bfloat16) for s in r.inputs))


# -- on the GPU --------------------------------------------------------------------------------


def make_inputs(r: RegionSummary, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = r.inputs[1].shape[1]
    tensors = []
    for i, spec in enumerate(r.inputs):
        x = torch.randn(spec.shape, generator=gen, device="cuda")
        if spec.dtype == "float32":  # chunk sums of squares: positive
            tensors.append(x.abs() * CHUNK)
            continue
        if i == 1:
            x = x / k ** 0.5
        tensors.append(x.to(torch.bfloat16))
    return tensors


def reference(r: RegionSummary, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp64 products: W x (* rsqrt(sum of the chunk sums / K + eps)) + bias, silu(gate) * up, +
    residual; for a producer also h * g and the chunk sums of h^2 from h as it is."""
    m, k = r.inputs[0].shape[0], r.inputs[0].shape[-1]
    x, w = inputs[0].double().reshape(m, k), inputs[1].double()
    acc = x @ w.T
    at = 2
    if r.attrs["has_bias"]:
        acc, at = acc + inputs[at].double(), at + 1
    if r.attrs.get("prologue"):
        acc, at = acc * torch.rsqrt(inputs[at].double().sum(0) / k + EPS)[:, None], at + 1
    if r.attrs.get("glu"):
        half = acc.shape[1] // 2
        acc = torch.nn.functional.silu(acc[:, :half]) * acc[:, half:]
    if r.attrs["epilogue"] and r.attrs["epilogue"][-1][1] == "add":
        acc = acc + inputs[at].double().reshape(m, -1)
    return [acc]


@pytest.mark.gpu
@settings(max_examples=resolve_profile().max_examples, deadline=None)  # COOPT_VERIFY_PROFILE=thorough: 200
@given(form=st.sampled_from(FORMS), m=st.sampled_from([2, 17, 32, 64]), groups=st.sampled_from([2, 10, 64, 258]),
       k=st.sampled_from([1024, 2048, 3584]), cluster=st.sampled_from([2, 4, 8, 16]),
       warps=st.sampled_from([4, 6, 8, 12]), stages=st.sampled_from([2, 3, 4, 6]), kw=st.sampled_from([64, 128]),
       parts=st.sampled_from([1, 2]), pdl=st.booleans(), seed=st.integers(0, 2**16))
def test_it_agrees_with_an_fp64_reference(tmp_path_factory, form, m, groups, k, cluster, warps, stages, kw, parts,
                                          pdl, seed):
    with pytest.MonkeyPatch.context() as patch:  # not the function-scoped fixture: Hypothesis refuses it
        patch.setenv(FLAG, "1")
        agrees_with_an_fp64_reference(tmp_path_factory, form, m, groups, k, cluster, warps, stages, kw, parts, pdl, seed)


def agrees_with_an_fp64_reference(tmp_path_factory, form, m, groups, k, cluster, warps, stages, kw, parts, pdl, seed):
    from coopt.runtime.kernel_loader import load_module_from_source

    n = groups * 64  # whole chunks of 64 (a producer's) and GLU groups of 16
    r = region(m, n, k, form)
    params = {"CLUSTER": cluster, "num_warps": warps, "num_stages": stages, "KW": kw, "PARTS": parts}
    assume(SKINNY.check(r, params, H200) is None)  # a layout it refuses (and says why) is not drawn twice
    module = load_module_from_source(SKINNY.render(r, params), tmp_path_factory.mktemp("skinny"), "skinny")
    module.use_pdl(pdl)
    inputs = make_inputs(r, seed)
    (expected,) = reference(r, inputs)
    results = [module.run(*inputs) for _ in range(3)]  # back to back: under PDL each waits for the one before
    torch.cuda.synchronize()
    for outs in results:
        out = outs[0].double().reshape(m, -1)
        assert out.shape == expected.shape and torch.isfinite(out).all()
        error = (out - expected).abs().max() / expected.abs().max()
        assert error < 1e-2, float(error)
        if form == "producer":  # h * g and the chunk sums of h^2 from h as stored
            h, g = outs[0].double().reshape(m, -1), inputs[-1].double()
            torch.testing.assert_close(outs[1].double().reshape(m, -1), (h * g).to(torch.bfloat16).double(),
                                       rtol=8e-3, atol=0)
            squares = h.pow(2).reshape(m, -1, CHUNK).sum(-1).T
            torch.testing.assert_close(outs[2].double(), squares, rtol=1e-5, atol=0)
