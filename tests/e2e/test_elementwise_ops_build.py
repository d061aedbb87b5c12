"""The elementwise fns beyond the arithmetic (clamp's forms, erf, cos) build into one generated
kernel that matches the model (so do rsub, hardswish, hardsigmoid), with nothing left to PyTorch between kernels: a tree of eight
elementwise ops, its branches meeting (fuse-elementwise grows through producers too)."""

import pytest
import torch
import torch.nn.functional as F
from built_calls import beside_eager, pin_verified_kernels

import coopt


class Activations(torch.nn.Module):
    def forward(self, x, angles):
        return (x.clamp(max=0.2) + F.relu6(x)) * torch.erf(x) + angles.cos()


class HardActivations(torch.nn.Module):
    def forward(self, x, y):
        return F.hardswish(1 - x) + F.hardsigmoid(y) * (2 - y)


@pytest.mark.parametrize("model", [Activations(), HardActivations()], ids=["clamp-erf-cos", "rsub-hard"])
def test_the_fns_build_into_one_kernel(tmp_path, model):
    inputs = (torch.randn(4, 16) * 4, torch.randn(4, 16) * 1000)  # angles as large as a rotary table's
    result = coopt.Pipeline(top_k=1).build(model, inputs, tmp_path / "out")
    assert [r.summary.family for r in result.regions] == ["elementwise"]
    pin_verified_kernels(tmp_path / "out", result)  # (a GPU's measured selection may keep ATen here)
    assert result.regions[0].selected != "reference"
    built = coopt.load(tmp_path / "out")
    x, angles = torch.randn(4, 16) * 4, torch.randn(4, 16) * 1000
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(built)(x, angles), model(x, angles), rtol=1e-4, atol=1e-4)
    assert "Outside every region" not in (tmp_path / "out" / "report.md").read_text()


class ReadBetween(torch.nn.Module):
    """sin's result is read by a sum that sits between it and the next elementwise op: the two
    cannot share a kernel (the sum needs sin's output first), the rest can."""

    def forward(self, x):
        a = x.sin()
        s = a.sum(-1, keepdim=True)
        return (a * 2 + s).cos()


def test_an_op_reading_between_keeps_the_groups_apart(tmp_path):
    model, x = ReadBetween(), torch.randn(4, 16)
    result = coopt.Pipeline(top_k=1).build(model, (x,), tmp_path / "out")
    programs = [[fn for _, fn, _ in r.summary.attrs["program"]] for r in result.regions if r.summary.family == "elementwise"]
    assert sorted(programs) == [["mul", "add", "cos"], ["sin"]]
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(coopt.load(tmp_path / "out"))(x), model(x), rtol=1e-4, atol=1e-4)


class Masked(torch.nn.Module):
    """A mask made outside (a comparison stays ATen) choosing between two elementwise branches."""

    def forward(self, x, keep):
        return torch.where(keep, x * 2, x.sin()) + torch.where(x > 0.5, x, 0.0)


def test_where_with_a_bool_mask_shares_the_kernel(tmp_path):
    model = Masked()
    result = coopt.Pipeline(top_k=1).build(model, (torch.randn(4, 16), torch.rand(4, 16) > 0.5), tmp_path / "out")
    (region,) = [r for r in result.regions if r.summary.family == "elementwise"]
    pin_verified_kernels(tmp_path / "out", result)
    assert region.selected != "reference"
    assert sorted(fn for _, fn, _ in region.summary.attrs["program"]) == ["add", "mul", "sin", "where", "where"]
    assert "bool" in [spec.dtype for spec in region.summary.inputs]
    x, keep = torch.randn(4, 16), torch.rand(4, 16) > 0.5
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(coopt.load(tmp_path / "out"))(x, keep), model(x, keep), rtol=1e-5, atol=1e-5)


class RotaryTables(torch.nn.Module):
    """transformers' rotary tables: cos and sin of the same angles, each cast to bf16."""

    def forward(self, positions, inv_freq):
        angles = positions[:, None] * inv_freq[None, :]
        return angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


def test_cos_and_sin_of_one_value_build_into_one_kernel(tmp_path):
    model, inputs = RotaryTables(), (torch.arange(64).float(), 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
    result = coopt.Pipeline(top_k=1).build(model, inputs, tmp_path / "out")
    assert [r.summary.family for r in result.regions] == ["elementwise"]
    assert [spec.dtype for spec in result.regions[0].summary.outputs] == ["bfloat16", "bfloat16"]
    positions = torch.arange(64).float() + 4000  # angles far outside [-pi, pi]
    with torch.no_grad():
        for got, want in zip(beside_eager(coopt.load(tmp_path / "out"))(positions, inputs[1]), model(positions, inputs[1])):
            # one bf16 rounding apart at most (Triton's interpreter truncates to bf16)
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-8)
