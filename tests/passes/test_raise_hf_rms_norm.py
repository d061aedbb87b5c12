"""transformers' RMSNorm for 16-bit models (LlamaRMSNorm; Mistral's and Qwen2's are the same
code): statistics and scaling in fp32 between two casts, then the weight in the model's dtype.
raise-patterns makes it one coopt.rms_norm on the 16-bit input, so it becomes a GEMV's norm
prologue like F.rms_norm; forms that are not that stay as they were."""

from __future__ import annotations

import pytest
import torch
from pass_helpers import beside_eager, kernel_families, run_pipeline

import coopt
from coopt.ir.dialect import RMSNormOp


class HFRMSNorm(torch.nn.Module):
    def __init__(self, size: int, weight_dtype=None, back_to=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=weight_dtype) + 0.1 * torch.randn(size, dtype=weight_dtype))
        self.eps, self.back_to = 1e-6, back_to

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(self.back_to or input_dtype)


class NormThenLinear(torch.nn.Module):
    def __init__(self, dtype=torch.bfloat16, **norm):
        super().__init__()
        torch.manual_seed(0)
        self.norm = HFRMSNorm(64, weight_dtype=norm.pop("weight_dtype", dtype), **norm)
        self.proj = torch.nn.Linear(64, 96, bias=False, dtype=dtype)

    def forward(self, x):
        return self.proj(self.norm(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fp32_statistics_form_is_one_rms_norm_of_the_16_bit_input(dtype):
    x = torch.randn(4, 64, dtype=dtype)
    module, counters = run_pipeline(NormThenLinear(dtype), [x], "raise-patterns")
    assert counters["raise.rms_norm.explicit.fp32_statistics"] == 1
    (norm,) = [op for op in module.walk() if isinstance(op, RMSNormOp)]
    assert norm.x is module.body.block.first_op.body.block.args[0]  # the input itself, not its fp32 copy
    assert norm.results[0].type == norm.x.type
    assert not [op for op in module.walk() if getattr(op, "target", None) and op.target.data == "aten._to_copy.default"]


@pytest.mark.parametrize("norm, why", [
    ({"weight_dtype": torch.float32}, "weight-in-fp32"),  # the product promotes to fp32: not the model dtype's norm
    ({"back_to": torch.float16}, "cast-to-another-dtype"),  # bf16 in, f16 out
], ids=lambda v: v if isinstance(v, str) else "")
def test_other_casts_are_left_alone(norm, why):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    model = NormThenLinear(torch.bfloat16, **norm)
    if why == "cast-to-another-dtype":
        model.proj = model.proj.to(torch.float16)
    _, counters = run_pipeline(model, [x], "raise-patterns")
    assert not counters.get("raise.rms_norm.explicit.fp32_statistics"), why


def test_it_builds_into_the_gemv_with_a_norm_prologue_and_matches_the_model(tmp_path):
    model, x = NormThenLinear(torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    result = coopt.Pipeline(top_k=1).build(model, (x,), tmp_path / "out")
    assert [r.summary.family for r in result.regions] == ["matmul_epilogue"]
    assert result.regions[0].summary.attrs["prologue"]["kind"] == "rms_norm"
    assert "Outside every region" not in (tmp_path / "out" / "report.md").read_text()  # no cast left to PyTorch
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 3
    with torch.no_grad():
        expected = model(x).float()
        # one bf16 rounding apart at most in the norm (the raised norm rounds once, the model twice)
        torch.testing.assert_close(beside_eager(coopt.load(tmp_path / "out"))(x).float(), expected, rtol=2e-2, atol=2e-2)


def test_kernel_families_after_the_default_pipeline():
    module, _ = run_pipeline(NormThenLinear(torch.bfloat16), [torch.randn(4, 64, dtype=torch.bfloat16)])
    assert kernel_families(module) == ["matmul_epilogue"]


class GemmaRMSNorm(torch.nn.Module):
    """transformers' GemmaRMSNorm: the weight (1 + w) applied in fp32, one cast back at the end."""

    def __init__(self, size: int, back_to_input: bool = True):
        super().__init__()
        self.weight = torch.nn.Parameter(0.1 * torch.randn(size))
        self.eps, self.back_to_input = 1e-6, back_to_input

    def forward(self, x):
        h = x.float()
        output = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x) if self.back_to_input else output.to(torch.float16)


class GemmaNormThenLinear(torch.nn.Module):
    def __init__(self, dtype=torch.bfloat16, **norm):
        super().__init__()
        torch.manual_seed(0)
        self.norm = GemmaRMSNorm(64, **norm)
        self.proj = torch.nn.Linear(64, 96, bias=False, dtype=dtype)

    def forward(self, x):
        return self.proj(self.norm(x))


GEMMA_PASSES = "simplify-aten,fold-constants,raise-patterns"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemmas_form_is_one_rms_norm_of_the_16_bit_input(tmp_path, dtype):
    x = torch.randn(4, 64, dtype=dtype)
    model = GemmaNormThenLinear(dtype)
    module, counters = run_pipeline(model, [x], GEMMA_PASSES)
    assert counters["fold.constants"] == 1 and counters["simplify.type_as"] == 1  # (1 + w), type_as
    assert counters["raise.rms_norm.narrowed"] == 1
    (norm,) = [op for op in module.walk() if isinstance(op, RMSNormOp)]
    assert norm.x is module.body.block.first_op.body.block.args[0] and norm.results[0].type == norm.x.type
    assert str(norm.weight.type.element_type) == "f32"  # the folded (1 + w), kept in fp32
    # exact: F.rms_norm of a 16-bit input with an fp32 weight is that code's numerics
    coopt.Pipeline(passes=GEMMA_PASSES, top_k=1).build(model, (x,), tmp_path / "out")
    built = coopt.load(tmp_path / "out")  # no kernels: the raised norm as F.rms_norm, on the build's device
    device = next(iter(built.state_dict().values())).device
    x = torch.randn(4, 64, dtype=dtype, device=device) * 3
    with torch.no_grad():
        assert torch.equal(built(x), model.to(device)(x))


def test_gemmas_norm_cast_to_another_dtype_stays():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    _, counters = run_pipeline(GemmaNormThenLinear(torch.float16, back_to_input=False), [x], GEMMA_PASSES)
    assert counters["raise.rms_norm.explicit"] == 1 and not counters.get("raise.rms_norm.narrowed")


def test_gemmas_norm_builds_into_the_gemv_prologue(tmp_path):
    model, x = GemmaNormThenLinear(torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    result = coopt.Pipeline(top_k=1).build(model, (x,), tmp_path / "out")
    assert [r.summary.family for r in result.regions] == ["matmul_epilogue"]
    assert result.regions[0].summary.attrs["prologue"]["kind"] == "rms_norm"
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 3
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(coopt.load(tmp_path / "out"))(x).float(), model(x).float(),
                                   rtol=2e-2, atol=2e-2)
