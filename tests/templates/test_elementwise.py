"""The elementwise family: every legal point runs and matches torch under Triton's interpreter.

Fixtures (load_candidate, assert_close, compile_for_sm90, golden) live in conftest.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from coopt.ir.region import ELEMENTWISE_FNS, RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.elementwise import BLOCKS, NUM_WARPS, ElementwiseFamily
from coopt.templates.ewprogram import render_program
from template_helpers import on_test_device

# Masked-off lanes compute on padding (log(0), exp(inf - inf)) and numpy warns about it under the
# interpreter; those lanes are never stored.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

FAMILY = ElementwiseFamily()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def region(input_shapes, program, outputs, dtype="float32", output_dtypes=None, out_shape=None, dims=None):
    """An elementwise RegionSummary; the output shape defaults to the broadcast of the inputs."""
    if out_shape is None:
        out_shape = tuple(torch.broadcast_shapes(*input_shapes))
    output_dtypes = output_dtypes or [dtype] * len(outputs)
    return RegionSummary(
        name="ew",
        family="elementwise",
        inputs=tuple(TensorSpec(tuple(shape), dtype) for shape in input_shapes),
        outputs=tuple(TensorSpec(tuple(out_shape), d) for d in output_dtypes),
        attrs={"program": program, "outputs": outputs},
        dims=dims or {},
    )


def torch_reference(summary, inputs):
    """The region's program in eager torch (fp32), via ewprogram's torch dialect."""
    names = {f"in{i}": f"in{i}" for i in range(len(inputs))}
    lines = render_program(summary.attrs["program"], names, dialect="torch")
    scope = {"torch": torch, **{f"in{i}": x.float() for i, x in enumerate(inputs)}}
    exec("\n".join(lines), scope)  # noqa: S102 - test reference built from our own table
    shape = torch.broadcast_shapes(*(x.shape for x in inputs))
    return [torch.broadcast_to(scope[names[out]], shape) for out in summary.attrs["outputs"]]


def run_candidate(load_candidate, summary, params, inputs, stem="candidate"):
    module = load_candidate(FAMILY.render(summary, params), stem)
    return module.run(*on_test_device(inputs))


BIAS_GELU = region(
    [("B", 7, 33), (33,)],
    [["h", "add", ["in0", "in1"]], ["y", "gelu", ["h"]]],
    ["y"],
    dtype="bfloat16",
    out_shape=("B", 7, 33),
    dims={"B": (1, 64)},  # large enough that every BLOCK stays in the space
)
# two outputs of different dtypes from a scalar, a column and a full tensor
SCALE_SHIFT = region(
    [("B", 5, 4), (), (5, 1)],
    [["scaled", "mul", ["in0", "in1"]], ["y", "add", ["scaled", "in2"]], ["z", "silu", ["y"]]],
    ["z", "y"],
    output_dtypes=["float16", "float32"],
    dtype="float32",
    out_shape=("B", 5, 4),
    dims={"B": (1, 1024)},
)


def _points(summary):
    points = FAMILY.legal_points(summary, H200)
    # every knob value must be exercised
    assert {p["BLOCK"] for p in points} == set(BLOCKS)
    assert {p["num_warps"] for p in points} == set(NUM_WARPS)
    return points


@pytest.mark.parametrize("params", _points(BIAS_GELU), ids=lambda p: f"B{p['BLOCK']}w{p['num_warps']}")
def test_every_point_bias_gelu(load_candidate, assert_close, params):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 33, dtype=torch.bfloat16)
    bias = torch.randn(33, dtype=torch.bfloat16)
    (y,) = run_candidate(load_candidate, BIAS_GELU, params, [x, bias])
    assert y.dtype == torch.bfloat16
    assert_close(y, F.gelu(x.float() + bias.float()))


@pytest.mark.parametrize("params", _points(SCALE_SHIFT), ids=lambda p: f"B{p['BLOCK']}w{p['num_warps']}")
def test_every_point_multiple_outputs(load_candidate, assert_close, params):
    torch.manual_seed(1)
    x, scale, shift = torch.randn(2, 5, 4), torch.tensor(0.5), torch.randn(5, 1)
    z, y = run_candidate(load_candidate, SCALE_SHIFT, params, [x, scale, shift])
    assert (z.dtype, y.dtype) == (torch.float16, torch.float32)
    assert_close(y, x * 0.5 + shift)
    assert_close(z, F.silu(x * 0.5 + shift))


BROADCASTS = {
    "row_vector": [(4, 6, 10), (10,)],
    "column": [(4, 6, 10), (6, 1)],
    "scalar_0d": [(4, 6, 10), ()],
    "both_sides": [(4, 1, 10), (6, 1)],  # output (4, 6, 10) is larger than either input
    "rank4": [(2, 3, 4, 5), (3, 1, 5)],
    "all_0d": [(), ()],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", BROADCASTS.values(), ids=BROADCASTS.keys())
def test_broadcasting(load_candidate, assert_close, shapes, dtype):
    summary = region(shapes, [["y", "mul", ["in0", "in1"]], ["z", "sub", ["y", 1.5]]], ["z"],
                     dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(2)
    a, b = (torch.randn(s, dtype=dtype) for s in shapes)
    (z,) = run_candidate(load_candidate, summary, {"BLOCK": 128, "num_warps": 4}, [a, b])
    assert z.shape == torch.broadcast_shapes(a.shape, b.shape)
    assert_close(z, a.float() * b.float() - 1.5)


def test_non_contiguous_inputs(load_candidate, assert_close):
    torch.manual_seed(3)
    transposed = torch.randn(6, 5).t()  # (5, 6), strides (1, 5)
    strided = torch.randn(5, 12)[:, ::2]  # (5, 6), strides (12, 2)
    expanded = torch.randn(5, 1).expand(5, 6)  # stride 0 already in the input
    summary = region([(5, 6)] * 3, [["s", "add", ["in0", "in1"]], ["y", "mul", ["s", "in2"]]], ["y"])
    (y,) = run_candidate(load_candidate, summary, {"BLOCK": 256, "num_warps": 2}, [transposed, strided, expanded])
    assert_close(y, (transposed + strided) * expanded)


@pytest.mark.parametrize("numel", [1, 7, 33, 100])
def test_odd_sizes_cross_block_edges(load_candidate, assert_close, numel):
    summary = region([(numel,), (numel,)], [["y", "maximum", ["in0", "in1"]]], ["y"], dtype="float16")
    torch.manual_seed(4)
    a, b = torch.randn(numel, dtype=torch.float16), torch.randn(numel, dtype=torch.float16)
    # numel not a multiple of BLOCK: the block is partly masked (test_every_point_* crosses blocks)
    (y,) = run_candidate(load_candidate, summary, {"BLOCK": 128, "num_warps": 1}, [a, b])
    assert_close(y, torch.maximum(a, b))


def test_empty_output_launches_nothing(load_candidate):
    summary = region([(0, 4), (4,)], [["y", "add", ["in0", "in1"]]], ["y"])
    (y,) = run_candidate(load_candidate, summary, {"BLOCK": 128, "num_warps": 1}, [torch.randn(0, 4), torch.randn(4)])
    assert y.shape == (0, 4)


def test_output_is_a_broadcast_input(load_candidate, assert_close):
    # outputs may name inputs directly: a cast-and-broadcast copy
    summary = region([(3, 4), (4,)], [["y", "add", ["in0", "in1"]]], ["y", "in1"], dtype="bfloat16")
    a, b = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16)
    y, copied = run_candidate(load_candidate, summary, {"BLOCK": 128, "num_warps": 1}, [a, b])
    assert_close(copied, b.float().expand(3, 4))


# fns whose domain is positive reals get positive inputs
_POSITIVE_DOMAIN = {"log", "sqrt", "rsqrt", "pow"}


@pytest.mark.parametrize("fn", sorted(ELEMENTWISE_FNS))
def test_every_fn_matches_torch_dialect(load_candidate, assert_close, fn):
    args = ["in0", "in1", "in2"][: ELEMENTWISE_FNS[fn]]
    summary = region([(3, 11)] * len(args), [["y", fn, args]], ["y"])
    torch.manual_seed(5)
    a, b, c = torch.randn(3, 11) * 3, torch.randn(3, 11), torch.randn(3, 11)
    if fn in _POSITIVE_DOMAIN:
        a = a.abs() + 0.1
    if fn == "where":  # the condition: 0 / 1, as a bool input loads
        a = (a > 0).float()
    if fn.endswith("_to_f32") and fn != "to_f32":  # a widening's operand is a 16-bit value in eager
        a = a.to(torch.bfloat16 if fn.startswith("bf16") else torch.float16).float()
    inputs = [a, b, c][: len(args)]
    (y,) = run_candidate(load_candidate, summary, {"BLOCK": 128, "num_warps": 1}, inputs)
    if fn == "to_bf16" and not torch.cuda.is_available():  # the interpreter truncates to bf16 (one ulp)
        torch.testing.assert_close(y.float().cpu(), torch_reference(summary, inputs)[0].float(), rtol=2**-7, atol=0)
    else:
        assert_close(y, torch_reference(summary, inputs)[0])


@pytest.mark.parametrize("fn, dtype", [("to_bf16", torch.bfloat16), ("to_f16", torch.float16),
                                       ("bf16_to_f32", torch.bfloat16), ("f16_to_f32", torch.float16)])
def test_a_cast_rounds_and_the_program_goes_on_in_fp32(load_candidate, fn, dtype):
    # 1 + 2^-12 is no bf16 or fp16 value: rounded it is 1, so (x.to(dtype) - 1) * 2^12 is 0 where
    # the unrounded value gives 1; the result stays fp32, as the region's output says
    summary = region([(4,)], [["t", fn, ["in0"]], ["u", "sub", ["t", 1.0]], ["y", "mul", ["u", 4096.0]]], ["y"])
    x = torch.tensor([1 + 2**-12, 2.0, -3.0, 1 + 2**-3])
    (y,) = run_candidate(load_candidate, summary, {"BLOCK": 128, "num_warps": 1}, [x])
    expected = (x.to(dtype).float() - 1) * 4096
    torch.testing.assert_close(y.cpu(), expected, rtol=0, atol=0)
    assert y.dtype == torch.float32 and expected[0] == 0 and expected[3] == 512


def test_check_rejects_illegal_points():
    assert FAMILY.check(BIAS_GELU, {"BLOCK": 128, "num_warps": 8}, H200) is not None  # idle threads
    assert FAMILY.check(BIAS_GELU, {"BLOCK": 4096, "num_warps": 1}, H200) is not None  # 128 per thread
    assert FAMILY.check(BIAS_GELU, {"BLOCK": 256, "num_warps": 8}, H200) is None


def test_space_drops_blocks_beyond_the_output():
    tiny = region([(10, 10), (10,)], [["y", "add", ["in0", "in1"]]], ["y"])
    assert FAMILY.param_space(tiny, H200)["BLOCK"] == [128]
    unbounded = region([("s", 10)], [["y", "relu", ["in0"]]], ["y"], out_shape=("s", 10))
    assert FAMILY.param_space(unbounded, H200)["BLOCK"] == list(BLOCKS)


def test_matches_only_what_the_kernel_handles():
    assert FAMILY.matches(BIAS_GELU)
    rank5 = region([(1, 2, 3, 4, 5)], [["y", "relu", ["in0"]]], ["y"])
    assert not FAMILY.matches(rank5)
    int_output = region([(4,)], [["y", "relu", ["in0"]]], ["y"], output_dtypes=["int32"])
    assert not FAMILY.matches(int_output)


def test_kernels_compile_for_sm90(compile_for_sm90):
    bias = torch.randn(3, 7, 33, dtype=torch.bfloat16), torch.randn(33, dtype=torch.bfloat16)
    flat = torch.randn(3, 7, 33, dtype=torch.bfloat16), torch.randn(3, 7, 33, dtype=torch.bfloat16)
    scale_shift = torch.randn(2, 5, 4), torch.tensor(0.5), torch.randn(5, 1)
    compile_for_sm90([
        ("bias_gelu_broadcast", FAMILY.render(BIAS_GELU, {"BLOCK": 1024, "num_warps": 4}), bias, "elementwise_kernel"),
        ("bias_gelu_flat", FAMILY.render(BIAS_GELU, {"BLOCK": 4096, "num_warps": 8}), flat, "elementwise_kernel"),
        ("scale_shift", FAMILY.render(SCALE_SHIFT, {"BLOCK": 128, "num_warps": 1}), scale_shift, "elementwise_kernel"),
        # the int64 indices a long prompt's strided inputs take (forced here on small ones)
        ("bias_gelu_broadcast_int64", FAMILY.render(BIAS_GELU, {"BLOCK": 1024, "num_warps": 4})
         + "\n_index_64 = lambda *views: True\n", bias, "elementwise_kernel"),
    ])


def test_golden_rendering(golden):
    golden("elementwise_scale_shift.py", FAMILY.render(SCALE_SHIFT, {"BLOCK": 1024, "num_warps": 4}))


def test_programmatic_dependent_launch_only_on_hopper_gpus(load_candidate, monkeypatch):
    """Every template shares the PDL switch (triton/_pdl.j2): asked for (COOPT_PDL=1), on an
    sm_90+ GPU kernels are launched with launch_pdl and wait for the previous kernel first (the
    sm_90 compile tests check the wait); in Triton's interpreter, which has no such launch, it
    must be off."""
    monkeypatch.setenv("COOPT_PDL", "1")
    summary = region([(4, 8)], [["y", "silu", ["in0"]]], ["y"])
    # a stem of its own: a module is cached by content, and PDL is decided at its import (an
    # earlier test's import of the same source without COOPT_PDL would be handed back)
    module = load_candidate(FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0]), stem="pdl_asked")
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    assert module.PDL is hopper and module.PDL_LAUNCH == ({"launch_pdl": True} if hopper else {})
    (y,) = module.run(on_test_device([torch.ones(4, 8)])[0])
    assert torch.allclose(y.float().cpu(), torch.nn.functional.silu(torch.ones(4, 8)))


@pytest.mark.parametrize("setting, launched", [
    (None, False), ("0", False), ("1", True), ("elementwise", True), ("kv_write,elementwise", True),
    ("decode_attention,gemv", False), ("elementwise_x", False),
])
def test_pdl_is_opt_in_per_kernel_kind(load_candidate, monkeypatch, setting, launched):
    """COOPT_PDL=1 launches every kernel with PDL; a comma list of kinds only the kernels of
    those kinds (bench/RESULTS.md session 12 measured the decode step's boundaries one kind at a
    time). Decided when the module is imported, so it is imported here as on an sm_90 GPU."""
    if setting is None:
        monkeypatch.delenv("COOPT_PDL", raising=False)
    else:
        monkeypatch.setenv("COOPT_PDL", setting)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    summary = region([(4, 8)], [["y", "silu", ["in0"]]], ["y"])
    module = load_candidate(FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0]), stem=f"pdl_{setting}")
    assert module.PDL is launched and module.PDL_LAUNCH == ({"launch_pdl": True} if launched else {})


def test_offsets_past_2_31_switch_the_kernel_to_int64_indices(load_candidate, assert_close):
    """The SwiGLU of a 131072-token prompt reads slices of a [131072, 28672] gate|up output:
    offsets up to 3.8e9 while its own output has fewer than 2**31 elements (session 8: int32
    indices read out of bounds on the H200). The decision is checked on the shapes; the int64
    path itself on small inputs (forced), against the same torch result as the int32 one."""
    summary = region([(5, 6)] * 3, [["s", "add", ["in0", "in1"]], ["y", "mul", ["s", "in2"]]], ["y"])
    module = load_candidate(FAMILY.render(summary, {"BLOCK": 128, "num_warps": 2}), "index64")
    rows, half = 131072, 14336
    gate_strides = (0, 0, 2 * half, 1)  # gate = gate_up[:, :half] of a [rows, 2 * half] tensor
    assert module._index_64((rows, half), gate_strides)
    assert not module._index_64((rows // 2, half), gate_strides)  # 1.9e9: int32 holds it
    assert module._index_64((2**16, 2**15), (0, 0, 2**15, 1))  # the output itself: 2**31 elements
    assert not module._index_64((rows, half), (0, 0, 0, 1))  # a broadcast row adds nothing
    torch.manual_seed(3)
    a, b, c = torch.randn(5, 12)[:, ::2], torch.randn(6, 5).t(), torch.randn(5, 1).expand(5, 6)
    narrow = module.run(*on_test_device([a, b, c]))[0]
    module._index_64 = lambda *views: True
    (wide,) = module.run(*on_test_device([a, b, c]))
    assert_close(wide, (a + b) * c)
    assert torch.equal(wide, narrow)


@pytest.mark.parametrize("fn", ["maximum", "minimum", "relu", "hardsigmoid", "hardswish", "clamp"])
def test_nan_in_nan_out_as_torch(load_candidate, fn):
    # Triton's maximum / minimum return the non-NaN operand unless told otherwise; torch does not
    program = ([["t0", "maximum", ["in0", -0.5]], ["y", "minimum", ["t0", 0.5]]] if fn == "clamp"
               else [["y", fn, ["in0", "in1"][: ELEMENTWISE_FNS[fn]]]])
    summary = region([(2, 4), (2, 4)], program, ["y"])
    a = torch.tensor([[float("nan"), -1.0, 0.25, 9.0], [2.0, float("nan"), -7.0, 0.0]])
    b = torch.tensor([[1.0, float("nan"), 0.0, -1.0], [float("nan"), 3.0, 1.0, 0.0]])
    (y,) = run_candidate(load_candidate, summary, {"BLOCK": 128, "num_warps": 1}, [a, b])
    expected = torch_reference(summary, [a, b])[0]
    y = y.cpu()
    assert torch.equal(y.isnan(), expected.isnan()) and expected.isnan().any()
    torch.testing.assert_close(y, expected, equal_nan=True)


def test_torch_form_of_a_number_bound_keeps_the_tensor_dtype():
    # torch.maximum takes tensors only, and a 0-dim float32 bound would promote a 0-dim bf16 x
    names = {"in0": "x"}
    lines = render_program([["t0", "maximum", ["in0", 0.1]], ["y", "minimum", [0.2, "t0"]]], names, dialect="torch")
    x = torch.tensor([0.5, float("nan")], dtype=torch.bfloat16)
    for value in (x[0], x):  # 0-dim and 1-dim
        scope = {"torch": torch, "x": value}
        exec("\n".join(lines), scope)  # noqa: S102 - our own table's lines
        y = scope[names["y"]]
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, torch.clamp(value, 0.1, 0.2), equal_nan=True, rtol=0, atol=0)


def test_where_reads_a_bool_condition_input(load_candidate):
    summary = region([(2, 8), (8,)], [["y", "where", ["in0", "in1", 0.0]]], ["y"])
    summary = dataclasses.replace(summary, inputs=(TensorSpec((2, 8), "bool"), TensorSpec((8,), "float32")))
    mask, x = torch.rand(2, 8) > 0.5, torch.randn(8)
    (y,) = run_candidate(load_candidate, summary, {"BLOCK": 128, "num_warps": 1}, [mask, x])
    torch.testing.assert_close(y.cpu(), torch.where(mask, x, 0.0), rtol=0, atol=0)
