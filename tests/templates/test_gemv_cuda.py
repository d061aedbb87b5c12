"""gemv_cuda: the CUDA batch-1 GEMV. On the CPU: which regions it takes and why it declines the
others, that it offers no point without a GPU, its space's checks, the heuristic's first point,
the epilogue program's CUDA form, that every form compiles for sm_90a without spills (nvcc, where
installed), that only weight copies go out before its PDL wait, and that its module refuses CPU
tensors clearly. On the GPU (@pytest.mark.gpu): agreement with an fp32 reference over drawn
forms (bias, RMSNorm with and without weight, GLU, residual) and points, launched with PDL and
without, back to back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.protocol import AdviceRequest
from coopt.targets import H200
from coopt.templates import base as template_base
from coopt.templates.ewprogram import render_program
from coopt.templates.gemv_cuda import GemvCudaFamily, gemv_problem, shared_bytes
from coopt.templates.registry import families_for
from coopt.verify.profiles import resolve_profile
from template_helpers import kernel_source

GEMV = GemvCudaFamily()
ADVISED = {"num_warps": 16, "ROWS": 1, "num_stages": 6, "BLOCKS": 1, "STAGGER": 0}
FORMS = ("plain", "bias", "residual", "norm", "norm_no_weight", "norm_swiglu")


def region(n: int = 512, k: int = 512, form: str = "residual", rows: int = 1, dtype: str = "bfloat16") -> RegionSummary:
    """A matmul_epilogue region as fuse-linear-epilogue / fuse-decode-gemv build them."""
    glu = form.endswith("swiglu")
    inputs = [TensorSpec((rows, 1, k), dtype), TensorSpec((2 * n if glu else n, k), dtype)]
    attrs = {"b_layout": "nk", "has_bias": form == "bias", "epilogue": [], "outputs": ["acc"]}
    if form == "bias":
        inputs.append(TensorSpec((n,), dtype))
    if form.startswith("norm"):
        weight = form != "norm_no_weight"
        attrs["prologue"] = {"kind": "rms_norm", "eps": 1e-5, "has_weight": weight}
        if weight:
            inputs.append(TensorSpec((k,), dtype))
    if glu:
        attrs.update(glu=True, epilogue=[["t0", "silu", ["acc"]], ["y", "mul", ["t0", "acc_hi"]]], outputs=["y"])
    if form == "residual":
        inputs.append(TensorSpec((rows, 1, n), dtype))
        attrs.update(epilogue=[["y", "add", ["acc", "in0"]]], outputs=["y"])
    return RegionSummary(f"gemv_{form}", "matmul_epilogue", inputs=tuple(inputs),
                         outputs=(TensorSpec((rows, 1, n), dtype),), attrs=attrs)


@pytest.fixture
def gpu_points(monkeypatch):
    """As on a GPU machine: the family offers points."""
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: True)


def test_it_takes_the_batch_1_decode_gemvs_beside_the_triton_family():
    for form in FORMS:
        assert gemv_problem(region(form=form)) is None, form
        assert [f.name for f in families_for(region(form=form))] == ["matmul_epilogue", "gemv_cuda"]


@pytest.mark.parametrize(("changed", "why"), [
    (region(rows=2), "one activation row"),
    (region(k=384), "multiple of 256"),
    (region(dtype="float16"), "bf16"),
    (dataclasses.replace(region(), attrs={**region().attrs, "b_layout": "kn"}), "[N, K]"),
    (dataclasses.replace(region(), attrs={**region().attrs, "prologue": {"kind": "rms_norm_stats", "eps": 1e-5,
                                                                          "squares_input": 3}}), "RMSNorm"),
    (dataclasses.replace(region(), inputs=(*region().inputs[:2], TensorSpec((1, 1, 1), "bfloat16"))),
     "N elements"),
])
def test_it_declines_what_the_kernel_does_not_implement_and_says_why(changed, why):
    problem = gemv_problem(changed)
    assert problem is not None and why in problem, problem
    assert "gemv_cuda" not in [f.name for f in families_for(changed)]


def test_no_point_without_a_gpu_and_every_space_point_checked(monkeypatch):
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: False)
    assert GEMV.legal_points(region(), H200) == []
    assert "NVIDIA GPU" in GEMV.check(region(), ADVISED, H200)
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: True)
    assert ADVISED in GEMV.legal_points(region(), H200)
    assert GEMV.check(region(), {**ADVISED, "num_warps": 4}, H200) == "num_warps=4 is not in the space"
    assert "ROWS=2" in GEMV.check(region(form="norm_swiglu"), ADVISED, H200)
    assert "Hopper" in GEMV.check(region(), ADVISED, dataclasses.replace(H200, arch="sm_80"))
    small = dataclasses.replace(H200, smem_per_block_bytes=64 * 1024)
    big = {**ADVISED, "num_stages": 8}  # 16 warps x 8 slabs x 512 B + x: 65 KiB
    assert "shared memory" in GEMV.check(region(), big, small) and GEMV.check(region(), ADVISED, small) is None
    # x staged in bf16 (normalised under a norm); every warp's ring of 512-byte slabs
    assert shared_bytes(ADVISED, 4096, glu=False) == 2 * 4096 + 16 * 6 * 512 + 16 * 4
    assert shared_bytes({**ADVISED, "ROWS": 2}, 4096, glu=True) == 2 * 4096 + 16 * 6 * 2 * 512 + 16 * 4


@pytest.mark.parametrize(("form", "k", "first", "stagger"), [
    ("residual", 4096, {(16, 1, 6, 1), (8, 2, 6, 1), (16, 1, 6, 2), (8, 2, 6, 2)}, 1),
    ("residual", 14336, {(16, 1, 6, 1), (8, 2, 6, 1), (16, 1, 6, 2), (8, 2, 6, 2)}, 0),
    ("norm_swiglu", 4096, {(16, 2, 4, 1), (8, 2, 4, 2)}, 1)])
def test_the_heuristic_puts_both_row_and_block_counts_in_a_builds_four(gpu_points, form, k, first, stagger):
    """The four kernels a build measures (diverse_top_k: warps and ring depth aside) are one and
    two rows, one and two blocks an SM, 16 warps an SM where the rows allow, each warp at its own
    slab where rows are short (K <= 4096; at 14336, down, it lost); a GLU's rings 4 slabs of two
    rows (session 31's sweep)."""
    from coopt.candidates import diverse_top_k

    r = region(n=4096, k=k, form=form)
    legal = tuple(GEMV.legal_points(r, H200))
    request = AdviceRequest(r, GEMV.name, GEMV.param_space(r, H200), legal, H200.facts(), 4)
    built = [p for _, p in diverse_top_k(HeuristicAdvisor().advise(request).ranked, 4)]
    kernels = {(p["num_warps"], p["ROWS"], p["num_stages"], p["BLOCKS"]) for p in built}
    assert first <= kernels
    assert all(p["STAGGER"] == stagger for p in built[:len(first)])


@pytest.mark.parametrize(("form", "ready"), [("norm_swiglu", (8, 1)), ("residual", (16, 1))])
def test_a_build_measures_a_pdl_ready_kernel_beside_its_four(gpu_points, form, ready):
    """Only one block an SM and an 8-warp GLU gain under PDL (session 31): a gate|up's four
    (16 warps at one block, 8 at two) have none, so the best-ranked ready point is added; a
    residual GEMV's four already hold one (16 warps, one block) and get nothing more."""
    from coopt.candidates import diverse_top_k, with_pdl_ready

    r = region(n=4096, k=4096, form=form)
    legal = tuple(GEMV.legal_points(r, H200))
    ranked = HeuristicAdvisor().advise(AdviceRequest(r, GEMV.name, GEMV.param_space(r, H200), legal,
                                                     H200.facts(), 4)).ranked
    four = diverse_top_k(ranked, 4)
    built = with_pdl_ready(four, ranked, lambda p: GEMV.pdl_ready(r, p))
    is_ready = [GEMV.pdl_ready(r, p) for _, p in built]
    assert any(is_ready) and (len(built) == len(four) + 1) == (form == "norm_swiglu")
    assert [rank for rank, _ in built] == sorted(rank for rank, _ in built)
    first_ready = next(p for (_, p), ok in zip(built, is_ready) if ok)
    assert (first_ready["num_warps"], first_ready["BLOCKS"]) == ready
    assert first_ready == next(p for p in ranked if GEMV.pdl_ready(r, p))  # the best-ranked such point


def test_pdl_ready_means_one_block_an_sm_and_an_8_warp_glu():
    glu, plain = region(form="norm_swiglu"), region(form="residual")
    point = dict(ADVISED, ROWS=2)
    assert GEMV.pdl_ready(plain, point) and not GEMV.pdl_ready(plain, {**point, "BLOCKS": 2})
    assert not GEMV.pdl_ready(glu, point) and GEMV.pdl_ready(glu, {**point, "num_warps": 8})
    assert not GEMV.pdl_ready(glu, {**point, "num_warps": 8, "BLOCKS": 2})


def test_the_epilogue_program_renders_as_cuda_floats():
    names = {"acc": "v_acc", "in0": "lo_bf16(in0[n])"}
    lines = render_program([["t", "silu", ["acc"]], ["y", "add", ["t", "in0"]], ["z", "mul", ["y", 0.5]]], names,
                           dialect="cuda")
    assert lines == ["const float v_t = (v_acc) / (1.0f + __expf(-(v_acc)));",
                     "const float v_y = (v_t) + (lo_bf16(in0[n]));", "const float v_z = (v_y) * 0.5f;"]
    with pytest.raises(ValueError, match="no CUDA literal"):
        render_program([["y", "mul", ["acc", float("inf")]]], {"acc": "v_acc"}, dialect="cuda")



def test_an_epilogue_with_float_casts_compiles_for_hopper(hopper_ptx):
    # x.to(float16) / x.to(bfloat16) in the epilogue: the prelude's round_f16 / round_bf16 (inline PTX)
    casts = region(form="residual")
    casts = dataclasses.replace(casts, attrs={**casts.attrs, "epilogue": [
        ["t", "to_f16", ["acc"]], ["u", "to_bf16", ["t"]], ["y", "add", ["u", "in0"]]]})
    ptx = hopper_ptx(kernel_source(GEMV.render(casts, ADVISED)))
    assert "cvt.rn.f16.f32" in ptx and "cvt.f32.f16" in ptx and "cvt.rn.bf16.f32" in ptx


@pytest.mark.parametrize("form", FORMS)
def test_every_form_compiles_for_hopper_without_spills(hopper_registers, form):
    params = {**ADVISED, "ROWS": 2} if form == "norm_swiglu" else ADVISED
    assert hopper_registers(kernel_source(GEMV.render(region(4096, 4096, form), params))) * 512 <= 65536


@pytest.mark.parametrize("form", ["norm", "norm_swiglu"])
def test_its_rings_start_on_a_128_byte_boundary(hopper_static_shared, form):
    """No static __shared__ (the norm's warp sums sit after the rings): with one, the rings moved
    off a 128-byte boundary and gate|up with its norm streamed 70.5 µs against 57.8 without."""
    params = {**ADVISED, "ROWS": 2} if form == "norm_swiglu" else ADVISED
    assert hopper_static_shared(kernel_source(GEMV.render(region(4096, 4096, form), params))) == 0


def test_only_parameter_reads_go_out_before_the_wait(hopper_ptx):
    """x, the bias and the residual are the kernel before's outputs (or may be): read after
    griddepcontrol.wait; the weight's first slabs are copied before it, and with a norm the norm
    weight's pieces (one 16-byte load a thread at 16 warps and K 4096) are loaded before it too."""
    for form, loads_before in (("residual", 0), ("bias", 0), ("norm", 1), ("norm_no_weight", 0)):
        ptx = hopper_ptx(kernel_source(GEMV.render(region(4096, 4096, form), ADVISED)))
        before, after = ptx.split("griddepcontrol.wait")
        assert before.count("cp.async.cg.shared.global") >= 1, form
        assert before.count("ld.global") == loads_before, form
        assert "griddepcontrol.launch_dependents" in after


def test_it_declines_a_region_whose_weights_a_kernel_computes():
    """Read before the PDL wait, b and the norm weight must be parameters (named in input_names)."""
    norm = region(form="norm")
    assert gemv_problem(dataclasses.replace(norm, input_names=("", "w.weight", "norm.weight"))) is None
    for names in (("", "", "norm.weight"), ("", "w.weight", ""), ("", "w.weight")):
        problem = gemv_problem(dataclasses.replace(norm, input_names=names))
        assert problem is not None and "parameters" in problem
    residual = region(form="residual")  # its extra input is the kernel before's output: fine
    assert gemv_problem(dataclasses.replace(residual, input_names=("", "w.weight", ""))) is None


def test_the_module_refuses_cpu_tensors_with_one_line(load_candidate):
    run = load_candidate(GEMV.render(region(), ADVISED), "gemv_cpu").run
    x, w, r = (torch.zeros(s.shape, dtype=torch.bfloat16) for s in region().inputs)
    with pytest.raises(RuntimeError, match="NVIDIA GPU only"):
        run(x, w, r)


# -- on the GPU --------------------------------------------------------------------------------


def make_inputs(r: RegionSummary, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = r.inputs[1].shape[1]
    tensors = []
    for i, spec in enumerate(r.inputs):
        x = torch.randn(spec.shape, generator=gen, device="cuda")
        if i == 1:
            x = x / k ** 0.5
        elif len(spec.shape) == 1 and "prologue" in r.attrs:
            x = 1 + 0.1 * x  # a norm weight
        tensors.append(x.to(torch.bfloat16))
    return tensors


def reference(r: RegionSummary, inputs: list[torch.Tensor]) -> torch.Tensor:
    """fp32 but for the normalised row, rounded to bf16 as the unfused RMSNorm writes it: x / rms(x)
    * g, W x + bias, silu(gate) * up, + residual."""
    x, w = inputs[0].float().reshape(-1), inputs[1].float()
    at = 2
    bias = None
    if r.attrs["has_bias"]:
        bias, at = inputs[at].float(), at + 1
    prologue = r.attrs.get("prologue")
    if prologue:
        x = x * torch.rsqrt(x.square().mean() + prologue["eps"])
        if prologue["has_weight"]:
            x, at = x * inputs[at].float(), at + 1
        x = x.to(torch.bfloat16).float()
    acc = w @ x + (bias if bias is not None else 0)
    if r.attrs.get("glu"):
        half = acc.shape[0] // 2
        acc = torch.nn.functional.silu(acc[:half]) * acc[half:]
    if r.attrs["epilogue"] and r.attrs["epilogue"][-1][1] == "add":
        acc = acc + inputs[at].float().reshape(-1)
    return acc


@pytest.mark.gpu
@settings(max_examples=resolve_profile().max_examples, deadline=None)  # COOPT_VERIFY_PROFILE=thorough: 200
@given(form=st.sampled_from(FORMS), n=st.sampled_from([64, 512, 1000, 4096]), k=st.sampled_from([256, 768, 4096]),
       warps=st.sampled_from([8, 16]), rows=st.sampled_from([1, 2]), stages=st.sampled_from([4, 6, 8]),
       blocks=st.sampled_from([1, 2]), stagger=st.sampled_from([0, 1]), pdl=st.booleans(), seed=st.integers(0, 2**16))
def test_it_agrees_with_an_fp32_reference(tmp_path_factory, form, n, k, warps, rows, stages, blocks, stagger, pdl, seed):
    from coopt.runtime.kernel_loader import load_module_from_source

    r = region(n, k, form)
    params = {"num_warps": warps, "ROWS": 2 if form == "norm_swiglu" else rows, "num_stages": stages, "BLOCKS": blocks,
              "STAGGER": stagger}
    assert GEMV.check(r, params, H200) is None  # every drawn point is legal: none is skipped untested
    source = GEMV.render(r, params)
    module = load_module_from_source(source, tmp_path_factory.mktemp("gemv"), "gemv")
    module.use_pdl(pdl)
    inputs = make_inputs(r, seed)
    expected = reference(r, inputs)
    outs = [module.run(*inputs)[0] for _ in range(3)]  # back to back: under PDL each waits for the one before
    torch.cuda.synchronize()
    for out in outs:
        assert out.shape == r.outputs[0].shape and torch.isfinite(out).all()
        error = (out.float().reshape(-1) - expected).abs().max() / expected.abs().max()
        assert error < 1e-2, float(error)
