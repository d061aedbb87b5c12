"""raise-patterns folds key / value heads repeated per query head (Hugging Face's repeat_kv,
repeat_interleave) into SDPA with enable_gqa: the attention reads the kv heads themselves, and a
decode step's cache copy disappears, so its cache write folds into the decode attention as with
enable_gqa. Any other repetition is left as it was."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import beside_eager, kernel_families, run_pipeline

import coopt
from coopt.ir.dialect import AtenOp, AttentionOp, DecodeAttentionOp

RAISE = "inplace-state-writes,raise-patterns"


def repeat_kv(x, n):  # transformers' form: one copy per query head, heads of a group adjacent
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


REPEATS = {
    "expand": repeat_kv,
    "interleave": lambda x, n: x.repeat_interleave(n, dim=1),
    "interleave-negative-dim": lambda x, n: torch.repeat_interleave(x, n, dim=-3),
    # query head i reads kv head i % h: not grouped-query attention's mapping
    "tile": lambda x, n: x.repeat(1, n, 1, 1),
    # the sequence repeated, not the heads
    "sequence": lambda x, n: x.repeat_interleave(n, dim=2)[:, :, : x.shape[2]].repeat(1, n, 1, 1),
}


class Prompt(torch.nn.Module):
    """Causal attention of 4 query heads over 2 kv heads, repeated by `k_form` / `v_form`."""

    def __init__(self, k_form: str, v_form: str | None = None):
        super().__init__()
        self.k_form, self.v_form = k_form, v_form or k_form

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, REPEATS[self.k_form](k, 2), REPEATS[self.v_form](v, 2), is_causal=True)


def prompt_inputs(b=2, s=8):
    torch.manual_seed(0)
    return [torch.randn(b, 4, s, 8), torch.randn(b, 2, s, 8), torch.randn(b, 2, s, 8)]


def aten_targets(module) -> list[str]:
    return [op.target.data for op in module.walk() if isinstance(op, AtenOp)]


@pytest.mark.parametrize("form", ["expand", "interleave", "interleave-negative-dim"])
def test_repeated_heads_fold_into_a_grouped_attention(form):
    module, counters = run_pipeline(Prompt(form), prompt_inputs(), RAISE)
    assert counters["raise.attention.repeated_kv_folded"] == 1 and counters["raise.attention.sdpa"] == 1
    (attention,) = [op for op in module.walk() if isinstance(op, AttentionOp)]
    heads = module.body.block.first_op.body.block.args  # the function's q, k, v
    assert attention.operands[1] is heads[1] and attention.operands[2] is heads[2]  # the kv heads themselves
    # the copies are gone (dead once the attention stopped reading them)
    assert not {"aten.expand.default", "aten.clone.default", "aten.repeat_interleave.self_int"} & set(aten_targets(module))


@pytest.mark.parametrize("k_form, v_form", [("tile", None), ("sequence", None), ("expand", "tile"), ("interleave", "tile")],
                         ids=["tile", "sequence", "keys-only", "keys-only-interleave"])
def test_other_repetitions_are_left_alone(k_form, v_form):
    module, counters = run_pipeline(Prompt(k_form, v_form), prompt_inputs(), RAISE)
    assert not counters.get("raise.attention.repeated_kv_folded")
    (attention,) = [op for op in module.walk() if isinstance(op, AttentionOp)]
    assert attention.operands[1].type.get_shape()[1] == 4  # still reads 4 (repeated) heads


def test_the_knob_turns_it_off():
    _, counters = run_pipeline(Prompt("expand"), prompt_inputs(), "inplace-state-writes,raise-patterns{repeated-kv=false}")
    assert not counters.get("raise.attention.repeated_kv_folded")


def test_a_dynamic_sequence_folds_too():
    length = torch.export.Dim("length", min=2, max=16)
    shapes = ({2: length}, {2: length}, {2: length})
    module, counters = run_pipeline(Prompt("expand"), prompt_inputs(), RAISE, dynamic_shapes=shapes)
    assert counters["raise.attention.repeated_kv_folded"] == 1
    (attention,) = [op for op in module.walk() if isinstance(op, AttentionOp)]
    assert attention.operands[1] is module.body.block.first_op.body.block.args[1]


@pytest.mark.parametrize("form", ["expand", "tile"])
def test_the_build_matches_the_model(tmp_path, form):
    model, inputs = Prompt(form), prompt_inputs()
    result = coopt.Pipeline(top_k=1).build(model, tuple(inputs), tmp_path / "out")
    assert "attention" in [r.summary.family for r in result.regions]
    inputs = prompt_inputs(s=8)
    inputs = [x * 2 for x in inputs]  # other values than the build saw
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(coopt.load(tmp_path / "out"))(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)


class DecodeStep(torch.nn.Module):
    """One token over a static cache [B, 2, S, 8], written in place, then attention over the
    cache repeated per query head (as transformers' Llama does)."""

    def __init__(self, max_seq=32):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(2, 2, max_seq, 8))
        self.register_buffer("v_cache", torch.zeros(2, 2, max_seq, 8))
        self.register_buffer("cache_positions", torch.arange(max_seq))

    def forward(self, q, k, v, pos):
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        mask = self.cache_positions[None, :] <= pos[:, None]  # [1, S]: positions 0 .. pos
        return F.scaled_dot_product_attention(q, repeat_kv(self.k_cache, 2), repeat_kv(self.v_cache, 2), attn_mask=mask)


def decode_inputs():
    torch.manual_seed(1)
    return [torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), torch.tensor([5])]


def test_a_decode_step_over_a_repeated_cache_reads_the_cache_itself():
    pipeline = "inplace-state-writes,raise-patterns,fuse-attention,fuse-kv-write,fuse-kv-write-attention"
    module, counters = run_pipeline(DecodeStep(), decode_inputs(), pipeline)
    assert counters["raise.attention.repeated_kv_folded"] == 1 and counters["raise.attention.decode"] == 1
    # no copy of the cache a step; the write folds into the attention, as with enable_gqa
    assert "aten.clone.default" not in aten_targets(module)
    assert counters["fuse.kv_write_attention"] == 1
    assert kernel_families(module) == ["decode_attention"]
    assert not [op for op in module.walk() if isinstance(op, DecodeAttentionOp) and op.parent_op() is module]


def test_a_built_decode_step_over_a_repeated_cache_matches_the_model(tmp_path):
    coopt.Pipeline(top_k=1).build(DecodeStep(), tuple(decode_inputs()), tmp_path / "out")
    built, model = beside_eager(coopt.load(tmp_path / "out")), DecodeStep()
    torch.manual_seed(2)
    with torch.no_grad():
        for pos in range(3):  # three steps: each reads what the ones before wrote
            q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
            step = (q, k, v, torch.tensor([pos]))
            torch.testing.assert_close(built(*step), model(*step), rtol=1e-4, atol=1e-4)


class ExplicitPrompt(torch.nn.Module):
    """transformers' eager attention: softmax(q k^T * scale, causal) v over repeated heads."""

    def __init__(self, form: str = "expand"):
        super().__init__()
        self.form = form
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8))

    def forward(self, q, k, v):
        k, v = REPEATS[self.form](k, 2), REPEATS[self.form](v, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        scores = scores.masked_fill(self.mask[:, :, :8, :8] == 0, float("-inf"))
        return scores.softmax(-1) @ v


@pytest.mark.parametrize("form, folded", [("expand", True), ("interleave", True), ("tile", False)])
def test_the_explicit_attention_over_repeated_heads_folds_too(tmp_path, form, folded):
    model, inputs = ExplicitPrompt(form), prompt_inputs()
    module, counters = run_pipeline(model, inputs, RAISE)
    assert counters["raise.attention.explicit.causal"] == 1
    assert counters.get("raise.attention.repeated_kv_folded", 0) == int(folded)
    (attention,) = [op for op in module.walk() if isinstance(op, AttentionOp)]
    assert attention.k.type.get_shape()[1] == (2 if folded else 4) and attention.causal.value.data
    coopt.Pipeline(top_k=1).build(model, tuple(inputs), tmp_path / "out")
    inputs = [x * 2 for x in prompt_inputs()]
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(coopt.load(tmp_path / "out"))(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)


class SelfAttention(torch.nn.Module):
    """q, k and v all the same repeated tensor (one operand of the SDPA, three args)."""

    def forward(self, x):
        r = repeat_kv(x, 2)
        return F.scaled_dot_product_attention(r, r, r, is_causal=True)


def test_a_query_that_is_the_repeated_tensor_keeps_its_heads(tmp_path):
    model, x = SelfAttention(), torch.randn(1, 2, 8, 8)
    module, counters = run_pipeline(model, [x], RAISE)
    assert counters["raise.attention.repeated_kv_folded"] == 1
    (attention,) = [op for op in module.walk() if isinstance(op, AttentionOp)]
    assert [v.type.get_shape()[1] for v in attention.operands] == [4, 2, 2]  # q repeated, k and v not
    coopt.Pipeline(top_k=1).build(model, (x,), tmp_path / "out")
    x = torch.randn(1, 2, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(coopt.load(tmp_path / "out"))(x), model(x), rtol=1e-4, atol=1e-4)


class OneQueryHead(torch.nn.Module):
    """One query head against keys repeated to 2: eager SDPA broadcasts the query (2 heads out)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2))


def test_a_query_broadcast_over_repeated_heads_is_left_alone():
    model = OneQueryHead()
    inputs = [torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8)]
    _, counters = run_pipeline(model, inputs, RAISE)
    assert not counters.get("raise.attention.repeated_kv_folded")
