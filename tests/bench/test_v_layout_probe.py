"""bench/v_layout_probe.py without a GPU: the keys-contiguous V holds the same values with a
stride of 1 along the keys (what makes Triton read it so), and the points it times are legal
for the family at the space's depth with their K/V stages within shared memory."""

from __future__ import annotations

import torch
from attention_sweep import CASES, HEAD_DIM, make_region
from v_layout_probe import SPLITS, keys_contiguous, points

from coopt.targets import H200
from coopt.templates.attention import kv_element_bytes
from coopt.templates.decode_attention import DecodeAttentionFamily


def test_keys_contiguous_is_the_same_cache_with_keys_adjacent():
    v = torch.randn(2, 3, 40, 16)
    t = keys_contiguous(v)
    assert torch.equal(t, v) and t.stride(2) == 1 and t.stride(3) == 40
    assert t.clone().stride() == t.stride()  # the bench's input copies keep the layout


def test_deep_pipelines_are_kept_only_where_their_stages_fit():
    family = DecodeAttentionFamily()
    for case in ("b1-32768-fp8", "b1-32768"):
        region = make_region(*CASES[case])
        kept = points(case, (4,), (2, 3, 4, 5, 6))
        assert {p["SPLIT_KV"] for p in kept} == set(SPLITS[case])
        for p in kept:
            assert family.check(region, {**p, "num_stages": min(p["num_stages"], 4)}, H200) is None
            assert p["num_stages"] * 2 * p["BLOCK_N"] * HEAD_DIM * kv_element_bytes(region) <= H200.smem_per_block_bytes
        deepest = {p["BLOCK_N"]: p["num_stages"] for p in sorted(kept, key=lambda p: p["num_stages"])}
        # fp8 tiles are half the bytes: six 128-key stages fit; bf16 ones stop earlier
        assert deepest[128] == (6 if case.endswith("fp8") else 3), deepest


def test_split_counts_outside_the_space_are_swept_where_their_tiles_fit_the_cache():
    kept = points("b1-32768-fp8", (4,), (3,), (24, 48, 300))
    assert {p["SPLIT_KV"] for p in kept} == {24, 48, 300} and all(p["SPLIT_KV"] * p["BLOCK_N"] <= 32832 for p in kept)
    assert {p["BLOCK_N"] for p in kept if p["SPLIT_KV"] == 300} == {64}  # 300 tiles of 128 exceed the cache
