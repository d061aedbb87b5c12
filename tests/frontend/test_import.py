"""Capture + import: weights by name, fallback ops, state writes, dtypes, symbolic dims."""

import pytest
import torch
import torch.nn.functional as F

from coopt.errors import CaptureError
from coopt.frontend.capture import capture
from coopt.frontend.importer import import_program
from coopt.ir.dialect import AtenOp, FallbackOp, StateWriteOp, WeightOp


def imported(model, *inputs, dynamic_shapes=None):
    return import_program(capture(model.eval(), inputs, dynamic_shapes), inputs)


def ops(result, kind):
    return [op for op in result.module.walk() if isinstance(op, kind)]


class WithCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x):
        self.cache[:2] = x
        return torch.cumprod(self.fc(x), dim=-1)  # cumprod: not in the importer's table


def test_weights_are_named_references_and_unknown_ops_fall_back():
    result = imported(WithCache(), torch.randn(2, 8))
    assert sorted(op.ref.data for op in ops(result, WeightOp)) == ["cache", "fc.bias", "fc.weight"]
    assert result.fallback_targets == {"aten.cumprod.default": 1}
    assert [op.target.data for op in ops(result, FallbackOp)] == ["aten.cumprod.default"]
    (write,) = ops(result, StateWriteOp)
    assert write.ref.data == "cache"
    # nothing is inlined: no op carries tensor data as an attribute
    assert "dense" not in str(result.module)


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bf16"), (torch.float16, "f16"), (torch.float32, "f32")])
def test_tensor_dtypes(dtype, name):
    result = imported(torch.nn.Linear(4, 4).to(dtype), torch.randn(3, 4, dtype=dtype))
    assert f"tensor<3x4x{name}>" in str(result.module)


def test_fp8_tensors_import():
    class Dequant(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float32) * 2

    result = imported(Dequant(), torch.randn(4).to(torch.float8_e4m3fn))
    assert "tensor<4xf8E4M3FN>" in str(result.module)


def test_symbolic_dims_travel_in_the_type():
    batch = torch.export.Dim("batch", min=1, max=64)
    result = imported(torch.nn.Linear(4, 4), torch.randn(3, 4), dynamic_shapes=({0: batch},))
    text = str(result.module)
    assert "tensor<?x4xf32" in text
    table = result.module.attributes["coopt.dims"].data
    assert '"s' in table or "batch" in table


def test_export_failure_names_the_cause_and_suggests_dynamic_shapes():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(3),))
    assert "torch.export failed" in info.value.message
    assert "dynamic_shapes()" in info.value.message
    assert info.value.exit_code == 4


def test_known_ops_stay_aten():
    result = imported(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()), torch.randn(2, 4))
    assert {op.target.data for op in ops(result, AtenOp)} == {"aten.linear.default", "aten.gelu.default"}
    assert not ops(result, FallbackOp)


class SameDtypeCast(torch.nn.Module):
    """`.to(dtype)` of a buffer slice already of that dtype: export asserts its metadata."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(16, 8))

    def forward(self, x):
        return x * self.table[: x.shape[0]].to(x.dtype)


def test_export_metadata_checks_are_dropped_not_fallen_back():
    result = imported(SameDtypeCast(), torch.randn(4, 8))
    captured = capture(SameDtypeCast().eval(), (torch.randn(4, 8),))
    assert "_assert_tensor_metadata" in str(captured.graph)  # what torch.export writes (the premise)
    assert result.fallback_targets == {}
    assert not any("_assert" in op.target.data for op in ops(result, AtenOp) + ops(result, FallbackOp))
