"""decode_attention's SWAP_AB knob: both dots transposed (K q^T, V^T P^T), the softmax statistics
reduced over the keys' axis. The same answers as the untransposed kernel in every form the
template has: plain bf16 caches, splits, fp8 caches of each granularity (fp16 tiles too), the
query's rope, pages, and the folded cache write with whole rotary tables."""

from __future__ import annotations

import pytest
import torch
from test_decode_attention import (DEVICE, FAMILY, check_close, fp8_reference, fp8_region, make_fp8_inputs,
                                   make_inputs, make_paged_inputs, make_region, paged_region, reference, run_candidate)
from test_decode_attention_kv_write import folded, gathered, write_inputs
from test_decode_attention_rope import rope_tables, rotated, with_rope

from coopt.targets import H200

SWAP = {"BLOCK_N": 64, "SPLIT_KV": 1, "USE_DOT": True, "SWAP_AB": True, "num_warps": 4, "num_stages": 2}
SWAP_SPLIT = {**SWAP, "SPLIT_KV": 2}
S_MAX = 160  # two splits of 64 keys fit
CASES = {"one": [1, 1, 1], "tile edges": [63, 64, 65], "max": [S_MAX] * 3, "mixed": [1, S_MAX, 70]}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("params", [SWAP, SWAP_SPLIT], ids=["one-split", "two-splits"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lengths(case, params, dtype, load_candidate):
    region = make_region(3, 8, 2, S_MAX, 64, dtype)
    assert FAMILY.check(region, params, H200) is None
    inputs = make_inputs(region, CASES[case])
    (out,) = run_candidate(load_candidate, region, params, inputs)
    check_close(out, reference(region, *inputs))


@pytest.mark.parametrize("fp16_tiles", [False, True], ids=["q-dtype-tiles", "fp16-tiles"])
@pytest.mark.parametrize("granularity", ["per-tensor", "per-head", "per-token"])
def test_fp8_caches(granularity, fp16_tiles, load_candidate):
    if fp16_tiles and granularity == "per-token":
        pytest.skip("TILE_FP16 is for per-tensor / per-head scales")
    region = fp8_region(3, 8, 2, S_MAX, 64, granularity)
    inputs = make_fp8_inputs(region, CASES["mixed"], seed=4)
    params = {**SWAP_SPLIT, "TILE_FP16": fp16_tiles}
    assert FAMILY.check(region, params, H200) is None
    (out,) = run_candidate(load_candidate, region, params, inputs)
    check_close(out, fp8_reference(region, *inputs))


def test_query_rope(load_candidate):
    base = make_region(3, 4, 2, S_MAX, 64, "bfloat16")
    region = with_rope(base, (1, 64))
    q, k, v, lengths = make_inputs(base, CASES["mixed"])
    cos, sin = rope_tables((1, 64), torch.bfloat16)
    (out,) = run_candidate(load_candidate, region, SWAP_SPLIT, [q, k, v, lengths, cos, sin])
    check_close(out, reference(region, rotated(q, cos, sin), k, v, lengths))


def test_pages(load_candidate):
    region = paged_region(3, 8, 2, 12, 16, 4, 64, "bfloat16")
    inputs, (k, v) = make_paged_inputs(region, [1, 50, 33], seed=2)
    (out,) = run_candidate(load_candidate, region, SWAP, inputs)
    check_close(out, reference(region, inputs[0], k, v, inputs[3]))


def test_folded_write_with_whole_tables(load_candidate):
    base = with_rope(make_region(3, 4, 2, S_MAX, 64, "bfloat16"), (1, 64))
    region = gathered(folded(base, shared_tables=True), rows=S_MAX)
    q, k, v, lengths = make_inputs(make_region(3, 4, 2, S_MAX, 64, "bfloat16"), [46, 12, 46])
    cos, sin = rope_tables((S_MAX, 64), torch.bfloat16)
    k_new, v_new = write_inputs(3, 2, 64, torch.bfloat16)
    _, _, out = run_candidate(load_candidate, region, SWAP_SPLIT,
                              [q, k.clone(), v.clone(), lengths, cos, sin, torch.tensor([45], device=DEVICE), k_new, v_new])
    row = slice(45, 46)
    k[:, :, 45] = rotated(k_new.float(), cos[row].float(), sin[row].float())[:, :, 0].to(k.dtype)
    v[:, :, 45] = v_new[:, :, 0]
    check_close(out, reference(base, rotated(q, cos[row], sin[row]), k, v, lengths))


def test_only_on_dot_tiles_of_64_keys_or_more_and_not_for_fp32():
    region = make_region(1, 32, 8, 4096, 128, "bfloat16")
    assert FAMILY.param_space(region, H200)["SWAP_AB"] == [False, True]
    assert "USE_DOT=True" in FAMILY.check(region, {**SWAP, "USE_DOT": False}, H200)
    assert "32 < 64" in FAMILY.check(region, {**SWAP, "BLOCK_N": 32}, H200)
    assert "SWAP_AB" not in FAMILY.param_space(make_region(1, 32, 8, 4096, 128, "float32"), H200)
    assert "acc = tl.trans(acc_t)" in FAMILY.render(region, SWAP)
    assert "acc_t" not in FAMILY.render(region, {**SWAP, "SWAP_AB": False})


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_transposed_dots_compile_to_wgmma_for_hopper(tmp_path):
    """What SWAP_AB is for: at a Llama-3-8B layer's shapes (group 4 padded to 16 rows) the plain
    dots are too short for a warpgroup MMA (M = 16); transposed, M is the 64 keys of a tile."""
    from template_helpers import compile_for_hopper

    bf16 = make_region(2, 32, 8, "S", 128, "bfloat16", dims={"S": (1, 8192)})
    fp8 = fp8_region(2, 32, 8, "S", 128, "per-head", dims={"S": (1, 8192)})
    jobs = []
    for name, region, inputs, extra in (
            ("bf16", bf16, make_inputs(bf16, [256, 100], {"S": 256}), {}),
            ("fp8", fp8, make_fp8_inputs(fp8, [256, 100], {"S": 256}), {"TILE_FP16": True})):
        for swap in (False, True):
            params = {**SWAP, "SPLIT_KV": 4, **extra, "SWAP_AB": swap}
            assert FAMILY.check(region, params, H200) is None
            jobs.append((f"{name}_{swap}", FAMILY.render(region, params), inputs))
    compiled = compile_for_hopper(jobs, tmp_path)
    facts = {label: kernels["_decode_split_kernel"] for label, kernels in compiled.items()}
    assert all(f["pipelined"] and f["pdl"] for f in facts.values()), facts
    # (triton 3.9, session 13: the untransposed kernels compile to mma.sync, no wgmma)
    assert facts["bf16_True"]["wgmma"] and facts["fp8_True"]["wgmma"], facts
