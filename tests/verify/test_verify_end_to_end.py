"""verify_end_to_end: the built model against the original on fresh inputs."""

from __future__ import annotations

import copy

import torch
from torch.export import Dim

from coopt.verify.end_to_end import verify_end_to_end


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return {"y": self.norm(x + self.down(torch.nn.functional.gelu(self.up(x)))),
                "shape": list(x.shape)}


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return TinyMLP().to(dtype).eval()


class ShapeRecorder(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.shapes = inner, []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return self.inner(x)


def test_identical_build_passes_in_fp32_and_bf16():
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(dtype)
        result = verify_end_to_end(model, copy.deepcopy(model),
                                   (torch.randn(4, 16).to(dtype),), trials=2)
        assert result.ok, result.failure
        assert result.examples == 2


def test_perturbed_weight_is_caught():
    model = _model()
    built = copy.deepcopy(model)
    with torch.no_grad():
        built.down.weight[3, 5] += 0.05
    result = verify_end_to_end(model, built, (torch.randn(4, 16),))
    assert not result.ok
    assert result.failure.startswith("output['y']: max abs err")
    assert "[trial 0, input shapes [(4, 16)]]" in result.failure


def test_raising_build_is_a_failure():
    def built(x):
        raise RuntimeError("kernel launch failed")

    result = verify_end_to_end(_model(), built, (torch.randn(4, 16),))
    assert result.failure.startswith("built model raised RuntimeError: kernel launch failed")


def test_dynamic_dims_are_varied_between_trials():
    model = _model()
    built = ShapeRecorder(copy.deepcopy(model))
    batch = Dim("batch", min=1, max=64)
    result = verify_end_to_end(model, built, (torch.randn(6, 16),),
                               dynamic_shapes=({0: batch},), trials=4, seed=3)
    assert result.ok, result.failure
    assert built.shapes[0] == (6, 16) and built.shapes[1] == (1, 16)  # example, then minimum
    assert all(1 <= s[0] <= 6 for s in built.shapes)  # never beyond the example's size
