"""decode_attention with the query's RoPE in the kernel (attrs "rope", from fuse-attention): the
kernel rotates q as it loads it, for cos/sin shared by the batch ([1, D]: one decode position)
or one row per sequence ([B, 1, 1, D]), plain and fp8 caches, one split or several."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_attention import (DEVICE, DTYPES, FAMILY, SMALL, SPLIT, check_close, dequantize, fp8_region,
                                   make_fp8_inputs, make_inputs, make_region, reference, run_candidate)

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.decode_attention import scales_at


def with_rope(region: RegionSummary, table_shape) -> RegionSummary:
    """The region taking q before its rope, cos and sin after the lengths (before any scales)."""
    table = TensorSpec(tuple(table_shape), region.inputs[0].dtype)
    inputs = (*region.inputs[:4], table, table, *region.inputs[4:])
    return dataclasses.replace(region, inputs=inputs, attrs={**region.attrs, "rope": True})


def rope_tables(shape, dtype, seed=1):
    """cos, sin of random angles (as the model's tables: unit-circle pairs)."""
    angles = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 6.28
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)


def rotated(q, cos, sin):
    """The model's apply_rope in q's dtype: q*cos + rotate_half(q)*sin."""
    half = q.shape[-1] // 2
    return q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin


TABLES = {"shared position": lambda batch, d: (1, d), "per-row positions": lambda batch, d: (batch, 1, 1, d)}


@pytest.mark.parametrize("tables", TABLES)
@pytest.mark.parametrize("params", [SMALL, SPLIT], ids=["one-split-fma", "four-splits-dot"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_query_rope_in_the_kernel(tables, params, dtype, load_candidate):
    region = with_rope(make_region(3, 4, 2, 80, 64, dtype), TABLES[tables](3, 64))
    q, k, v, lengths = make_inputs(make_region(3, 4, 2, 80, 64, dtype), [1, 80, 33])
    cos, sin = rope_tables(region.inputs[4].shape, DTYPES[dtype])
    (out,) = run_candidate(load_candidate, region, params, [q, k, v, lengths, cos, sin])
    check_close(out, reference(region, rotated(q, cos, sin), k, v, lengths))
    # the kernel does rotate: without the rope the answer is a different one
    assert not torch.allclose(out.float(), reference(region, q, k, v, lengths), atol=1e-2)


def test_query_rope_with_an_fp8_cache(load_candidate):
    base = fp8_region(2, 8, 2, 80, 64, "per-head")
    region = with_rope(base, (1, 64))
    assert scales_at(region) == 6  # the scales follow the rope tables
    q, k, v, lengths, k_scale, v_scale = make_fp8_inputs(base, [80, 17])
    cos, sin = rope_tables((1, 64), torch.bfloat16)
    (out,) = run_candidate(load_candidate, region, SPLIT, [q, k, v, lengths, cos, sin, k_scale, v_scale])
    k_real, v_real = (dequantize(c, s, "per-head", torch.bfloat16) for c, s in ((k, k_scale), (v, v_scale)))
    check_close(out, reference(region, rotated(q, cos, sin), k_real, v_real, lengths))


def test_matches_only_rope_tables_that_broadcast_to_q():
    base = make_region(2, 8, 2, 80, 64, "bfloat16")
    assert FAMILY.matches(with_rope(base, (1, 64))) and FAMILY.matches(with_rope(base, (2, 1, 1, 64)))
    assert not FAMILY.matches(with_rope(base, (3, 1, 1, 64)))  # a batch of 3 tables for 2 sequences
    assert not FAMILY.matches(with_rope(base, (1, 32)))  # half a head
    odd = make_region(2, 8, 2, 48, 63, "bfloat16")
    assert not FAMILY.matches(with_rope(odd, (1, 63)))  # rotate-half needs an even head dim
    assert "q*cos" not in FAMILY.render(base, SPLIT) and "rotate_half" in FAMILY.render(with_rope(base, (1, 64)), SPLIT)
    assert FAMILY.check(with_rope(base, (1, 64)), SPLIT, H200) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_rope_kernels_compile_for_hopper(tmp_path):
    # Llama-3-8B's decode step (32 heads over 8 kv heads, D 128), the split points the advisor
    # picks at short and long lengths: the rotation must not stop the K/V loads from pipelining
    from template_helpers import compile_for_hopper

    base = make_region(2, 32, 8, "S", 128, "bfloat16", dims={"S": (1, 8192)})
    region = with_rope(base, (1, 128))
    q, k, v, lengths = make_inputs(base, [256, 100], {"S": 256})
    cos, sin = rope_tables((1, 128), torch.bfloat16)
    points = {"split16": {"BLOCK_N": 64, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 3},
              "fma": {"BLOCK_N": 32, "SPLIT_KV": 1, "USE_DOT": False, "num_warps": 4, "num_stages": 2}}
    jobs = [(label, FAMILY.render(region, params), [q, k, v, lengths, cos, sin]) for label, params in points.items()]
    compiled = compile_for_hopper(jobs, tmp_path)
    for label in points:
        (kernel,) = compiled[label].values()
        assert kernel["pdl"] and kernel["pipelined"], label
