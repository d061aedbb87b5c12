"""The row_reduction family: softmax / log_softmax / layer_norm / rms_norm match torch under Triton's interpreter.

Fixtures (load_candidate, assert_close, compile_for_sm90, golden) live in conftest.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from template_helpers import on_test_device

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.row_reduction import LOOPED_BLOCKS, NUM_WARPS, RowReductionFamily

# Masked-off lanes compute on padding (log(0), exp(inf - inf)) and numpy warns about it under the
# interpreter; those lanes are never stored.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

FAMILY = RowReductionFamily()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5
# the kinds' natural affine parts: layer_norm has weight and bias, rms_norm a weight
AFFINE = {"softmax": (False, False), "log_softmax": (False, False), "layer_norm": (True, True), "rms_norm": (True, False)}


def region(kind, n_cols, dtype="float32", residual=False, has_weight=None, has_bias=None):
    """A row_reduction RegionSummary over [R, n_cols], R symbolic up to 64 rows."""
    default_weight, default_bias = AFFINE[kind]
    has_weight = default_weight if has_weight is None else has_weight
    has_bias = default_bias if has_bias is None else has_bias
    x = TensorSpec(("R", n_cols), dtype)
    inputs = [x] + [x] * residual + [TensorSpec((n_cols,), dtype)] * (has_weight + has_bias)
    return RegionSummary(
        name="norm",
        family="row_reduction",
        inputs=tuple(inputs),
        outputs=(x, x) if residual else (x,),
        attrs={"kind": kind, "eps": EPS, "has_weight": has_weight, "has_bias": has_bias, "residual": residual},
        dims={"R": (1, 64)},
    )


def make_inputs(summary, x, seed=0):
    """x followed by the region's other inputs (residual, weight, bias), random."""
    generator = torch.Generator().manual_seed(seed)
    attrs, n_cols = summary.attrs, x.shape[-1]
    inputs = [x]
    if attrs["residual"]:
        inputs.append(torch.randn(x.shape, generator=generator).to(x.dtype))
    for present in (attrs["has_weight"], attrs["has_bias"]):
        if present:
            inputs.append(torch.randn(n_cols, generator=generator).to(x.dtype))
    return inputs


def torch_reference(summary, normalised, weight=None, bias=None):
    """torch's op on the row input (fp32); `normalised` is x, or the h = x + residual as stored."""
    kind, h = summary.attrs["kind"], normalised.float()
    weight = weight.float() if weight is not None else None
    bias = bias.float() if bias is not None else None
    if kind == "softmax":
        return torch.softmax(h, dim=-1)
    if kind == "log_softmax":
        return torch.log_softmax(h, dim=-1)
    if kind == "layer_norm":
        return F.layer_norm(h, h.shape[-1:], weight, bias, EPS)
    return F.rms_norm(h, h.shape[-1:], weight, EPS)


def check_candidate(load_candidate, assert_close, summary, params, inputs):
    """Run the rendered candidate and compare every output with torch."""
    module = load_candidate(FAMILY.render(summary, params))
    outputs = module.run(*on_test_device(inputs))
    attrs = summary.attrs
    rest = inputs[2:] if attrs["residual"] else inputs[1:]
    weight = rest.pop(0) if attrs["has_weight"] else None
    bias = rest.pop(0) if attrs["has_bias"] else None
    if attrs["residual"]:
        y, h = outputs
        assert_close(h, inputs[0].float() + inputs[1].float())
        # the kernel normalises h as stored (rounded), exactly like eager torch; the reference
        # runs on the CPU, where the other inputs are
        normalised = h.cpu()
    else:
        (y,) = outputs
        normalised = inputs[0]
    assert y.shape == inputs[0].shape and y.dtype == inputs[0].dtype
    assert_close(y, torch_reference(summary, normalised, weight, bias))


def _id(params):
    return f"N{params['BLOCK_N']}w{params['num_warps']}{'single' if params['single_pass'] else 'looped'}"


# Regions whose whole space is run: rows long enough for every looped BLOCK_N (softmax), a
# residual norm with both variants, and a short row with only the single-pass point.
SPACE_REGIONS = {
    "softmax_5000": (region("softmax", 5000), (2, 5000)),
    "rms_norm_residual_300": (region("rms_norm", 300, "bfloat16", residual=True), (3, 300)),
    "layer_norm_33": (region("layer_norm", 33, "float16"), (4, 33)),
}
SPACE_CASES = [
    pytest.param(name, params, id=f"{name}-{_id(params)}")
    for name, (summary, _) in SPACE_REGIONS.items()
    for params in FAMILY.legal_points(summary, H200)
]


def test_space_exercises_every_knob_value():
    points = [params for _, params in (case.values for case in SPACE_CASES)]
    assert {p["BLOCK_N"] for p in points} >= set(LOOPED_BLOCKS)
    assert {p["num_warps"] for p in points} == set(NUM_WARPS)
    assert {p["single_pass"] for p in points} == {True, False}


@pytest.mark.parametrize("name, params", SPACE_CASES)
def test_every_point(load_candidate, assert_close, name, params):
    summary, shape = SPACE_REGIONS[name]
    dtype = getattr(torch, summary.inputs[0].dtype)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    check_candidate(load_candidate, assert_close, summary, params, make_inputs(summary, x))


SINGLE = {"BLOCK_N": 256, "num_warps": 4, "single_pass": True}
LOOPED = {"BLOCK_N": 128, "num_warps": 4, "single_pass": False}  # 200 columns: two chunks


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("params", [SINGLE, LOOPED], ids=["single", "looped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "layer_norm", "rms_norm"])
def test_kinds_dtypes_variants(load_candidate, assert_close, kind, dtype, params, residual):
    summary = region(kind, 200, str(dtype).removeprefix("torch."), residual=residual)
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(2)).to(dtype)
    check_candidate(load_candidate, assert_close, summary, params, make_inputs(summary, x))


@pytest.mark.parametrize("kind, has_weight, has_bias", [
    ("layer_norm", False, False), ("layer_norm", False, True), ("layer_norm", True, False), ("rms_norm", False, False),
])
def test_optional_weight_and_bias(load_candidate, assert_close, kind, has_weight, has_bias):
    assert FAMILY.matches(region(kind, 40, has_weight=has_weight, has_bias=has_bias))
    summary = region(kind, 40, has_weight=has_weight, has_bias=has_bias)
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    check_candidate(load_candidate, assert_close, summary, {"BLOCK_N": 64, "num_warps": 2, "single_pass": True},
                    make_inputs(summary, x))


@pytest.mark.parametrize("n_cols", [1, 7, 33, 100])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "layer_norm", "rms_norm"])
def test_odd_row_lengths(load_candidate, assert_close, kind, n_cols):
    summary = region(kind, n_cols)
    block = 1 << (n_cols - 1).bit_length()
    x = torch.randn(5, n_cols, generator=torch.Generator().manual_seed(4))
    check_candidate(load_candidate, assert_close, summary, {"BLOCK_N": block, "num_warps": 1, "single_pass": True},
                    make_inputs(summary, x))


@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "layer_norm", "rms_norm"])
def test_long_rows_many_chunks(load_candidate, assert_close, kind):
    summary = region(kind, 1000, residual=kind not in ("softmax", "log_softmax"))
    x = torch.randn(2, 1000, generator=torch.Generator().manual_seed(5)) * 3
    check_candidate(load_candidate, assert_close, summary, {"BLOCK_N": 128, "num_warps": 4, "single_pass": False},
                    make_inputs(summary, x))


NON_CONTIGUOUS = {
    "transposed": lambda: torch.randn(48, 3).t(),  # unit row stride: the wrapper copies
    "column_slice": lambda: torch.randn(3, 100)[:, 10:58],  # row stride 100: read in place
    "permuted_3d": lambda: torch.randn(2, 4, 48).transpose(0, 1),  # rows do not flatten to a view
}


@pytest.mark.parametrize("params", [{"BLOCK_N": 64, "num_warps": 2, "single_pass": True},
                                    {"BLOCK_N": 32, "num_warps": 1, "single_pass": False}], ids=["single", "looped"])
@pytest.mark.parametrize("make_x", NON_CONTIGUOUS.values(), ids=NON_CONTIGUOUS.keys())
def test_non_contiguous_input(load_candidate, assert_close, make_x, params):
    torch.manual_seed(6)
    x = make_x()
    summary = region("layer_norm", 48, residual=True)
    # a 2-D residual in column-major layout too: the wrapper must copy it
    residual = torch.randn(x.shape).t().contiguous().t() if x.dim() == 2 else torch.randn(x.shape)
    weight, bias = torch.randn(48), torch.randn(48)
    check_candidate(load_candidate, assert_close, summary, params, [x, residual, weight, bias])


@pytest.mark.parametrize("params", [SINGLE, LOOPED], ids=["single", "looped"])
@pytest.mark.parametrize("dtype, offset, scale", [(torch.float32, 1e4, 5.0), (torch.bfloat16, 0.0, 100.0)],
                         ids=["fp32_offset_1e4", "bf16_spread_100"])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_softmax_large_magnitudes(load_candidate, assert_close, dtype, offset, scale, params, kind):
    # exp(1e4) and exp(300) overflow fp32: only the max-subtracted form gets these right (and
    # log_softmax's far-below-max entries: log of an underflowed exp would be -inf)
    summary = region(kind, 200, str(dtype).removeprefix("torch."))
    x = (torch.randn(3, 200, generator=torch.Generator().manual_seed(7)) * scale + offset).to(dtype)
    check_candidate(load_candidate, assert_close, summary, params, [x])


@pytest.mark.parametrize("params", [SINGLE, LOOPED], ids=["single", "looped"])
def test_residual_normalises_h_as_stored(load_candidate, assert_close, params):
    # h = 1000 + noise below fp16's ulp there (0.5): the rounding *is* the signal layer_norm
    # sees, so normalising the unrounded fp32 sum would give a different answer than torch.
    # (fp16, because the interpreter rounds fp16 like torch but truncates bf16.)
    summary = region("layer_norm", 200, "float16", residual=True)
    generator = torch.Generator().manual_seed(8)
    x = torch.full((3, 200), 1000.0, dtype=torch.float16)
    residual = (torch.rand(3, 200, generator=generator) * 0.5).half()
    weight, bias = torch.ones(200, dtype=torch.float16), torch.zeros(200, dtype=torch.float16)
    x, residual, weight, bias = on_test_device([x, residual, weight, bias])
    y, h = load_candidate(FAMILY.render(summary, params)).run(x, residual, weight, bias)
    assert torch.equal(h, x + residual)
    assert_close(y, torch_reference(summary, x + residual))


def test_empty_rows(load_candidate):
    summary = region("rms_norm", 16, residual=True)
    module = load_candidate(FAMILY.render(summary, {"BLOCK_N": 16, "num_warps": 1, "single_pass": True}))
    y, h = module.run(*on_test_device([torch.randn(0, 16), torch.randn(0, 16), torch.randn(16)]))
    assert y.shape == h.shape == (0, 16)


def test_check_rejects_illegal_points():
    summary = region("rms_norm", 300)
    reject = lambda **params: FAMILY.check(summary, params, H200)
    assert reject(BLOCK_N=256, num_warps=4, single_pass=True)  # row does not fit
    assert reject(BLOCK_N=512, num_warps=4, single_pass=False)  # looping over one chunk
    assert reject(BLOCK_N=128, num_warps=8, single_pass=False)  # idle warps
    assert reject(BLOCK_N=32768, num_warps=8, single_pass=True)  # too big for registers
    assert reject(BLOCK_N=512, num_warps=4, single_pass=True) is None
    long_rows = region("softmax", 8192)
    assert FAMILY.check(long_rows, {"BLOCK_N": 8192, "num_warps": 1, "single_pass": True}, H200)  # 256/thread


def test_param_space_follows_the_row_length():
    assert FAMILY.legal_points(region("softmax", 7), H200) == [{"BLOCK_N": 8, "num_warps": 1, "single_pass": True}]
    vocab = FAMILY.param_space(region("softmax", 50000), H200)
    assert vocab["BLOCK_N"] == list(LOOPED_BLOCKS)  # no single-pass block holds 50000 columns
    symbolic = RegionSummary("s", "row_reduction", (TensorSpec(("R", "S"), "float32"),),
                             (TensorSpec(("R", "S"), "float32"),), attrs=region("softmax", 1).attrs,
                             dims={"R": (1, 8), "S": (1, 300)})
    assert max(FAMILY.param_space(symbolic, H200)["BLOCK_N"]) == 512


def test_matches_only_what_the_kernel_handles():
    assert FAMILY.matches(region("layer_norm", 64, residual=True))
    assert not FAMILY.matches(region("softmax", 64, has_weight=True))  # torch softmax has no weight
    assert not FAMILY.matches(region("rms_norm", 64, has_bias=True))  # nor rms_norm a bias
    weight_missing = region("rms_norm", 64)
    assert not FAMILY.matches(dataclasses.replace(weight_missing, inputs=weight_missing.inputs[:1]))
    unbounded = RegionSummary("u", "row_reduction", (TensorSpec(("R", "S"), "float32"),),
                              (TensorSpec(("R", "S"), "float32"),), attrs=region("softmax", 1).attrs)
    assert not FAMILY.matches(unbounded)  # a single-pass block needs the longest row


def test_kernels_compile_for_sm90(compile_for_sm90):
    jobs = []
    for kind in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
        for residual in (False, True):
            summary = region(kind, 200, "bfloat16", residual=residual)
            inputs = make_inputs(summary, torch.randn(3, 200, dtype=torch.bfloat16))
            for variant, params in (("single", SINGLE), ("looped", LOOPED)):
                label = f"{kind}_{variant}_{'residual' if residual else 'plain'}"
                jobs.append((label, FAMILY.render(summary, params), inputs, "row_reduction_kernel"))
    compile_for_sm90(jobs)


@pytest.mark.parametrize("name, summary, params", [
    ("row_reduction_rms_norm_residual_single.py", region("rms_norm", 4096, "bfloat16", residual=True),
     {"BLOCK_N": 4096, "num_warps": 8, "single_pass": True}),
    ("row_reduction_softmax_looped.py", region("softmax", 50000, "float32"),
     {"BLOCK_N": 1024, "num_warps": 4, "single_pass": False}),
])
def test_golden_rendering(golden, name, summary, params):
    golden(name, FAMILY.render(summary, params))
