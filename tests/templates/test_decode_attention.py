"""decode_attention family: valid-prefix softmax, GQA packing, splits, the bounded space.

Kernels run in Triton's interpreter without a GPU (on the GPU machine, for real): shapes stay
small. The reference is an explicit fp32 softmax over each sequence's valid prefix, kv heads
repeated for GQA; one test also checks it against SDPA with a padding mask.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from template_helpers import compile_for_hopper, covering_points, lay_out_in_pages, on_test_device
from template_helpers import run_candidate as _run_candidate

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.protocol import AdviceRequest
from coopt.targets import H200
from coopt.templates.decode_attention import DecodeAttentionFamily, kv_bytes_read

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILY = DecodeAttentionFamily()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
run_candidate = partial(_run_candidate, FAMILY, H200)
SMALL = {"BLOCK_N": 16, "SPLIT_KV": 1, "USE_DOT": False, "num_warps": 2, "num_stages": 2}
SPLIT = {"BLOCK_N": 16, "SPLIT_KV": 4, "USE_DOT": True, "num_warps": 2, "num_stages": 3}


def make_region(batch, heads, kv_heads, max_length, head_dim, dtype="float32", scale=None, dims=None,
                example_length=None) -> RegionSummary:
    kv = TensorSpec((batch, kv_heads, max_length, head_dim), dtype)
    q = TensorSpec((batch, heads, 1, head_dim), dtype)
    attrs = {"scale": head_dim ** -0.5 if scale is None else scale, "num_heads": heads,
             "num_kv_heads": kv_heads, "lengths_input": 3, "lengths_bound": [1, 2]}
    if example_length is not None:
        attrs["example_length"] = example_length
    return RegionSummary("decode_attn", "decode_attention", inputs=(q, kv, kv, TensorSpec((batch,), "int32")),
                         outputs=(q,), attrs=attrs, dims=dims or {})


def make_inputs(region: RegionSummary, lengths, concrete: dict | None = None, seed: int = 0):
    """q as a transpose view of [B, 1, H, D] (what a q projection gives), caches contiguous."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[region.inputs[0].dtype]
    batch, heads, _, head_dim = region.inputs[0].concrete(concrete or {})
    q = torch.randn(batch, 1, heads, head_dim, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(region.inputs[1].concrete(concrete or {}), generator=gen).to(dtype).to(DEVICE) for _ in "kv")
    return [q, k, v, torch.tensor(lengths, dtype=torch.int32, device=DEVICE)]


def reference(region: RegionSummary, q, k, v, lengths) -> torch.Tensor:
    """softmax(q k^T * scale) v over positions 0 .. lengths[b] - 1 of each sequence, in fp32."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, length in enumerate(lengths.tolist()):
        keys, values = (t[b, :, :length].float().repeat_interleave(group, dim=0) for t in (k, v))
        scores = q[b].float() @ keys.transpose(-1, -2) * region.attrs["scale"]
        out[b] = torch.softmax(scores, dim=-1) @ values
    return out


def check_close(actual: torch.Tensor, expected: torch.Tensor):
    assert actual.shape == expected.shape and actual.device.type == DEVICE
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    else:  # 16-bit caches: tl.dot rounds p before p @ v, and the output is rounded once more
        torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=2e-2)


# -- every knob value -------------------------------------------------------------------

# A symbolic cache length whose range makes every tile and split legal; run at S_max = 150.
COVERAGE_REGION = {
    dtype: make_region(2, 8, 2, "S", 64, dtype, dims={"S": (1, 8192)}) for dtype in ("float32", "bfloat16")
}


def test_space_values_are_all_legal_somewhere():
    for region in COVERAGE_REGION.values():
        space = FAMILY.param_space(region, H200)
        used = {(k, v) for p in FAMILY.legal_points(region, H200) for k, v in p.items()}
        assert used == {(k, v) for k, values in space.items() for v in values}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_covering_points_match_reference(dtype, load_candidate):
    region = COVERAGE_REGION[dtype]
    inputs = make_inputs(region, [150, 37], {"S": 150})
    points = covering_points(FAMILY.legal_points(region, H200))
    assert len(points) <= 8
    for i, params in enumerate(points):
        (out,) = run_candidate(load_candidate, region, params, inputs, stem=f"cover_{dtype}_{i}")
        check_close(out, reference(region, *inputs))


# -- lengths, heads, head dims ------------------------------------------------------------

LENGTHS = {
    "one": [1, 1, 1],
    "seven": [7, 7, 7],
    "thirty-three": [33, 33, 33],
    "block edges": [15, 16, 17],
    "two blocks": [31, 32, 64],
    "max": [80, 80, 80],
    "mixed": [1, 80, 33],
}


@pytest.mark.parametrize("case", LENGTHS)
@pytest.mark.parametrize("params", [SMALL, SPLIT], ids=["one-split", "four-splits"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lengths(case, params, dtype, load_candidate):
    region = make_region(3, 4, 2, 80, 64, dtype)
    inputs = make_inputs(region, LENGTHS[case])
    (out,) = run_candidate(load_candidate, region, params, inputs)
    check_close(out, reference(region, *inputs))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("use_dot", [False, True], ids=["fma", "dot"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heads_and_head_dims(heads, kv_heads, head_dim, use_dot, dtype, load_candidate):
    region = make_region(2, heads, kv_heads, 48, head_dim, dtype)
    inputs = make_inputs(region, [48, 21])
    params = {**SMALL, "USE_DOT": use_dot, "SPLIT_KV": 2, "num_warps": 8 if head_dim == 128 else 4}
    (out,) = run_candidate(load_candidate, region, params, inputs)
    check_close(out, reference(region, *inputs))


def test_float16_and_sdpa_agree(load_candidate):
    # the explicit reference against SDPA with a padding mask, and an fp16 cache
    region = make_region(2, 8, 2, 64, 64, "float16", scale=0.3)
    q, k, v, lengths = make_inputs(region, [64, 9])
    mask = torch.arange(64, device=DEVICE)[None, :] < lengths[:, None]
    k_heads, v_heads = (t.float().repeat_interleave(4, 1) for t in (k, v))
    sdpa = F.scaled_dot_product_attention(q.float(), k_heads, v_heads, attn_mask=mask[:, None, None, :], scale=0.3)
    torch.testing.assert_close(reference(region, q, k, v, lengths), sdpa, rtol=1e-5, atol=1e-5)
    (out,) = run_candidate(load_candidate, region, {**SPLIT, "num_warps": 4}, [q, k, v, lengths])
    assert out.dtype == torch.float16
    check_close(out, sdpa)


@pytest.mark.parametrize("head_dim", [24, 80])
def test_head_dim_not_a_power_of_two(head_dim, load_candidate):
    region = make_region(2, 4, 1, 64, head_dim)
    inputs = make_inputs(region, [64, 5])
    warps = 8 if head_dim > 64 else 2  # 24 and 80 pad to 32 and 128
    for i, params in enumerate(({**SMALL, "num_warps": warps}, {**SPLIT, "num_warps": warps})):
        (out,) = run_candidate(load_candidate, region, params, inputs, stem=f"d{head_dim}_{i}")
        check_close(out, reference(region, *inputs))


@pytest.mark.parametrize("split_kv", [1, 8])
def test_reads_only_the_valid_prefix(split_kv, load_candidate):
    # NaN past each length: any load of those positions (even masked to -inf scores, 0 * NaN)
    # would poison the output; with 8 splits of 16 keys, splits past 20 keys must do nothing.
    region = make_region(2, 4, 2, 128, 32)
    q, k, v, lengths = make_inputs(region, [20, 100])
    for b, length in enumerate(lengths.tolist()):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("nan")
    params = {**SPLIT, "SPLIT_KV": split_kv, "USE_DOT": False, "num_warps": 2}
    (out,) = run_candidate(load_candidate, region, params, [q, k, v, lengths], stem=f"nan{split_kv}")
    check_close(out, reference(region, q, k, v, lengths))


@pytest.mark.parametrize("params,head_dim", [(SMALL, 64), (SMALL, 16), (SPLIT, 64)],
                         ids=["one-split-fma", "one-split-fma-d16", "four-splits-dot"])
def test_one_valid_key_gives_its_value_row_however_large_the_scores(params, head_dim, load_candidate):
    """One valid key: the output is its V row exactly (p = 1), here at scores ~1e6 (q and K of
    magnitude 1000). Session 17 on the H200: the compiler kept the scores in two layouts and
    contracted scale * s - m into one FMA in one of them only, so l and acc weighed the key
    differently, 5 % apart at this magnitude (the scale is now applied by mul.rn). Session 18:
    at D 16 over 2 warps each lane holds one product of a score, and tl.sum's first butterfly
    step contracted a lane's own product with its partner's, so half the lanes held a score
    other bits than the rest (columns 8-15 off; see the next test). The interpreter never
    contracts: this fails only on a GPU."""
    region = make_region(3, 4, 2, 80, head_dim, "float32")
    q, k, v, lengths = make_inputs(region, [1, 13, 1])
    (out,) = run_candidate(load_candidate, region, params, [q * 1000, k * 1000, v, lengths], stem="one-key")
    only_key = v[:, :, 0].repeat_interleave(2, dim=1)  # [B, H, D]: each query head's kv head's row 0
    for b in (0, 2):
        torch.testing.assert_close(out[b, :, 0], only_key[b], rtol=1e-6, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_no_lane_adds_its_product_to_a_shuffled_one_by_fma(tmp_path):
    """The multiply-and-sum scores at D 16 over 2 warps (one product a lane): in the sm_90 PTX no
    fma takes a value another lane shuffled over. Before session 18 eight did (the score's
    products, contracted into tl.sum's first butterfly add): lanes meant to hold one score held
    two, an ulp apart, and at the fuzzer's magnitude 1000 an ulp of a score is a factor on its
    key's weight (a folded build's verification failed on the H200 by 0.2 of the output)."""
    import re

    region = make_region(1, 4, 2, 32, 16, "float32")
    compile_for_hopper([("d16", FAMILY.render(region, SMALL), make_inputs(region, [1]))], tmp_path)
    (ptx,) = [path.read_text() for path in (tmp_path / "triton_cache").rglob("*.ptx")]
    shuffled = set(re.findall(r"shfl\.sync\.bfly\.b32\s+(%r\d+)", ptx))
    fmas = re.findall(r"fma\.rn\.f32\s+%r\d+, (%r\d+), (%r\d+), (%r\d+);", ptx)
    assert shuffled and fmas  # (the pattern still reads this PTX)
    assert [fma for fma in fmas if shuffled & set(fma)] == []


@pytest.mark.parametrize("split_kv,at_once", [(8, True), (32, False)])
def test_the_last_split_merges_every_head_at_once_or_head_by_head(split_kv, at_once, load_candidate):
    # GROUP 3 (padded to 4) x SPLIT_KV x D 128 fp32 partials over 2 warps: at 8 splits 64 a
    # thread (one load of every head's), at 32 splits 256 (head by head); lengths leave some
    # splits empty
    region = make_region(2, 6, 2, 512, 128, "bfloat16")
    params = {"BLOCK_N": 16, "SPLIT_KV": split_kv, "USE_DOT": True, "num_warps": 2, "num_stages": 2}
    assert FAMILY.check(region, params, H200) is None
    assert ("offs_g = tl.arange(0, 4)" in FAMILY.render(region, params)) == at_once
    inputs = make_inputs(region, [500, 40])
    (out,) = run_candidate(load_candidate, region, params, inputs, stem=f"merge{split_kv}")
    check_close(out, reference(region, *inputs))


@pytest.mark.parametrize("split_kv,at_once", [(3, True), (6, True), (24, False)])
def test_a_split_count_that_is_no_power_of_two_merges_only_its_splits(split_kv, at_once, load_candidate):
    """Outside the space (powers of two) but rendered for sweeps (bench/v_layout_probe.py): the
    merge runs tl.arange over the next power of two; the padding's rows in the workspace belong to
    the next (sequence, kv head) or to nothing, and it is never read (SPLIT_KV chunks cover the
    length). Lengths leave splits empty and give the last active split a short share."""
    region = make_region(2, 6, 2, 512, 128, "bfloat16")
    params = {"BLOCK_N": 16, "SPLIT_KV": split_kv, "USE_DOT": True, "num_warps": 2, "num_stages": 2}
    source = FAMILY.render(region, params)
    assert "offs_s = tl.arange(0, SPLIT_KV)" not in source and ("offs_g = tl.arange(0, 4)" in source) == at_once
    module = load_candidate(source, f"split{split_kv}")
    for lengths in ([500, 40], [512, 17], [1, 300]):
        inputs = make_inputs(region, lengths, seed=split_kv)
        (out,) = module.run(*on_test_device(inputs))
        check_close(out, reference(region, *inputs))


def test_strided_cache_views(load_candidate):
    # caches kept as [B, S_max, Hkv, D] and viewed as [B, Hkv, S_max, D]; q a transpose view
    region = make_region(2, 4, 2, 64, 32)
    q, _, _, lengths = make_inputs(region, [64, 13])
    k, v = (torch.randn(2, 64, 2, 32, device=DEVICE).transpose(1, 2) for _ in "kv")
    for i, params in enumerate((SMALL, SPLIT)):
        (out,) = run_candidate(load_candidate, region, params, [q, k, v, lengths], stem=f"strided{i}")
        assert out.is_contiguous()
        check_close(out, reference(region, q, k, v, lengths))


def test_lengths_outside_the_schema_stay_in_bounds(load_candidate):
    # past S_max reads the whole cache, 0 (or negative) gives zeros: never out of bounds, no NaN
    region = make_region(3, 4, 2, 64, 32)
    q, k, v, _ = make_inputs(region, [1, 1, 1])
    lengths = torch.tensor([1000, 0, -5], dtype=torch.int32, device=DEVICE)
    for i, params in enumerate((SMALL, SPLIT)):
        (out,) = run_candidate(load_candidate, region, params, [q, k, v, lengths], stem=f"bad{i}")
        check_close(out[:1], reference(region, q[:1], k[:1], v[:1], torch.tensor([64])))
        assert out[1:].abs().max() == 0


# -- the space stays bounded and legal ---------------------------------------------------

def test_check_rejections():
    llama = make_region(1, 32, 8, 4096, 128, "bfloat16")
    ok = {"BLOCK_N": 64, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
    assert FAMILY.check(llama, ok, H200) is None
    assert "shared memory" in FAMILY.check(llama, {**ok, "BLOCK_N": 128, "num_stages": 4}, H200)
    assert "spill" in FAMILY.check(llama, {**ok, "USE_DOT": False}, H200)  # 4x64x128 products
    assert "spill" in FAMILY.check(make_region(1, 32, 8, 4096, 128), {**ok, "BLOCK_N": 64, "num_warps": 2}, H200)
    assert "without a 16-byte load" in FAMILY.check(make_region(1, 4, 4, 64, 64, "bfloat16"),
                                                    {**ok, "BLOCK_N": 16, "SPLIT_KV": 1, "num_warps": 8}, H200)
    assert "not in the space" in FAMILY.check(llama, {**ok, "SPLIT_KV": 3}, H200)
    short = make_region(1, 32, 8, 40, 128, "bfloat16")
    assert "exceeds the cache" in FAMILY.check(short, {**ok, "BLOCK_N": 128, "SPLIT_KV": 1, "num_warps": 8}, H200)
    assert FAMILY.check(short, {**ok, "SPLIT_KV": 1}, H200) is None  # 64 covers 40 keys: legal
    assert "exceed the cache" in FAMILY.check(short, {**ok, "BLOCK_N": 16, "SPLIT_KV": 4}, H200)  # 4 x 16 > 40
    assert FAMILY.check(short, {**ok, "BLOCK_N": 16, "SPLIT_KV": 2}, H200) is None


def test_space_is_bounded():
    region = make_region("B", 32, 8, 32768, 128, "bfloat16", dims={"B": (1, 64)})
    space = FAMILY.param_space(region, H200)
    assert all(len(v) <= 7 for v in space.values())
    assert 0 < len(FAMILY.legal_points(region, H200)) < 1000


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,head_dim,max_length", [(1, 8, 5), (64, 128, 4096), (8, 256, 32768), (16, 16, 16)])
def test_every_region_has_a_legal_point(dtype, heads, head_dim, max_length):
    assert FAMILY.legal_points(make_region(1, heads, 1, max_length, head_dim, dtype), H200)


def test_matches():
    assert FAMILY.matches(make_region(1, 4, 2, 64, 64))
    assert not FAMILY.matches(make_region(1, 4, 3, 64, 64))  # heads not a multiple
    assert not FAMILY.matches(make_region(1, 4, 2, 64, 512))  # head dim too large
    assert not FAMILY.matches(make_region(1, 4, 2, 64, "D", scale=0.1))  # symbolic head dim
    region = make_region(1, 4, 2, 64, 64)
    assert not FAMILY.matches(RegionSummary(region.name, region.family, region.inputs, region.outputs,
                                            attrs={**region.attrs, "lengths_bound": None}))
    two_queries = TensorSpec((1, 4, 2, 64), "float32")
    assert not FAMILY.matches(RegionSummary(region.name, region.family, (two_queries, *region.inputs[1:]),
                                            (two_queries,), attrs=region.attrs))


def test_docstring_examples():
    import doctest

    from coopt.templates import decode_attention

    result = doctest.testmod(decode_attention)
    assert result.attempted > 0 and result.failed == 0


def test_bandwidth_model():
    region = make_region(2, 32, 8, 32768, 128, "bfloat16")
    assert kv_bytes_read(region, [32768, 1]) == 32769 * 8 * 128 * 2 * 2  # K and V rows, bf16
    assert kv_bytes_read(region, [32768]) / H200.hbm_bytes_per_s == pytest.approx(32e-6, rel=0.01)


@pytest.mark.parametrize("name,params,dtype,heads", [
    ("decode_attention.py", {"BLOCK_N": 64, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 3},
     "bfloat16", 32),
    ("decode_attention_fma_fp32.py", {"BLOCK_N": 32, "SPLIT_KV": 1, "USE_DOT": False, "num_warps": 4, "num_stages": 2},
     "float32", 8),
])
def test_golden_rendering(name, params, dtype, heads, golden):
    # Llama-3-8B attention (8 kv heads, D 128) over a 32768-position cache; the MHA fp32 variant
    region = make_region("B", heads, 8, 32768, 128, dtype, dims={"B": (1, 32)})
    assert FAMILY.check(region, params, H200) is None
    golden(name, FAMILY.render(region, params))


# -- the advisor's rule ------------------------------------------------------------------

@pytest.mark.parametrize("batch,length,split", [
    (1, 32768, 16), (1, 2048, 16), (32, 2048, 1), (1, 200, 1), (4, 8192, 4),
])
def test_heuristic_fills_the_sms(batch, length, split):
    region = make_region(batch, 32, 8, 32768, 128, "bfloat16", example_length=length)
    request = AdviceRequest(region, "decode_attention", FAMILY.param_space(region, H200),
                            tuple(FAMILY.legal_points(region, H200)), H200.facts())
    best, second = HeuristicAdvisor().advise(request).ranked[:2]
    assert best["SPLIT_KV"] == split, best
    # 32 KiB K/V tiles where each SM has a program or less, 16 KiB where they share SMs
    assert best["USE_DOT"] and best["BLOCK_N"] == (128 if batch * 8 * split <= H200.num_sms else 64)
    # twice the splits is measured next, not a tile variant, for long splits (two programs per
    # SM) and for short ones that leave each SM a program or less (latency-bound); half the
    # splits where a split is one tile (two tiles a program pipeline)
    programs = batch * 8 * split
    one_tile = length // split <= best["BLOCK_N"] and split > 1
    doubled = not one_tile and (length // split >= 1024 or (programs <= H200.num_sms and length // split >= 2 * 16))
    assert (second["SPLIT_KV"] == 2 * split) == doubled, second
    assert (second["SPLIT_KV"] == split // 2) == one_tile, second


# -- Hopper compilation (no GPU needed) ---------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_covering_points_compile_for_hopper(tmp_path):
    jobs, expected = [], {}
    for dtype, heads, head_dim in (("bfloat16", 32, 128), ("float32", 8, 128), ("bfloat16", 16, 80)):
        region = make_region(2, heads, 8, "S", head_dim, dtype, dims={"S": (1, 8192)})
        inputs = make_inputs(region, [256, 100], {"S": 256})
        points = covering_points(FAMILY.legal_points(region, H200))
        for i, params in enumerate(points if head_dim == 128 else points[:1]):
            label = f"{dtype}_{heads}_{head_dim}_{i}"
            jobs.append((label, FAMILY.render(region, params), inputs))
            expected[label] = params
    # paged KV (pages of 64 through a page table; fp8 pages with per-head scales): one page
    # lookup per tile must not stop the K/V loads from pipelining
    for granularity in (None, "per-head"):
        region = paged_region(2, 32, 8, 16, 64, 8, 128, "bfloat16", granularity)
        inputs, _ = make_paged_inputs(region, [256, 100])
        params = {"BLOCK_N": 64, "SPLIT_KV": 4, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
        label = f"paged_{granularity or 'bf16'}"
        jobs.append((label, FAMILY.render(region, params), inputs))
        expected[label] = params
    # fp8 tiles widened to fp16 (TILE_FP16), the heuristic's first pick at b1 / 32768
    region = fp8_region(2, 32, 8, 256, 128, "per-head")
    params = {"BLOCK_N": 128, "SPLIT_KV": 2, "USE_DOT": True, "num_warps": 4, "num_stages": 3, "TILE_FP16": True}
    assert FAMILY.check(region, params, H200) is None
    jobs.append(("fp8_fp16_tiles", FAMILY.render(region, params), make_fp8_inputs(region, [256, 100])))
    expected["fp8_fp16_tiles"] = params
    # a split count that is no power of two (outside the space; bench/v_layout_probe.py sweeps it)
    odd_split = {**params, "BLOCK_N": 64, "SPLIT_KV": 3}
    jobs.append(("fp8_three_splits", FAMILY.render(region, odd_split), make_fp8_inputs(region, [256, 100])))
    expected["fp8_three_splits"] = odd_split
    compiled = compile_for_hopper(jobs, tmp_path)
    for label, params in expected.items():
        kernels = compiled[label]
        assert set(kernels) == {"_decode_split_kernel"}  # the splits merge in the same launch
        assert all(k["pdl"] for k in kernels.values()), f"a launch without programmatic dependent launch: {params}"
        split = kernels["_decode_split_kernel"]
        # streaming K/V is the whole cost: with stages, the loads must be asynchronous copies
        assert split["pipelined"] == (params["num_stages"] > 1), f"K/V pipelining for {label} {params}"
        assert split["shared"] <= H200.smem_per_block_bytes
    # fp8 tiles: widened to bf16 they take an f16 -> bf16 conversion per value after the pair
    # conversion from e4m3; widened to fp16 (TILE_FP16) only the pair conversion
    assert compiled["paged_per-head"]["_decode_split_kernel"]["f16_to_bf16"] > 0
    assert compiled["fp8_fp16_tiles"]["_decode_split_kernel"]["f16_to_bf16"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_fp8_tiles_of_128_keys_at_8_warps_compile_without_spills(tmp_path):
    """The register budget that admits BLOCK_N 128 over fp8 at 8 warps (80 values a thread):
    the b1 build's folded region (rope, smooth-k) with fp16 tiles and per-token scales with bf16
    tiles compile for sm_90 without spilling, and at 8 warps each thread's loop is shorter than
    at 4 (why the advisor ranks that twin among a build's first points)."""
    from test_decode_attention_kv_write import folded as folded_region
    from test_decode_attention_rope import with_rope

    base = with_rope(fp8_region(1, 32, 8, 1024, 128, "per-head"), (1, 128))
    region = folded_region(base, offsets=("k",))
    per_token = fp8_region(2, 32, 8, 1024, 128, "per-token")
    wide = {"BLOCK_N": 128, "SPLIT_KV": 2, "USE_DOT": True, "num_warps": 8, "num_stages": 3}
    jobs = [("folded_w8", region, {**wide, "TILE_FP16": True}), ("folded_w4", region, {**wide, "TILE_FP16": True, "num_warps": 4}),
            ("per_token_w8", per_token, wide)]
    for label, r, params in jobs:
        assert FAMILY.check(r, params, H200) is None, label
    compiled = compile_for_hopper([(label, FAMILY.render(r, params), placeholder_inputs(r)) for label, r, params in jobs],
                                  tmp_path, machine_code=True)
    kernels = {label: compiled[label]["_decode_split_kernel"] for label, _, _ in jobs}
    if kernels["folded_w8"].get("spill_instructions") is None:
        pytest.skip("no cuobjdump here: the SASS facts are unavailable")
    assert all(k["spill_instructions"] == 0 for k in kernels.values()), kernels
    assert kernels["folded_w8"]["loop_instructions"] < 0.7 * kernels["folded_w4"]["loop_instructions"], kernels


def placeholder_inputs(region: RegionSummary) -> list[torch.Tensor]:
    """Zeros of each input's dtype and shape (symbolic dims 4): enough to compile a launch."""
    return [torch.zeros([d if isinstance(d, int) else 4 for d in spec.shape]).to(getattr(torch, spec.dtype))
            for spec in region.inputs]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_v_words_tiles_reach_the_dot_without_byte_loads(tmp_path):
    """b1 / 32768's fp8 point with V read as words (V_WORDS): pipelined, widened by the pair
    conversion in the GPU path (inline PTX), and no shared-memory load a byte wide (the byte-wise
    gather V_WORDS replaces), no spills; paged pools alike."""
    region = fp8_region(2, 32, 8, 256, 128, "per-head")
    params = {"BLOCK_N": 128, "SPLIT_KV": 2, "USE_DOT": True, "num_warps": 4, "num_stages": 3, "TILE_FP16": True,
              "V_WORDS": True}
    paged = paged_region(2, 32, 8, 16, 64, 8, 128, "bfloat16", "per-head")
    paged_params = {**params, "BLOCK_N": 64, "SPLIT_KV": 4}
    assert FAMILY.check(region, params, H200) is None and FAMILY.check(paged, paged_params, H200) is None
    inputs = make_fp8_inputs(region, [256, 100])
    compiled = compile_for_hopper([("words", FAMILY.render(region, params), inputs),
                                   ("bytes", FAMILY.render(region, {**params, "V_WORDS": False}), inputs),
                                   ("paged", FAMILY.render(paged, paged_params), make_paged_inputs(paged, [256, 100])[0])],
                                  tmp_path, machine_code=True)
    for label in ("words", "paged"):
        kernel = compiled[label]["_decode_split_kernel"]
        assert kernel["pipelined"] and kernel["pdl"] and kernel["f16_to_bf16"] == 0, label
        if kernel.get("loop_byte_shared_loads") is not None:  # the SASS, where cuobjdump runs
            assert kernel["loop_byte_shared_loads"] == 0 and kernel["spill_instructions"] == 0, (label, kernel)
    # what V_WORDS removes (Triton 3.6 / 3.9): the same point with V loaded as bytes gathers it
    # byte by byte in its loop (V_WORDS measured slower on the H200 all the same: docs/kv-cache.md)
    if compiled["bytes"]["_decode_split_kernel"].get("loop_byte_shared_loads") is not None:
        assert compiled["bytes"]["_decode_split_kernel"]["loop_byte_shared_loads"] >= 64



# -- an fp8 KV cache (docs/kv-cache.md): float8_e4m3fn K/V read as k * k_scale ---------------

GRANULARITIES = ("per-tensor", "per-head", "per-token")
E4M3_MAX = 448.0
# GQA group 4, D 64: legal for fp32 and bf16 queries (the fp32 tl.dot budget is the tightest)
FP8_FMA = {"BLOCK_N": 16, "SPLIT_KV": 1, "USE_DOT": False, "num_warps": 4, "num_stages": 2}
FP8_DOT = {"BLOCK_N": 16, "SPLIT_KV": 4, "USE_DOT": True, "num_warps": 4, "num_stages": 3}


def scale_shape(granularity: str, cache_shape) -> tuple:
    return {"per-tensor": (1,), "per-head": (cache_shape[1],), "per-token": tuple(cache_shape[:3])}[granularity]


def fp8_region(batch, heads, kv_heads, max_length, head_dim, granularity, dtype="bfloat16", dims=None,
               cache_dtype="float8_e4m3fn", scale_dtype="float32", scale_shapes=None,
               example_length=None) -> RegionSummary:
    """decode_attention over an fp8 cache: inputs q, k_cache, v_cache, lengths, k_scale, v_scale."""
    base = make_region(batch, heads, kv_heads, max_length, head_dim, dtype, dims=dims, example_length=example_length)
    cache = TensorSpec(base.inputs[1].shape, cache_dtype)
    shapes = scale_shapes or [scale_shape(granularity, cache.shape)] * 2
    scales = tuple(TensorSpec(shape, scale_dtype) for shape in shapes)
    return RegionSummary(base.name, base.family, (base.inputs[0], cache, cache, base.inputs[3], *scales),
                         base.outputs, attrs={**base.attrs, "kv_scale": granularity}, dims=base.dims)


def fp8_cache(shape, gen, zero_head=None):
    """What the fp8-kv-cache pass stores: values filling e4m3's range, some exactly +-448, one head
    (sequence, kv head) all zeros when asked. Rounded by torch (Triton's interpreter rounds to fp8
    wrongly; the kernels only read fp8)."""
    values = (torch.randn(shape, generator=gen) * 112).clamp(-E4M3_MAX, E4M3_MAX)
    flat = values.view(-1)
    outliers = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=gen)
    flat[outliers] = E4M3_MAX * (torch.randint(0, 2, outliers.shape, generator=gen) * 2 - 1).float()
    if zero_head is not None:
        values[zero_head] = 0.0
    return values.to(torch.float8_e4m3fn)


def make_fp8_inputs(region: RegionSummary, lengths, concrete: dict | None = None, seed: int = 0, zero_head=(0, 1)):
    """q a transpose view (as make_inputs), fp8 caches, positive scales of ~1/112: the
    dequantized cache is ~N(0, 1) with outliers at ~4."""
    gen = torch.Generator().manual_seed(seed)
    q = make_inputs(region, lengths, concrete, seed)[0]
    shape = region.inputs[1].concrete(concrete or {})
    k, v = (fp8_cache(shape, gen, zero_head).to(DEVICE) for _ in "kv")
    k_scale, v_scale = ((torch.rand(region.inputs[i].concrete(concrete or {}), generator=gen) + 0.5).div(112).to(DEVICE)
                        for i in (4, 5))
    return [q, k, v, torch.tensor(lengths, dtype=torch.int32, device=DEVICE), k_scale, v_scale]


def dequantize(cache, scale, granularity: str, dtype) -> torch.Tensor:
    """The region's reference (codegen): k.float() * s, s broadcast by granularity, in q's dtype."""
    broadcast = {"per-tensor": (1, 1, 1, 1), "per-head": (1, -1, 1, 1), "per-token": (*scale.shape, 1)}
    return (cache.float() * scale.reshape(broadcast[granularity])).to(dtype)


def fp8_reference(region: RegionSummary, q, k, v, lengths, k_scale, v_scale) -> torch.Tensor:
    """The region's reference as verification runs it for ref_hi (inputs upcast to float64, so
    "q's dtype" is float64): dequantize, then SDPA over each sequence's valid prefix (sliced: a
    NaN past the length must not reach the reference), kv heads repeated."""
    granularity = region.attrs["kv_scale"]
    k, v = (dequantize(c, s.double(), granularity, torch.float64) for c, s in ((k, k_scale), (v, v_scale)))
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b, length in enumerate(lengths.tolist()):
        keys, values = (t[b : b + 1, :, :length].repeat_interleave(group, 1) for t in (k, v))
        out[b] = F.scaled_dot_product_attention(q[b : b + 1].double(), keys, values, scale=region.attrs["scale"])[0]
    return out.float()


FP8_LENGTHS = {name: LENGTHS[name] for name in ("one", "seven", "block edges", "two blocks", "max", "mixed")}


@pytest.mark.parametrize("case", FP8_LENGTHS)
@pytest.mark.parametrize("params", [FP8_FMA, FP8_DOT], ids=["fma", "dot-four-splits"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_cache_lengths(case, params, granularity, load_candidate):
    # GQA group 4; sequence 0's kv head 1 is all zeros, outliers at +-448 everywhere else
    region = fp8_region(3, 8, 2, 80, 64, granularity)
    inputs = make_fp8_inputs(region, FP8_LENGTHS[case])
    (out,) = run_candidate(load_candidate, region, params, inputs)
    assert out.dtype == torch.bfloat16
    check_close(out, fp8_reference(region, *inputs))


@pytest.mark.parametrize("params", [FP8_FMA, FP8_DOT], ids=["fma", "dot-four-splits"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp8_cache_under_fp32_and_fp16_queries(dtype, granularity, params, load_candidate):
    region = fp8_region(3, 8, 2, 80, 64, granularity, dtype)
    inputs = make_fp8_inputs(region, LENGTHS["mixed"], seed=1)
    (out,) = run_candidate(load_candidate, region, params, inputs)
    assert out.dtype == DTYPES[dtype]
    check_close(out, fp8_reference(region, *inputs))


@pytest.mark.parametrize("heads,kv_heads,use_dot", [(4, 4, False), (4, 4, True), (8, 1, True)],
                         ids=["mha-fma", "mha-dot", "gqa8-dot"])  # no FMA tile is legal for 8 x 32
def test_fp8_cache_heads(heads, kv_heads, use_dot, load_candidate):
    region = fp8_region(2, heads, kv_heads, 48, 32, "per-token")
    inputs = make_fp8_inputs(region, [48, 21], zero_head=(1, 0))
    params = {**FP8_FMA, "USE_DOT": use_dot, "SPLIT_KV": 2, "num_warps": 2}
    (out,) = run_candidate(load_candidate, region, params, inputs)
    check_close(out, fp8_reference(region, *inputs))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_all_zero_heads_and_saturated_caches(granularity, load_candidate):
    # every kv head of sequence 0 zero (uniform softmax over zero values: zeros), sequence 1's
    # caches all at +-448 with the largest scales: no overflow, no NaN
    region = fp8_region(2, 4, 2, 40, 32, granularity)
    q, k, v, lengths, k_scale, v_scale = make_fp8_inputs(region, [40, 33], seed=2)
    k[0], v[0] = 0.0, 0.0
    signs = torch.randint(0, 2, k[1].shape, generator=torch.Generator().manual_seed(3)).float() * 2 - 1
    k[1], v[1] = (signs * E4M3_MAX).to(torch.float8_e4m3fn).to(DEVICE), (-signs * E4M3_MAX).to(torch.float8_e4m3fn).to(DEVICE)
    inputs = [q, k, v, lengths, k_scale, v_scale]
    for i, params in enumerate(({**FP8_FMA, "num_warps": 2}, {**FP8_DOT, "SPLIT_KV": 2, "num_warps": 2})):
        (out,) = run_candidate(load_candidate, region, params, inputs, stem=f"zero{i}")
        assert out[0].abs().max() == 0 and torch.isfinite(out.float()).all()
        check_close(out, fp8_reference(region, *inputs))


# TILE_FP16: e4m3 tiles widened to fp16, q rescaled into fp16's range by a power of two
FP8_FP16_DOT = {**FP8_DOT, "TILE_FP16": True}


# V_WORDS: V's tiles read as 16-bit words of two e4m3 values, widened to fp16 as they load
FP8_V_WORDS = {**FP8_FP16_DOT, "V_WORDS": True}


@pytest.mark.parametrize("case", FP8_LENGTHS)
@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
@pytest.mark.parametrize("params", [FP8_FP16_DOT, FP8_V_WORDS], ids=["fp16-tiles", "v-words"])
def test_fp8_fp16_tiles_lengths(params, case, granularity, load_candidate):
    region = fp8_region(3, 8, 2, 80, 64, granularity)
    inputs = make_fp8_inputs(region, FP8_LENGTHS[case])
    (out,) = run_candidate(load_candidate, region, params, inputs)
    assert out.dtype == torch.bfloat16
    check_close(out, fp8_reference(region, *inputs))


@pytest.mark.parametrize("magnitude", [1e-6, 3e4, 1e9])
def test_fp8_fp16_tiles_queries_outside_fp16(magnitude, load_candidate):
    # |q| up to ~4e9 (fp16 overflows at 65504) or ~4e-6 (fp16 subnormal): the power-of-two
    # shift keeps q's bits; the scores' scale comes back through the softmax scale
    region = fp8_region(2, 8, 2, 64, 64, "per-head")
    q, *rest = make_fp8_inputs(region, [64, 37], seed=4)
    region = RegionSummary(**{**region.__dict__, "attrs": {**region.attrs, "scale": 0.125 / magnitude}})
    inputs = [(q.float() * magnitude).to(q.dtype), *rest]
    (out,) = run_candidate(load_candidate, region, {**FP8_FP16_DOT, "SPLIT_KV": 2}, inputs, stem=f"fp16q{magnitude:g}")
    assert torch.isfinite(out.float()).all()
    check_close(out, fp8_reference(region, *inputs))


def test_fp8_v_words_reads_every_byte_of_a_word_in_place(load_candidate):
    """Each e4m3 value of V at its own column: V's even and odd columns (the two bytes of a word)
    told apart, and a strided cache (rows [B, S, Hkv, D] viewed [B, Hkv, S, D]) read through its
    strides in words. One valid key: the output is its V row, times the scale."""
    region = fp8_region(2, 8, 2, 64, 64, "per-head")
    q, k, v, lengths, k_scale, v_scale = make_fp8_inputs(region, [1, 40], seed=3)
    ramp = torch.linspace(-448, 448, 64).to(torch.float8_e4m3fn).to(DEVICE)  # distinct, signed, both bytes
    v[0, :, 0] = ramp
    k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    inputs = [q, k, v, lengths, k_scale, v_scale]
    (out,) = run_candidate(load_candidate, region, {**FP8_V_WORDS, "SPLIT_KV": 2, "num_warps": 2}, inputs)
    expected = (ramp.float()[None, :] * v_scale[:, None]).repeat_interleave(4, dim=0)  # [H, D]
    torch.testing.assert_close(out[0, :, 0].float(), expected, rtol=8e-3, atol=1e-6)
    check_close(out, fp8_reference(region, *inputs))


def test_fp8_v_words_only_where_they_apply():
    per_head = fp8_region(1, 8, 2, 64, 64, "per-head")
    assert FAMILY.param_space(per_head, H200)["V_WORDS"] == [False, True]
    assert FAMILY.check(per_head, FP8_V_WORDS, H200) is None
    assert "TILE_FP16=True" in FAMILY.check(per_head, {**FP8_DOT, "V_WORDS": True}, H200)
    for region in (fp8_region(1, 8, 2, 64, 80, "per-head"), fp8_region(1, 8, 2, 64, 64, "per-token"),
                   make_region(1, 8, 2, 64, 64, "bfloat16")):
        assert "V_WORDS" not in FAMILY.param_space(region, H200)
        assert FAMILY.check(region, FP8_V_WORDS, H200) is not None
    # V's fp16 tile staged in shared memory counts
    big = {**FP8_V_WORDS, "BLOCK_N": 128, "num_stages": 4}
    region = fp8_region(1, 32, 8, 4096, 128, "per-head")
    assert FAMILY.check(region, {**big, "V_WORDS": False}, H200) is None
    assert FAMILY.check(region, big, H200) is None or "shared memory" in FAMILY.check(region, big, H200)


def test_fp8_fp16_tiles_only_where_they_apply():
    first = {**FP8_FP16_DOT}
    per_head = fp8_region(1, 8, 2, 64, 64, "per-head")
    assert FAMILY.param_space(per_head, H200)["TILE_FP16"] == [False, True]
    assert FAMILY.check(per_head, first, H200) is None
    assert "USE_DOT" in FAMILY.check(per_head, {**first, "USE_DOT": False}, H200)
    for region in (fp8_region(1, 8, 2, 64, 64, "per-token"), fp8_region(1, 8, 2, 64, 64, "per-head", "float16"),
                   make_region(1, 8, 2, 64, 64, "bfloat16")):
        assert "TILE_FP16" not in FAMILY.param_space(region, H200)
        assert "TILE_FP16 is for" in FAMILY.check(region, first, H200)
    # a point from before the knob (selection.json, advice.json) still checks and renders
    assert FAMILY.check(per_head, FP8_DOT, H200) is None and "def run(" in FAMILY.render(per_head, FP8_DOT)


def test_fp8_reads_only_the_valid_prefix(load_candidate):
    # NaN (e4m3fn 0x7f) in the caches and in the per-token scales past each length
    region = fp8_region(2, 4, 2, 128, 32, "per-token")
    q, k, v, lengths, k_scale, v_scale = make_fp8_inputs(region, [20, 100])
    for b, length in enumerate(lengths.tolist()):
        for t in (k, v):
            t.view(torch.uint8)[b, :, length:] = 0x7F
        k_scale[b, :, length:] = float("nan")
        v_scale[b, :, length:] = float("nan")
    inputs = [q, k, v, lengths, k_scale, v_scale]
    for split_kv in (1, 8):
        params = {**FP8_DOT, "SPLIT_KV": split_kv, "num_warps": 2}
        (out,) = run_candidate(load_candidate, region, params, inputs, stem=f"fp8nan{split_kv}")
        check_close(out, fp8_reference(region, *inputs))


def test_fp8_strided_scales_and_caches(load_candidate):
    # per-token scale buffers and caches kept [B, S_max, Hkv, ...] and viewed as [B, Hkv, S_max, ...]
    region = fp8_region(2, 4, 2, 64, 32, "per-token")
    q, k, v, lengths, _, _ = make_fp8_inputs(region, [64, 13])
    k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    k_scale, v_scale = (torch.rand(2, 64, 2, device=DEVICE).add(0.5).div(112).transpose(1, 2) for _ in "kv")
    inputs = [q, k, v, lengths, k_scale, v_scale]
    (out,) = run_candidate(load_candidate, region, {**FP8_DOT, "num_warps": 2}, inputs)
    check_close(out, fp8_reference(region, *inputs))


def test_fp8_matches_and_check_accept_exactly_the_contract():
    legal = {granularity: fp8_region(1, 4, 2, 64, 64, granularity) for granularity in GRANULARITIES}
    for region in legal.values():
        assert FAMILY.matches(region) and FAMILY.check(region, FP8_FMA, H200) is None
    plain = make_region(1, 4, 2, 64, 64, "bfloat16")
    per_head = legal["per-head"]
    illegal = {
        # an fp8 cache without its scales, and scales without "kv_scale"
        "no scales": RegionSummary("r", "decode_attention", per_head.inputs[:4], per_head.outputs, per_head.attrs),
        "no kv_scale": RegionSummary("r", "decode_attention", per_head.inputs, per_head.outputs, plain.attrs),
        "fp8 without kv_scale": RegionSummary("r", "decode_attention", per_head.inputs[:4], per_head.outputs,
                                              plain.attrs),
        "bf16 cache with scales": fp8_region(1, 4, 2, 64, 64, "per-head", cache_dtype="bfloat16"),
        "e5m2": fp8_region(1, 4, 2, 64, 64, "per-head", cache_dtype="float8_e5m2"),
        "bf16 scales": fp8_region(1, 4, 2, 64, 64, "per-head", scale_dtype="bfloat16"),
        "unknown granularity": fp8_region(1, 4, 2, 64, 64, "per-channel", scale_shapes=[(2,), (2,)]),
        "per-head shaped per-tensor": fp8_region(1, 4, 2, 64, 64, "per-head", scale_shapes=[(1,), (1,)]),
        "per-tensor shaped per-head": fp8_region(1, 4, 2, 64, 64, "per-tensor", scale_shapes=[(2,), (2,)]),
        "per-token without positions": fp8_region(1, 4, 2, 64, 64, "per-token", scale_shapes=[(1, 2), (1, 2)]),
        "per-token v of another cache": fp8_region(1, 4, 2, 64, 64, "per-token", scale_shapes=[(1, 2, 64), (1, 2, 32)]),
        "fp8 query": RegionSummary("r", "decode_attention", (TensorSpec((1, 4, 1, 64), "float8_e4m3fn"),
                                                             *per_head.inputs[1:]), per_head.outputs, per_head.attrs),
    }
    for name, region in illegal.items():
        assert not FAMILY.matches(region), name
    for name in ("no kv_scale", "bf16 cache with scales", "e5m2", "bf16 scales", "unknown granularity",
                 "per-head shaped per-tensor", "per-tensor shaped per-head", "per-token without positions"):
        assert FAMILY.check(illegal[name], FP8_FMA, H200) is not None, name
    assert "k_scale, v_scale" in FAMILY.check(illegal["no scales"], FP8_FMA, H200)
    assert "is not per-head" in FAMILY.check(illegal["per-head shaped per-tensor"], FP8_FMA, H200)


def test_fp8_register_and_shared_memory_rules():
    llama = fp8_region(1, 32, 8, 4096, 128, "per-token")
    ok = {"BLOCK_N": 128, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 4}
    # 1-byte stages: BLOCK_N 128 x 4 stages fit in shared memory (bf16 would not)
    assert FAMILY.check(llama, ok, H200) is None
    assert "shared memory" in FAMILY.check(make_region(1, 32, 8, 4096, 128, "bfloat16"), ok, H200)
    # widening fp8 tiles costs registers: BLOCK_N 128 at 8 warps fits at D 128 (compiled without
    # spills: test_fp8_tiles_of_128_keys_at_8_warps_compile_without_spills), not at D 256
    assert FAMILY.check(llama, {**ok, "num_warps": 8}, H200) is None
    wide = fp8_region(1, 32, 8, 4096, 256, "per-token")
    assert "fp8 K/V tiles over 8 warps spills" in FAMILY.check(wide, {**ok, "num_warps": 8, "num_stages": 2}, H200)
    assert FAMILY.check(make_region(1, 32, 8, 4096, 128, "bfloat16"), {**ok, "num_warps": 8, "num_stages": 3}, H200) is None
    # fp32 queries: tl.dot on widened tiles only at 16 keys over 8 warps
    fp32 = fp8_region(1, 32, 8, 4096, 128, "per-head", "float32")
    small = {"BLOCK_N": 16, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 8, "num_stages": 3}
    assert FAMILY.check(fp32, small, H200) is None
    assert "spills" in FAMILY.check(fp32, {**small, "BLOCK_N": 32}, H200)
    assert "spills" in FAMILY.check(fp32, {**small, "num_warps": 4}, H200)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_every_region_has_a_legal_point(dtype, granularity):
    for heads, head_dim, max_length in ((1, 8, 5), (32, 128, 4096), (8, 64, 32768), (16, 16, 16)):
        region = fp8_region(1, heads, 1 if heads < 32 else 8, max_length, head_dim, granularity, dtype)
        assert FAMILY.legal_points(region, H200), (heads, head_dim, max_length)


def test_fp8_bandwidth_model():
    per_head = fp8_region(2, 32, 8, 32768, 128, "per-head")
    per_token = fp8_region(2, 32, 8, 32768, 128, "per-token")
    assert kv_bytes_read(per_head, [32768, 1]) == 32769 * 8 * 128 * 2  # 1-byte K and V rows
    assert kv_bytes_read(per_token, [32768, 1]) == 32769 * 8 * (128 + 4) * 2  # and a scale per row
    assert kv_bytes_read(per_head, [32768]) * 2 == kv_bytes_read(make_region(2, 32, 8, 32768, 128, "bfloat16"), [32768])


def test_fp8_heuristic_takes_twice_the_keys_per_tile():
    # the same ~16 KiB per K tile: BLOCK_N 128 of 1-byte rows where bf16 takes 64
    region = fp8_region(1, 32, 8, 32768, 128, "per-head", example_length=32768)
    request = AdviceRequest(region, "decode_attention", FAMILY.param_space(region, H200),
                            tuple(FAMILY.legal_points(region, H200)), H200.facts())
    ranked = HeuristicAdvisor().advise(request).ranked
    best, second = ranked[:2]
    assert best["BLOCK_N"] == 128 and best["USE_DOT"] and best["SPLIT_KV"] == 16, best
    assert FAMILY.check(region, best, H200) is None
    # a build measures the top 4: all fp16-widened (the bf16-widened form is slower and rounds q
    # to 8 bits, session 19), at 4 warps (8 measured slower at every point, session 21), twice
    # the splits second; V read as words (measured slower on the H200, session 17) not among them
    assert all(p["TILE_FP16"] for p in ranked[:4]), ranked[:4]
    assert all(p["num_warps"] == 4 for p in ranked[:4]), ranked[:4]
    assert second == {**best, "SPLIT_KV": 32}, second
    assert all(FAMILY.check(region, p, H200) is None for p in ranked[:4])
    assert not any(p["V_WORDS"] for p in ranked[:4])


def test_fp8_heuristic_keeps_multiply_and_sum_first_for_small_groups():
    # two query heads a kv head (the accuracy harness's model): tensor cores would pad them to 16
    # rows, so multiply-and-sum first; the bf16-widened tiles' last place applies to tl.dot points
    # only (session 19 had it put the fp16-tile dot first here)
    region = fp8_region(1, 4, 2, 256, 16, "per-head", example_length=200)
    assert FAMILY.param_space(region, H200)["TILE_FP16"] == [False, True]
    request = AdviceRequest(region, "decode_attention", FAMILY.param_space(region, H200),
                            tuple(FAMILY.legal_points(region, H200)), H200.facts())
    best = HeuristicAdvisor().advise(request).ranked[0]
    assert not best["USE_DOT"] and not best["TILE_FP16"], best


def test_fp8_golden_rendering(golden):
    region = fp8_region("B", 32, 8, 32768, 128, "per-token", dims={"B": (1, 32)})
    params = {"BLOCK_N": 128, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
    assert FAMILY.check(region, params, H200) is None
    golden("decode_attention_fp8_per_token.py", FAMILY.render(region, params))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_fp8_covering_points_compile_for_hopper(tmp_path):
    jobs, expected = [], {}
    for dtype, granularity in (("bfloat16", "per-token"), ("bfloat16", "per-head"), ("float32", "per-tensor")):
        region = fp8_region(2, 32, 8, "S", 128, granularity, dtype, dims={"S": (1, 8192)})
        inputs = make_fp8_inputs(region, [256, 100], {"S": 256})
        points = covering_points(FAMILY.legal_points(region, H200))
        for i, params in enumerate(points if granularity == "per-token" else points[:2]):
            label = f"{dtype}_{granularity}_{i}"
            jobs.append((label, FAMILY.render(region, params), inputs))
            expected[label] = params
    compiled = compile_for_hopper(jobs, tmp_path)
    for label, params in expected.items():
        split = compiled[label]["_decode_split_kernel"]
        assert split["pipelined"] == (params["num_stages"] > 1), f"fp8 K/V pipelining for {label} {params}"
        assert split["shared"] <= H200.smem_per_block_bytes


# -- paged KV (issue 4): pages [N_pages, Hkv, P, D] read through a page table ---------------

PAGED_FMA = {"BLOCK_N": 16, "SPLIT_KV": 1, "USE_DOT": False, "num_warps": 2, "num_stages": 2}
PAGED_DOT = {"BLOCK_N": 16, "SPLIT_KV": 4, "USE_DOT": True, "num_warps": 2, "num_stages": 3}
# tiles over several whole pages (each key row finds its page): 2 pages of 16 a tile and two
# splits; 4 pages of 16 (2 of 32) a tile
PAGED_TWO_PAGES = {"BLOCK_N": 32, "SPLIT_KV": 2, "USE_DOT": True, "num_warps": 2, "num_stages": 2}
PAGED_FOUR_PAGES = {"BLOCK_N": 64, "SPLIT_KV": 1, "USE_DOT": True, "num_warps": 2, "num_stages": 2}


def paged_region(batch, heads, kv_heads, num_pages, page_size, max_pages, head_dim, dtype="float32",
                 granularity=None, cache_dtype=None, table_dtype="int32", dims=None,
                 example_length=None) -> RegionSummary:
    """decode_attention through a page table: q, k_pages, v_pages, lengths, page_table[, k_scale, v_scale]."""
    base = make_region(batch, heads, kv_heads, 1, head_dim, dtype, dims=dims, example_length=example_length)
    pages = TensorSpec((num_pages, kv_heads, page_size, head_dim),
                       cache_dtype or ("float8_e4m3fn" if granularity else dtype))
    inputs = (base.inputs[0], pages, pages, base.inputs[3], TensorSpec((batch, max_pages), table_dtype))
    attrs = {**base.attrs, "page_size": page_size}
    if granularity:
        inputs += (TensorSpec(scale_shape(granularity, pages.shape), "float32"),) * 2
        attrs["kv_scale"] = granularity
    return RegionSummary("decode_attn", "decode_attention", inputs, base.outputs, attrs=attrs, dims=base.dims)


def make_paged_inputs(region: RegionSummary, lengths, seed: int = 0):
    """Pages of all sequences interleaved in a shuffled pool (sequence b's i-th page is drawn in
    turn with the others'); free pages and the slots past each length hold NaN, so any read of
    them poisons the output. Returns the kernel's inputs and the sequences' contiguous caches
    [B, Hkv, max_pages * P, D] (for the reference)."""
    gen = torch.Generator().manual_seed(seed)
    q = make_inputs(make_region(*region.inputs[0].shape[:2], 1, 1, region.inputs[0].shape[3],
                                region.inputs[0].dtype), lengths, seed=seed)[0]
    num_pages, kv_heads, size, head_dim = region.inputs[1].shape
    batch, max_pages = region.inputs[4].shape
    fp8 = region.inputs[1].dtype == "float8_e4m3fn"
    dtype = torch.float8_e4m3fn if fp8 else DTYPES[region.inputs[1].dtype]
    full = (batch, kv_heads, max_pages * size, head_dim)
    caches = [fp8_cache(full, gen) if fp8 else torch.randn(full, generator=gen).to(dtype) for _ in "kv"]
    for cache in caches:
        for b, length in enumerate(lengths):
            if fp8:
                cache.view(torch.uint8)[b, :, length:] = 0x7F  # e4m3fn NaN
            else:
                cache[b, :, length:] = float("nan")
    pool, table = lay_out_in_pages(caches, [-(-n // size) for n in lengths], num_pages, size, gen)
    inputs = [q, *(p.to(DEVICE) for p in pool), torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
              table.to(DEVICE)]
    if fp8:
        inputs += [(torch.rand(region.inputs[i].shape, generator=gen) + 0.5).div(112).to(DEVICE) for i in (5, 6)]
    return inputs, [c.to(DEVICE) for c in caches]


PAGED_CASES = {  # page size, lengths
    "one": (16, [1, 1, 1]),
    "page edges": (16, [15, 16, 17]),
    "exact pages": (32, [32, 64, 96]),
    "two tiles a page": (32, [31, 33, 65]),
    "mixed": (32, [1, 70, 33]),
}


@pytest.mark.parametrize("case", PAGED_CASES)
@pytest.mark.parametrize("params", [PAGED_FMA, PAGED_DOT, PAGED_TWO_PAGES, PAGED_FOUR_PAGES],
                         ids=["fma", "dot-four-splits", "tile-of-pages-split", "tile-of-pages"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_lengths(case, params, dtype, load_candidate):
    # GQA group 4, pages of three sequences shuffled and interleaved in a pool with free pages
    size, lengths = PAGED_CASES[case]
    max_pages = max(4, -(-max(lengths) // size) + 1)  # four splits of 16 fit the table
    region = paged_region(3, 8, 2, 3 * max_pages + 2, size, max_pages, 32, dtype)
    inputs, (k, v) = make_paged_inputs(region, lengths)
    (out,) = run_candidate(load_candidate, region, params, inputs)
    assert out.dtype == DTYPES[dtype]
    check_close(out, reference(region, inputs[0], k, v, inputs[3]))


@pytest.mark.parametrize("heads,kv_heads,use_dot", [(4, 4, False), (8, 1, True)], ids=["mha-fma", "gqa8-dot"])
def test_paged_heads(heads, kv_heads, use_dot, load_candidate):
    region = paged_region(2, heads, kv_heads, 9, 64, 4, 32)
    inputs, (k, v) = make_paged_inputs(region, [200, 64], seed=1)
    params = {**PAGED_FMA, "BLOCK_N": 32, "USE_DOT": use_dot, "SPLIT_KV": 2, "num_warps": 2}
    (out,) = run_candidate(load_candidate, region, params, inputs)
    check_close(out, reference(region, inputs[0], k, v, inputs[3]))


@pytest.mark.parametrize("params", [PAGED_FMA, PAGED_DOT, {**PAGED_DOT, "TILE_FP16": True},
                                    {**PAGED_FOUR_PAGES, "TILE_FP16": True},
                                    {**PAGED_DOT, "TILE_FP16": True, "V_WORDS": True},
                                    {**PAGED_FOUR_PAGES, "TILE_FP16": True, "V_WORDS": True}],
                         ids=["fma", "dot-four-splits", "dot-fp16-tiles", "fp16-tiles-of-pages", "dot-v-words",
                              "v-words-tiles-of-pages"])
@pytest.mark.parametrize("granularity", ["per-head", "per-tensor"])
def test_paged_fp8(granularity, params, load_candidate):
    region = paged_region(3, 8, 2, 12, 16, 4, 64, "bfloat16", granularity)
    inputs, (k, v) = make_paged_inputs(region, [1, 50, 33], seed=2)
    (out,) = run_candidate(load_candidate, region, {**params, "num_warps": 4}, inputs)  # D 64
    assert out.dtype == torch.bfloat16
    check_close(out, fp8_reference(region, inputs[0], k, v, inputs[3], *inputs[5:]))


@pytest.mark.parametrize("params", [PAGED_DOT, {**PAGED_FOUR_PAGES, "BLOCK_N": 32}], ids=["tile-in-a-page", "tile-of-pages"])
@pytest.mark.parametrize("granularity", [None, "per-head", "per-token"], ids=["bf16", "fp8-per-head", "fp8-per-token"])
def test_paged_kernel_reads_the_runtime_pool(granularity, params, load_candidate):
    # coopt.runtime.paged: sequences added, grown in turns and one released, then a decode step
    # (per-token: each row's scale in the pool's scale pages, read through the same table)
    from coopt.runtime.paged import PagedKVCache

    gen = torch.Generator().manual_seed(4)
    fp8 = granularity is not None
    scales = {"k_scale": torch.tensor([0.01, 0.02]), "v_scale": torch.tensor([0.03, 0.01])} \
        if granularity == "per-head" else {"granularity": "per-token"} if fp8 else {}
    cache = PagedKVCache(num_layers=1, num_pages=16, num_kv_heads=2, page_size=16, head_dim=32,
                         dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=DEVICE, **scales)
    seqs = [cache.add_sequence(n) for n in (5, 17, 40)]
    for seq in seqs:
        n = cache.lengths([seq]).item()
        cache.write(0, [seq], torch.arange(n)[None], *(torch.randn(1, 2, n, 32, generator=gen) for _ in "kv"))
    cache.release(seqs.pop(0))
    seqs.append(cache.add_sequence())
    for _ in range(12):  # decode steps: pages taken as sequences cross page boundaries
        positions = cache.step(seqs)
        cache.write(0, seqs, positions, *(torch.randn(3, 2, 1, 32, generator=gen) for _ in "kv"))
    lengths, table = cache.lengths(seqs), cache.page_table(seqs)
    region = paged_region(3, 4, 2, 16, 16, table.shape[1], 32, "bfloat16", granularity)
    q = torch.randn(3, 4, 1, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    inputs = [q, *cache.pages(0), lengths, table, *(cache.scales(0) if fp8 else ())]
    (out,) = run_candidate(load_candidate, region, params, inputs)
    k, v = (torch.zeros(3, 2, table.shape[1] * 16, 32, device=DEVICE) for _ in "kv")
    for b, seq in enumerate(seqs):
        seq_k, seq_v = cache.gather(0, seq, dequantize=True)
        k[b, :, :seq_k.shape[1]], v[b, :, :seq_v.shape[1]] = seq_k, seq_v
    check_close(out, reference(region, q, k, v, lengths))


def test_paged_matches_and_check():
    ok = paged_region(1, 32, 8, 1024, 16, 256, 128, "bfloat16")
    params = {"BLOCK_N": 16, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
    assert FAMILY.matches(ok) and FAMILY.check(ok, params, H200) is None
    # a tile lies in one page or covers whole pages (32 or 128: 2 or 8 pages of 16)
    assert all(FAMILY.check(ok, {**params, "BLOCK_N": bn}, H200) is None for bn in (32, 64, 128))
    big = paged_region(1, 32, 8, 64, 256, 16, 128, "bfloat16")
    assert FAMILY.check(big, {**params, "BLOCK_N": 64}, H200) is None  # 64 divides 256
    # the cache a page table addresses bounds the splits: 2 pages of 16
    short = paged_region(1, 32, 8, 64, 16, 2, 128, "bfloat16")
    assert "exceed the cache" in FAMILY.check(short, {**params, "SPLIT_KV": 4}, H200)
    assert FAMILY.check(short, {**params, "SPLIT_KV": 2}, H200) is None
    fp8 = paged_region(1, 32, 8, 64, 32, 16, 128, "bfloat16", "per-head")
    assert FAMILY.matches(fp8) and FAMILY.check(fp8, {**params, "BLOCK_N": 32}, H200) is None
    # per-token scales through pages: scale pools [N, Hkv, P] (tests/templates/test_paged_per_token.py)
    per_token = paged_region(1, 32, 8, 64, 32, 16, 128, "bfloat16", "per-token")
    assert FAMILY.matches(per_token) and FAMILY.check(per_token, {**params, "BLOCK_N": 32}, H200) is None
    pages = ok.inputs[1]
    illegal = {
        "page size 24": paged_region(1, 32, 8, 64, 24, 8, 128, "bfloat16"),
        "page size 512": paged_region(1, 32, 8, 64, 512, 8, 128, "bfloat16"),
        "int64 table": paged_region(1, 32, 8, 64, 16, 8, 128, "bfloat16", table_dtype="int64"),
        "no table": RegionSummary("r", "decode_attention", ok.inputs[:4], ok.outputs, ok.attrs),
        "pages of another size": RegionSummary("r", "decode_attention", (
            ok.inputs[0], TensorSpec((1024, 8, 32, 128), "bfloat16"), pages, *ok.inputs[3:]), ok.outputs, ok.attrs),
        "table of another batch": RegionSummary("r", "decode_attention", (
            *ok.inputs[:4], TensorSpec((2, 256), "int32")), ok.outputs, ok.attrs),
    }
    for name, region in illegal.items():
        assert not FAMILY.matches(region), name
        assert FAMILY.check(region, params, H200) is not None, name
    # a plain region with a fifth input is still not paged
    plain = make_region(1, 32, 8, 64, 128, "bfloat16")
    assert not FAMILY.matches(RegionSummary("r", "decode_attention", ok.inputs, ok.outputs, plain.attrs))


@pytest.mark.parametrize("size", [16, 32, 256])
def test_paged_heuristic_tiles_as_without_pages(size):
    # 32768 positions addressable, planned for all of them: small pages do not shrink the tiles
    # (a tile covers several pages), so the first point is the one a cache per sequence gets
    def first(region):
        request = AdviceRequest(region, "decode_attention", FAMILY.param_space(region, H200),
                                tuple(FAMILY.legal_points(region, H200)), H200.facts())
        return HeuristicAdvisor().advise(request).ranked[0]

    region = paged_region(1, 32, 8, 4096, size, 32768 // size, 128, "bfloat16", example_length=32768)
    best, unpaged = first(region), first(make_region(1, 32, 8, 32768, 128, "bfloat16", example_length=32768))
    assert best["BLOCK_N"] == unpaged["BLOCK_N"] == 128 and unpaged["SPLIT_KV"] == 16, (best, unpaged)
    # a tile over several pages (a page lookup per key row) gets twice the splits in flight
    assert best["SPLIT_KV"] == (32 if size < 128 else 16), best
    assert FAMILY.check(region, best, H200) is None
    # not where every SM already has more than 4 programs (96 sequences x 8 kv heads): as unpaged
    many = paged_region(96, 32, 8, 8192, 16, 256, 128, "bfloat16", example_length=1359)
    assert first(many)["SPLIT_KV"] == first(make_region(96, 32, 8, 4096, 128, "bfloat16", example_length=1359))["SPLIT_KV"]


def test_paged_bandwidth_model_counts_the_same_bytes():
    paged = paged_region(2, 32, 8, 4096, 16, 2048, 128, "bfloat16")
    assert kv_bytes_read(paged, [32768, 1]) == kv_bytes_read(make_region(2, 32, 8, 32768, 128, "bfloat16"), [32768, 1])


def values_only(region: RegionSummary, inputs: list, seed: int = 7) -> tuple[RegionSummary, list]:
    """fp8-kv-cache{values-only}'s form of an fp8 region: K in q's dtype (N(0, 1) keys, like a
    dequantized fp8 cache's), V still fp8; the scales as they were (the kernel takes any K scale)."""
    q = region.inputs[0]
    keys = TensorSpec(region.inputs[1].shape, q.dtype)
    region = dataclasses.replace(region, inputs=(q, keys, *region.inputs[2:]))
    k = torch.randn(inputs[1].shape, generator=torch.Generator().manual_seed(seed)).to(DTYPES[q.dtype]).to(DEVICE)
    return region, [inputs[0], k, *inputs[2:]]


@pytest.mark.parametrize("params", [FP8_FMA, FP8_DOT], ids=["fma", "dot-four-splits"])
@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_keys_in_the_query_dtype_beside_fp8_values(dtype, granularity, params, load_candidate):
    base = fp8_region(3, 8, 2, 80, 64, granularity, dtype)
    region, inputs = values_only(base, make_fp8_inputs(base, FP8_LENGTHS["mixed"], seed=5))
    assert FAMILY.matches(region) and FAMILY.check(region, params, H200) is None
    (out,) = run_candidate(load_candidate, region, params, inputs)
    assert out.dtype == DTYPES[dtype]
    check_close(out, fp8_reference(region, *inputs))


def test_keys_in_the_query_dtype_take_no_fp16_tiles_and_no_per_token_scales():
    region, _ = values_only(fp8_region(1, 32, 8, 4096, 128, "per-head"), [None, torch.empty(1, 8, 4096, 128)])
    assert "TILE_FP16" not in FAMILY.param_space(region, H200)
    assert "keys kept in bf16" in FAMILY.check(region, {**FP8_DOT, "BLOCK_N": 64, "TILE_FP16": True}, H200)
    per_token, _ = values_only(fp8_region(1, 32, 8, 4096, 128, "per-token"), [None, torch.empty(1, 8, 4096, 128)])
    assert not FAMILY.matches(per_token)
    # what the kernel must read: bf16 keys and fp8 values, 3 bytes a (row, channel)
    assert kv_bytes_read(region, [2048]) == 2048 * 8 * 128 * 3
