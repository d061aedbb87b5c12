"""kv_write per row ("positions": "per-row", a ragged decode step): each sequence writes its
one token at its own position, k_cache[b, :, positions[b]] = rope(k[b, :, 0]), against torch
indexing, in place; other rows and positions untouched."""

from __future__ import annotations

import pytest
import torch
from template_helpers import on_test_device

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.kv_write import KvWriteFamily
from coopt.verify.strategies import Example, make_inputs

FAMILY = KvWriteFamily()
FP8 = torch.float8_e4m3fn


def region(b_max, heads, s_max, b, d, *, rope=False, quant="none", dtype="float32"):
    cache = TensorSpec((b_max, heads, s_max, d), "float8_e4m3fn" if quant != "none" else dtype)
    row = TensorSpec((b, heads, 1, d), dtype)
    inputs = [cache, cache, TensorSpec((b,), "int64"), row, row]
    if rope:
        inputs += [TensorSpec((b, 1, 1, d), "float32")] * 2  # each row's own cos / sin
    if quant != "none":
        inputs += [TensorSpec((1,) if quant == "per-tensor" else (heads,), "float32")] * 2
    attrs = {"rope": rope, "quant": quant, "inplace": [0, 1], "positions": "per-row",
             "index_input": 2, "index_bound": [0, 2]}
    return RegionSummary("kv", "kv_write", tuple(inputs), (cache, cache), attrs)


def reference(inputs, rope_on, quant):
    k_cache, v_cache, positions, k, v, *extra = [t.clone() for t in inputs]
    if rope_on:
        cos, sin, *extra = extra
        half = k.shape[-1] // 2
        k = k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin
    if quant != "none":
        shape = (1, 1, 1, 1) if quant == "per-tensor" else (1, -1, 1, 1)
        k = (k.float() / extra[0].view(shape)).clamp(-448, 448).to(FP8)
        v = (v.float() / extra[1].view(shape)).clamp(-448, 448).to(FP8)
    rows = torch.arange(k.shape[0])
    k_cache[rows, :, positions] = k[:, :, 0]
    v_cache[rows, :, positions] = v[:, :, 0]
    return k_cache, v_cache


def inputs_for(summary, positions, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for i, spec in enumerate(summary.inputs):
        if i == 2:
            tensors.append(torch.tensor(positions, dtype=torch.int64))
            continue
        values = torch.randn(spec.shape, generator=generator)
        if spec.dtype == "float8_e4m3fn":
            tensors.append(values.clamp(-448, 448).to(FP8))
        elif summary.attrs["quant"] != "none" and i >= len(summary.inputs) - 2:
            tensors.append(values.abs() * 0.05 + 0.01)
        else:
            tensors.append(values)
    return tensors


def check(load_candidate, summary, positions, params=None):
    inputs = inputs_for(summary, positions)
    expected = reference(inputs, summary.attrs["rope"], summary.attrs["quant"])
    module = load_candidate(FAMILY.render(summary, params or FAMILY.legal_points(summary, H200)[0]))
    outputs = module.run(*on_test_device([t.clone() for t in inputs]))
    for got, want in zip(outputs, expected):
        if got.dtype == FP8:
            assert torch.equal(got.cpu().float(), want.float())
        else:
            torch.testing.assert_close(got.cpu(), want, rtol=2e-6, atol=2e-6)
    return inputs, outputs


@pytest.mark.parametrize("rope_on", [False, True])
def test_each_row_writes_at_its_own_position(load_candidate, rope_on):
    summary = region(4, 2, 32, 3, 16, rope=rope_on)
    inputs, outputs = check(load_candidate, summary, [31, 0, 17])
    k_cache = outputs[0].cpu()
    assert torch.equal(k_cache[3], inputs[0][3])  # a row past the batch is untouched
    for b, pos in enumerate([31, 0, 17]):  # and every other position of a written row
        others = [p for p in range(32) if p != pos]
        assert torch.equal(k_cache[b][:, others], inputs[0][b][:, others])


@pytest.mark.parametrize("params", FAMILY.legal_points(region(4, 2, 32, 4, 16, rope=True), H200)[:6],
                         ids=lambda p: f"R{p['BLOCK_R']}w{p['num_warps']}")
def test_points(load_candidate, params):
    check(load_candidate, region(4, 2, 32, 4, 16, rope=True), [5, 5, 30, 1], params)


@pytest.mark.parametrize("quant", ["per-tensor", "per-head"])
def test_fp8_per_row(load_candidate, quant):
    check(load_candidate, region(2, 2, 16, 2, 16, rope=True, quant=quant), [3, 12])


def test_matches_only_one_position_per_row():
    assert FAMILY.matches(region(4, 2, 32, 3, 16, rope=True))
    bad = region(4, 2, 32, 3, 16)
    assert not FAMILY.matches(RegionSummary("kv", "kv_write", (*bad.inputs[:2], TensorSpec((1,), "int64"), *bad.inputs[3:]),
                                            bad.outputs, bad.attrs))
    assert not FAMILY.matches(RegionSummary("kv", "kv_write", bad.inputs, bad.outputs, {**bad.attrs, "positions": "odd"}))


def test_verification_draws_a_valid_position_per_row():
    summary = region(4, 2, 32, 4, 16)
    drawn = [make_inputs(summary, Example((), seed, 1.0))[2] for seed in range(40)]
    values = torch.cat(drawn)
    assert values.min() >= 0 and values.max() <= 31
    assert {0, 31} <= set(values.tolist())  # the edges of the cache are drawn
    assert any(len(set(d.tolist())) > 1 for d in drawn)  # rows at different positions


def test_compiles_for_hopper(compile_for_sm90):
    summary = region(4, 2, 16, 3, 32, rope=True, quant="per-head", dtype="bfloat16")
    inputs = [t.to(torch.bfloat16) if t.dtype == torch.float32 and t.dim() == 4 and t.shape[1] == 2 else t
              for t in inputs_for(summary, [0, 5, 15])]
    source = FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0])
    compile_for_sm90([("per-row", source, inputs, "kv_write_kernel")])
