"""Template family "rope": every legal point against torch's rotate-half formula, on strided
inputs (a slice of a merged q|k|v projection, transposed heads) and broadcast cos/sin."""

from __future__ import annotations

import pytest
import torch
from template_helpers import on_test_device

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.rope import RopeFamily

FAMILY = RopeFamily()


def region(x_shape, cos_shape, dtype="float32"):
    x = TensorSpec(tuple(x_shape), dtype)
    table = TensorSpec(tuple(cos_shape), dtype)
    return RegionSummary(name="rope", family="rope", inputs=(x, table, table), outputs=(x,))


def rope_reference(x, cos, sin):
    x, cos, sin = x.float(), cos.float(), sin.float()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin




@pytest.mark.parametrize("params", FAMILY.legal_points(region((2, 3, 5, 16), (5, 16)), H200),
                         ids=lambda p: f"R{p['BLOCK_R']}w{p['num_warps']}")
def test_every_point_on_transposed_heads_with_broadcast_tables(load_candidate, assert_close, params):
    torch.manual_seed(0)
    # [B, T, H, D] projection viewed as [B, H, T, D]: the kernel reads through strides
    x = torch.randn(2, 5, 3, 16).transpose(1, 2)
    cos, sin = torch.randn(5, 16), torch.randn(5, 16)
    summary = region(x.shape, cos.shape)
    module = load_candidate(FAMILY.render(summary, params))
    (out,) = module.run(*on_test_device([x, cos, sin]))
    assert out.shape == x.shape and out.is_contiguous()
    assert_close(out, rope_reference(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_slice_of_a_merged_projection_in_low_precision(load_candidate, assert_close, dtype):
    """The k part of a q|k|v output: last-dim slice, odd rows, D = 6 (not a power of two)."""
    torch.manual_seed(1)
    merged = torch.randn(1, 7, 5 * 6).to(dtype)
    k = merged[..., 18:30].view(1, 7, 2, 6).transpose(1, 2)  # [1, 2, 7, 6], non-contiguous
    cos, sin = torch.randn(1, 7, 6).to(dtype), torch.randn(1, 7, 6).to(dtype)
    summary = region(k.shape, cos.shape, str(dtype).removeprefix("torch."))
    (out,) = load_candidate(FAMILY.render(summary, {"BLOCK_R": 4, "num_warps": 1})).run(*on_test_device([k, cos, sin]))
    assert out.dtype == dtype
    assert_close(out, rope_reference(k, cos, sin))


def test_space_and_checks():
    summary = region((1, 32, 1, 128), (1, 128))
    points = FAMILY.legal_points(summary, H200)
    assert {"BLOCK_R": 1, "num_warps": 4} in points  # 128 elements over 128 threads
    assert {"BLOCK_R": 1, "num_warps": 8} not in points  # 256 threads for 128 elements: idle lanes
    assert FAMILY.check(summary, {"BLOCK_R": 32, "num_warps": 1}, H200) is not None  # 128 per thread
    assert FAMILY.matches(summary)
    assert not FAMILY.matches(region((4, 7), (4, 7)))  # odd D has no halves


def test_compiles_for_hopper(compile_for_sm90):
    """The interpreter accepts more than the compiler: compile the decode and prompt shapes for
    sm_90 (bf16, strided x as the merged q|k|v slice gives it)."""
    merged = torch.randn(1, 4, 48 * 128).to(torch.bfloat16)
    q = merged[..., : 32 * 128].view(1, 4, 32, 128).transpose(1, 2)
    cos, sin = torch.randn(4, 128).to(torch.bfloat16), torch.randn(4, 128).to(torch.bfloat16)
    summary = region(q.shape, cos.shape, "bfloat16")
    forced_64 = "\n_index_64 = lambda *views: True  # the int64 indices of a long prompt\n"
    compile_for_sm90([
        (f"R{p['BLOCK_R']}w{p['num_warps']}{tail and '-int64'}", FAMILY.render(summary, p) + tail, [q, cos, sin],
         "rope_kernel")
        for p in ({"BLOCK_R": 1, "num_warps": 1}, {"BLOCK_R": 8, "num_warps": 4}) for tail in ("", forced_64)
    ])


def test_int64_indices_when_an_offset_passes_2_31(load_candidate, assert_close):
    """A q slice of a long prompt's merged projection: row offsets reach 2**31 before the rows do."""
    module = load_candidate(FAMILY.render(region((1, 7, 2, 6), (1, 7, 6)), {"BLOCK_R": 4, "num_warps": 1}), "index64")
    assert module._index_64((1, 2**18, 32, 128), (0, 6144, 128, 1)) is False  # 1.6e9
    assert module._index_64((1, 2**19, 32, 128), (0, 6144, 128, 1)) is True  # 2**19 x 6144 > 2**31
    torch.manual_seed(1)
    merged = torch.randn(1, 7, 5 * 6)
    k = merged[..., 18:30].view(1, 7, 2, 6).transpose(1, 2)
    cos, sin = torch.randn(1, 7, 6), torch.randn(1, 7, 6)
    module._index_64 = lambda *views: True
    (out,) = module.run(*on_test_device([k, cos, sin]))
    assert_close(out, rope_reference(k, cos, sin))
