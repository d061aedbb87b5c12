"""raise-patterns recognises the rotate-half RoPE (and only it); fuse-rope makes it a region."""

import pytest
import torch

from pass_helpers import kernel_families, run_pipeline
from test_raise_patterns import Lambda

from coopt.ir.dialect import RopeOp

x = torch.randn(1, 4, 3, 8)
cos, sin = torch.randn(3, 8), torch.randn(3, 8)


def rotate_half(t):
    return torch.cat((-t[..., t.shape[-1] // 2:], t[..., : t.shape[-1] // 2]), dim=-1)


def ropes(module):
    return [op for op in module.walk() if isinstance(op, RopeOp)]


@pytest.mark.parametrize("form", [
    lambda m, x, c, s: x * c + rotate_half(x) * s,
    lambda m, x, c, s: rotate_half(x) * s + c * x,  # operands in the other order
])
def test_rotate_half_rope_becomes_one_op_and_one_region(form):
    module, counters = run_pipeline(Lambda(form), [x, cos, sin], "raise-patterns")
    (rope,) = ropes(module)
    assert counters["raise.rope"] == 1
    # the slices, neg and cat are gone (dead after the rewrite)
    assert not [op for op in module.walk() if getattr(op, "target", None) and op.target.data == "aten.cat.default"]
    module, _ = run_pipeline(Lambda(form), [x, cos, sin], "raise-patterns,fuse-rope")
    assert kernel_families(module) == ["rope"]


@pytest.mark.parametrize("wrong", [
    # halves swapped without the negation on the right half
    lambda m, x, c, s: x * c + torch.cat((x[..., 4:], -x[..., :4]), -1) * s,
    # rotation of another tensor than the one multiplied by cos
    lambda m, x, c, s: x * c + rotate_half(x * 2.0) * s,
    # split off the middle, not the halves
    lambda m, x, c, s: x * c + torch.cat((-x[..., 3:], x[..., :3]), -1)[..., :8] * s,
])
def test_lookalikes_are_not_raised(wrong):
    module, counters = run_pipeline(Lambda(wrong), [x, cos, sin], "raise-patterns")
    assert not ropes(module) and counters["raise.rope"] == 0
