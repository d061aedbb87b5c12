"""raise-patterns: every recognised pattern counts itself; near-misses are left alone."""

import math

import pytest
import torch
import torch.nn.functional as F

from pass_helpers import run_pipeline

x4 = torch.randn(2, 3, 16)


class Lambda(torch.nn.Module):
    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for name, value in params.items():
            setattr(self, name, torch.nn.Parameter(value))

    def forward(self, *args):
        return self.fn(self, *args)


def raised(model, *inputs):
    _, counters = run_pipeline(model, inputs, "raise-patterns")
    return counters


def test_linear_forms():
    w, b = torch.randn(8, 16), torch.randn(8)
    assert raised(Lambda(lambda m, x: F.linear(x, m.w, m.b), w=w, b=b), x4)["raise.linear"] == 1
    assert raised(Lambda(lambda m, x: x @ m.w.t(), w=w), x4[0])["raise.linear"] == 1
    assert raised(Lambda(lambda m, x: torch.addmm(m.b, x, m.w.t()), w=w, b=b), x4[0])["raise.linear"] == 1
    # batched right operand: not a linear
    assert raised(Lambda(lambda m, x: x @ x.transpose(-1, -2)), x4)["raise.linear"] == 0


def test_gelu_tanh_and_plain_gelu_are_distinct_fns():
    c = raised(Lambda(lambda m, x: F.gelu(x, approximate="tanh") + F.gelu(x)), x4)
    assert c["raise.ew.gelu_tanh"] == 1 and c["raise.ew.gelu"] == 1


def test_norms_and_softmax():
    w, b = torch.randn(16), torch.randn(16)
    c = raised(Lambda(lambda m, x: F.layer_norm(x, (16,), m.w, m.b) + F.rms_norm(x, (16,), m.w) + x.softmax(-1), w=w, b=b), x4)
    assert (c["raise.layer_norm"], c["raise.rms_norm"], c["raise.softmax"]) == (1, 1, 1)
    # softmax over another dim is not a row reduction
    assert raised(Lambda(lambda m, x: x.softmax(1)), x4)["raise.softmax"] == 0


def test_explicit_rms_norm_both_orders():
    w = torch.randn(16)
    fwd = lambda m, x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * m.w
    rev = lambda m, x: m.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert raised(Lambda(fwd, w=w), x4)["raise.rms_norm.explicit"] == 1
    assert raised(Lambda(rev, w=w), x4)["raise.rms_norm.explicit"] == 1
    # mean over the wrong dim: not an RMSNorm
    wrong = lambda m, x: x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * m.w
    assert raised(Lambda(wrong, w=w), x4)["raise.rms_norm.explicit"] == 0


@pytest.mark.parametrize("heads, kv_heads, causal", [(4, 4, True), (4, 2, False), (4, 1, True)])
def test_sdpa_mha_and_gqa(heads, kv_heads, causal):
    q, k = torch.randn(2, heads, 8, 16), torch.randn(2, kv_heads, 8, 16)
    model = Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads))
    assert raised(model, q, k, k.clone())["raise.attention.sdpa"] == 1


def test_sdpa_with_mask_is_not_raised():
    q = torch.randn(1, 2, 4, 8)
    model = Lambda(lambda m, q, mask: F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    assert raised(model, q, torch.zeros(4, 4))["raise.attention.sdpa"] == 0


class ExplicitAttention(torch.nn.Module):
    def __init__(self, masked: bool, mask_values=None):
        super().__init__()
        self.masked = masked
        self.register_buffer("mask", mask_values if mask_values is not None else torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8))

    def forward(self, q, k, v):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if self.masked:
            att = att.masked_fill(self.mask[:, :, :8, :8] == 0, float("-inf"))
        return att.softmax(-1) @ v


def test_explicit_attention_causal_and_plain():
    q = torch.randn(2, 4, 8, 16)
    assert raised(ExplicitAttention(True), q, q, q)["raise.attention.explicit.causal"] == 1
    assert raised(ExplicitAttention(False), q, q, q)["raise.attention.explicit"] == 1


def test_explicit_attention_with_a_non_causal_mask_is_left_alone():
    q = torch.randn(2, 4, 8, 16)
    mask = torch.ones(8, 8).triu().view(1, 1, 8, 8)  # upper triangle: not causal
    c = raised(ExplicitAttention(True, mask), q, q, q)
    assert c["raise.attention.explicit.causal"] == 0 and c["raise.attention.explicit"] == 0


def test_swiglu_is_recognised():
    wg, wu = torch.randn(32, 16), torch.randn(32, 16)
    model = Lambda(lambda m, x: F.silu(F.linear(x, m.wg)) * F.linear(x, m.wu), wg=wg, wu=wu)
    assert raised(model, x4)["raise.swiglu"] == 1


def test_clamp_forms_become_maximum_and_minimum():
    def fns(model):
        module, counters = run_pipeline(model, (x4,), "raise-patterns")
        return [op.fn.data for op in module.walk() if op.name == "coopt.ew"], counters["raise.ew.clamp"]

    assert fns(Lambda(lambda m, x: torch.clamp(x, -1, 2))) == (["maximum", "minimum"], 1)
    assert fns(Lambda(lambda m, x: x.clamp(max=0.5))) == (["minimum"], 1)
    assert fns(Lambda(lambda m, x: F.relu6(x))) == (["maximum", "minimum"], 1)
    assert fns(Lambda(lambda m, x: F.hardtanh(x))) == (["maximum", "minimum"], 1)
    assert fns(Lambda(lambda m, x: torch.clamp_min(x, 0.1)))[0] == ["maximum"]
    # a tensor bound is not a number: left as it was
    bound = torch.zeros(16)
    assert fns(Lambda(lambda m, x: torch.clamp(x, m.lo), lo=bound)) == ([], 0)


def test_rsub_swaps_its_operands_and_hard_activations_are_fns():
    module, counters = run_pipeline(Lambda(lambda m, x: F.hardswish(1 - x) + F.hardsigmoid(x)), (x4,), "raise-patterns")
    ews = [(op.fn.data, op.arg_refs) for op in module.walk() if op.name == "coopt.ew"]
    assert ews[0] == ("sub", [{"$f": 1.0}, 0])
    assert [fn for fn, _ in ews[1:]] == ["hardswish", "hardsigmoid", "add"]


def test_what_the_clamp_and_rsub_raising_leaves_alone():
    def ew_fns(model, x):
        module, _ = run_pipeline(model, (x,), "raise-patterns")
        return [op.fn.data for op in module.walk() if op.name == "coopt.ew"]

    ints = torch.arange(12).reshape(3, 4)
    assert ew_fns(Lambda(lambda m, x: torch.clamp(x, 1, 5)), ints) == []  # integer tensors stay ATen
    assert ew_fns(Lambda(lambda m, x: torch.rsub(x, 1.0, alpha=2.0)), x4) == []  # other - alpha * x
    assert ew_fns(Lambda(lambda m, x: torch.clamp(x, 2.0, -1.0)), x4) == ["maximum", "minimum"]  # -> -1, as torch


def test_where_with_a_bool_condition_is_raised_and_comparisons_are_not():
    def ews(model, *inputs):
        module, _ = run_pipeline(model, inputs, "raise-patterns")
        return [(op.fn.data, op.arg_refs) for op in module.walk() if op.name == "coopt.ew"]

    mask = torch.rand(2, 3, 16) > 0.5
    assert ews(Lambda(lambda m, x, c: torch.where(c, x, -x)), x4, mask) == [("neg", [0]), ("where", [0, 1, 2])]
    assert ews(Lambda(lambda m, x, c: torch.where(c, x, 0.5)), x4, mask) == [("where", [0, 1, {"$f": 0.5}])]
    assert ews(Lambda(lambda m, x, c: x.masked_fill(c, 0.0)), x4, mask) == []  # masked_fill: not a where
    # the comparison stays ATen (its result is bool); the where after it is raised
    assert [fn for fn, _ in ews(Lambda(lambda m, x: torch.where(x > 0, x, 0.1 * x)), x4)] == ["mul", "where"]
    ints = torch.arange(48).reshape(2, 3, 8)
    assert ews(Lambda(lambda m, x, c: torch.where(c, x, 0)), ints, mask[..., :8]) == []
