"""Valid lengths: an int input the region names (attrs "lengths_input" / "lengths_bound") is drawn
in [1, bound] with the edges a kernel gets wrong (1, the bound, tile boundaries, mixed in a
batch); every other input is drawn as before. Then the fuzzer verifies a decode_attention
kernel with such lengths, and catches one that ignores them."""

from __future__ import annotations

import pytest
import torch
from verify_helpers import write_module

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.verify.runner import verify_candidate
from coopt.verify.strategies import Example, make_inputs, valid_lengths


# where the rendered Triton kernels run: the GPU when there is one (CPU tensors given to a compiled
# kernel fail there), else the interpreter on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def decode_region(dtype: str = "float32") -> RegionSummary:
    """decode_attention over a cache of S positions (symbolic: the profile caps it)."""
    q = TensorSpec(("B", 4, 1, 16), dtype)
    kv = TensorSpec(("B", 2, "S", 16), dtype)
    return RegionSummary(
        "attn0", "decode_attention", (q, kv, kv, TensorSpec(("B",), "int32")), (q,),
        attrs={"scale": 0.25, "num_heads": 4, "num_kv_heads": 2, "lengths_input": 3, "lengths_bound": [1, 2]},
        dims={"B": (1, 4), "S": (1, 4096)}, example_dims={"B": 2, "S": 40})


def test_lengths_stay_valid_and_cover_the_edges():
    seen, mixed = set(), 0
    for seed in range(200):
        lengths = valid_lengths((4,), 200, seed).tolist()
        assert all(1 <= n <= 200 for n in lengths)
        seen.update(lengths)
        mixed += len(set(lengths)) > 1
    assert {1, 200, 15, 16, 17, 63, 64, 65, 127, 128, 129} <= seen
    assert mixed > 180  # a batch nearly always mixes lengths
    assert valid_lengths((3,), 1, seed=9).tolist() == [1, 1, 1]
    assert torch.equal(valid_lengths((2, 3), 50, seed=4), valid_lengths((2, 3), 50, seed=4))


def test_decode_inputs_get_lengths_bounded_by_the_cache():
    region = decode_region()
    for seed in range(20):
        example = Example((("B", 4), ("S", 33)), seed, 1.0)
        q, k, v, lengths = make_inputs(region, example)
        assert lengths.dtype == torch.int32 and lengths.shape == (4,)
        assert 1 <= int(lengths.min()) and int(lengths.max()) <= 33 == k.shape[2]


def test_other_inputs_are_drawn_as_before():
    # naming a lengths input changes that input only: same floats, other ints still in [0, 8)
    specs = (TensorSpec(("n",), "float32"), TensorSpec(("n",), "int64"), TensorSpec(("n", "m"), "int32"))
    plain = RegionSummary("r", "elementwise", specs, (specs[0],), dims={"n": (1, 64), "m": (1, 64)})
    named = RegionSummary("r", "elementwise", specs, (specs[0],), dims=plain.dims,
                          attrs={"lengths_input": 1, "lengths_bound": [2, 1]})
    example = Example((("n", 64), ("m", 500)), seed=3, magnitude=1.0)
    x0, ints0, other0 = make_inputs(plain, example)
    x1, lengths, other1 = make_inputs(named, example)
    assert torch.equal(x0, x1)
    assert 0 <= int(ints0.min()) and int(ints0.max()) < 8
    assert lengths.dtype == torch.int64 and 1 <= int(lengths.min()) and int(lengths.max()) <= 500
    assert int(lengths.max()) >= 8  # really drawn up to the bound
    assert int(other1.max()) < 8


def test_lengths_input_without_a_bound_is_an_error():
    spec = TensorSpec(("n",), "int32")
    region = RegionSummary("r", "elementwise", (spec,), (spec,), attrs={"lengths_input": 0})
    with pytest.raises(ValueError, match="lengths_bound"):
        make_inputs(region, Example((("n", 3),), 0, 1.0))


# The region's reference as eager torch: softmax over the valid prefix, kv heads repeated.
DECODE_REFERENCE = """
    import torch

    def run(q, k_cache, v_cache, lengths):
        group = q.shape[1] // k_cache.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k_cache, v_cache))
        scores = (q @ k.transpose(-1, -2)) * 0.25
        visible = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v,)
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fuzzer_verifies_a_decode_kernel_and_catches_a_static_cache_one(dtype, tmp_path):
    from coopt.templates.decode_attention import DecodeAttentionFamily

    region = decode_region(dtype)
    reference = write_module(tmp_path, "attn0__reference", DECODE_REFERENCE)
    params = {"BLOCK_N": 16, "SPLIT_KV": 2, "USE_DOT": True, "num_warps": 2, "num_stages": 2}
    source = DecodeAttentionFamily().render(region, params)
    good = tmp_path / "attn0__c0.py"
    good.write_text(source)
    result = verify_candidate(region, reference, good, profile="ci", seed=1, device=DEVICE)
    assert result.ok, result.failure
    # a "kernel" that attends to the whole cache (the static-cache baseline) must fail
    bad = tmp_path / "attn0__c1.py"
    whole_cache = "\n    lengths = torch.full_like(lengths, k_cache.shape[2])"
    signature = "def run(q, k_cache, v_cache, lengths):"
    bad.write_text(source.replace(signature, signature + whole_cache))
    result = verify_candidate(region, reference, bad, profile="ci", seed=1, device=DEVICE)
    assert not result.ok


def test_fuzzer_catches_a_kernel_that_reads_expanded_lengths_as_contiguous(tmp_path):
    """A decode step passes one length expanded over the batch (stride 0); verification passes
    lengths that way too (and keeps the layout when it copies inputs), so a kernel reading
    lengths[b] at lengths_ptr + b fails here instead of in the whole model."""
    from coopt.templates.decode_attention import DecodeAttentionFamily

    region = decode_region("float32")
    reference = write_module(tmp_path, "attn0__reference", DECODE_REFERENCE)
    params = {"BLOCK_N": 16, "SPLIT_KV": 2, "USE_DOT": True, "num_warps": 2, "num_stages": 2}
    source = DecodeAttentionFamily().render(region, params)
    assert "lengths_ptr + batch * stride_len" in source
    bad = tmp_path / "attn0__c1.py"
    bad.write_text(source.replace("lengths_ptr + batch * stride_len", "lengths_ptr + batch"))
    # seed 0, a build's default: its anchor examples pass the expanded form
    result = verify_candidate(region, reference, bad, profile="ci", seed=0, device=DEVICE)
    assert not result.ok


def test_an_input_holding_positions_is_drawn_one_below_the_lengths_and_read_so(tmp_path):
    """attrs lengths_offset = 1 (fuse-attention's lengths_add): input 3 holds a step's positions
    (lengths - 1) and the kernel adds the 1. The draws cover position 0 and S - 1; the kernel
    rendered for the region verifies, and the same kernel rendered as if the input held lengths
    (a template ignoring the attribute) is caught."""
    from coopt.templates.decode_attention import DecodeAttentionFamily

    region = decode_region("float32")
    region = RegionSummary(**{**region.__dict__, "attrs": {**region.attrs, "lengths_offset": 1}})
    drawn = set()
    for seed in range(40):
        drawn.update(make_inputs(region, Example((("B", 4), ("S", 33)), seed, 1.0))[3].tolist())
    assert min(drawn) == 0 and max(drawn) == 32
    reference = write_module(tmp_path, "attn0__reference", DECODE_REFERENCE.replace(
        "def run(q, k_cache, v_cache, lengths):", "def run(q, k_cache, v_cache, positions):\n        lengths = positions + 1"))
    params = {"BLOCK_N": 16, "SPLIT_KV": 2, "USE_DOT": True, "num_warps": 2, "num_stages": 2}
    family = DecodeAttentionFamily()
    good = tmp_path / "attn0__c0.py"
    good.write_text(family.render(region, params))
    assert "+ 1" in good.read_text()
    assert verify_candidate(region, reference, good, profile="ci", seed=1, device=DEVICE).ok
    unaware = tmp_path / "attn0__c1.py"
    unaware.write_text(family.render(decode_region("float32"), params))
    assert not verify_candidate(region, reference, unaware, profile="ci", seed=1, device=DEVICE).ok
