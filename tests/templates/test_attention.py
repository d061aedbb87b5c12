"""attention family: every knob value runs, masks and GQA are right, the space is bounded.

Kernels run in Triton's interpreter without a GPU (on the GPU machine, for real): shapes stay
small. The reference is eager SDPA in fp32 on the same inputs, with an explicit bottom-right
causal mask (SDPA's is_causal aligns top-left when Sq != Sk).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from template_helpers import compile_for_hopper, covering_points
from template_helpers import run_candidate as _run_candidate

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.attention import AttentionFamily

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILY = AttentionFamily()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
run_candidate = partial(_run_candidate, FAMILY, H200)
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "PACK_GQA": False, "SPLIT_KV": 1, "num_warps": 4, "num_stages": 2}


def make_region(batch, heads, kv_heads, seq_q, seq_k, head_dim, causal, dtype="float32", scale=None,
                dims=None) -> RegionSummary:
    kv = TensorSpec((batch, kv_heads, seq_k, head_dim), dtype)
    return RegionSummary(
        name="attn", family="attention",
        inputs=(TensorSpec((batch, heads, seq_q, head_dim), dtype), kv, kv),
        outputs=(TensorSpec((batch, heads, seq_q, head_dim), dtype),),
        attrs={"causal": causal, "scale": head_dim ** -0.5 if scale is None else scale,
               "num_heads": heads, "num_kv_heads": kv_heads},
        dims=dims or {},
    )


def make_inputs(region: RegionSummary, concrete: dict | None = None, seed: int = 0):
    """q as a transpose view of [B, Sq, H, D] (what a model's q projection gives), k/v contiguous."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[region.inputs[0].dtype]
    batch, heads, seq_q, head_dim = region.inputs[0].concrete(concrete or {})
    q = torch.randn(batch, seq_q, heads, head_dim, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(region.inputs[1].concrete(concrete or {}), generator=gen).to(dtype).to(DEVICE) for _ in "kv")
    return [q, k, v]


def reference(region: RegionSummary, q, k, v) -> torch.Tensor:
    seq_q, seq_k = q.shape[2], k.shape[2]
    mask = None
    if region.attrs["causal"]:
        mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(diagonal=seq_k - seq_q)
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=region.attrs["scale"])


def check_close(actual: torch.Tensor, expected: torch.Tensor):
    assert actual.shape == expected.shape and actual.device.type == DEVICE
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    else:  # bf16 inputs: p is rounded to bf16 before p @ v, and the output once more
        torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=2e-2)


# -- every knob value -------------------------------------------------------------------

# Symbolic lengths whose ranges make every tile and split legal; run at small lengths.
COVERAGE_REGION = {
    dtype: make_region(1, 4, 2, "Sq", "Sk", 32, True, dtype, dims={"Sq": (1, 256), "Sk": (1, 1024)})
    for dtype in ("float32", "bfloat16")
}


def test_space_values_are_all_legal_somewhere():
    for region in COVERAGE_REGION.values():
        space = FAMILY.param_space(region, H200)
        points = FAMILY.legal_points(region, H200)
        used = {(k, v) for p in points for k, v in p.items()}
        assert used == {(k, v) for k, values in space.items() for v in values}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_covering_points_match_sdpa(dtype, load_candidate):
    region = COVERAGE_REGION[dtype]
    cases = [make_inputs(region, {"Sq": 33, "Sk": 70}), make_inputs(region, {"Sq": 1, "Sk": 40}, seed=1)]
    for i, params in enumerate(covering_points(FAMILY.legal_points(region, H200))):
        for q, k, v in cases:
            (out,) = run_candidate(load_candidate, region, params, [q, k, v], stem=f"cover_{dtype}_{i}")
            check_close(out, reference(region, q, k, v))


# -- masks, lengths, heads --------------------------------------------------------------

@pytest.mark.parametrize("causal,seq_q,seq_k", [
    (True, 33, 33), (True, 7, 33), (True, 1, 33), (False, 1, 7), (False, 33, 7), (False, 7, 1),
])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lengths_and_heads(causal, seq_q, seq_k, heads, kv_heads, dtype, load_candidate):
    region = make_region(2, heads, kv_heads, seq_q, seq_k, 16, causal, dtype)
    q, k, v = make_inputs(region)
    (out,) = run_candidate(load_candidate, region, SMALL, [q, k, v])
    check_close(out, reference(region, q, k, v))


@pytest.mark.parametrize("pack,split", [(True, 1), (False, 4), (True, 4)])
def test_decode_packing_and_split_kv(pack, split, load_candidate):
    region = make_region(2, 8, 2, 1, 150, 32, True)  # GQA group of 4, one new token
    q, k, v = make_inputs(region)
    params = {**SMALL, "PACK_GQA": pack, "SPLIT_KV": split}
    (out,) = run_candidate(load_candidate, region, params, [q, k, v])
    check_close(out, reference(region, q, k, v))


def test_packed_causal_prefill_with_splits(load_candidate):
    # packed rows of one program span several positions: the causal bounds come from them
    region = make_region(1, 4, 1, 9, 70, 16, True)
    q, k, v = make_inputs(region)
    params = {**SMALL, "BLOCK_M": 32, "PACK_GQA": True, "SPLIT_KV": 2}
    (out,) = run_candidate(load_candidate, region, params, [q, k, v])
    check_close(out, reference(region, q, k, v))


def test_causal_query_without_keys_gets_zeros(load_candidate):
    # Sq > Sk, bottom-right: the first Sq - Sk queries see no key (SDPA returns zeros there)
    region = make_region(1, 2, 2, 9, "Sk", 16, True, dims={"Sk": (1, 64)})
    q, k, v = make_inputs(region, {"Sk": 5})  # with SPLIT_KV=2 the second split is empty
    for split in (1, 2):
        (out,) = run_candidate(load_candidate, region, {**SMALL, "SPLIT_KV": split}, [q, k, v], stem=f"s{split}")
        check_close(out, reference(region, q, k, v))
        assert out[:, :, :4].abs().max() == 0


@pytest.mark.parametrize("head_dim", [8, 24, 80])
def test_head_dim_not_a_power_of_two(head_dim, load_candidate):
    region = make_region(1, 2, 1, 7, 20, head_dim, False, scale=0.3)
    q, k, v = make_inputs(region)
    (out,) = run_candidate(load_candidate, region, {**SMALL, "PACK_GQA": True}, [q, k, v])
    check_close(out, reference(region, q, k, v))


def test_strided_cache_views(load_candidate):
    # k / v are the first Sk positions of a longer cache, q a transpose view, out written fresh
    region = make_region(2, 4, 2, 5, 21, 16, True)
    cache = torch.randn(2, 2, 2, 64, 16, device=DEVICE)
    k, v = cache[0, :, :, :21], cache[1, :, :, :21]
    q = torch.randn(2, 5, 4, 16, device=DEVICE).transpose(1, 2)
    (out,) = run_candidate(load_candidate, region, SMALL, [q, k, v])
    assert out.is_contiguous()
    check_close(out, reference(region, q, k, v))


# -- the space stays bounded and legal ---------------------------------------------------

def test_check_rejections():
    prefill = make_region(4, 32, 8, 2048, 2048, 128, True, "bfloat16")
    ok = {"BLOCK_M": 128, "BLOCK_N": 64, "PACK_GQA": False, "SPLIT_KV": 1, "num_warps": 8, "num_stages": 3}
    assert FAMILY.check(prefill, ok, H200) is None
    assert "shared memory" in FAMILY.check(prefill, {**ok, "BLOCK_N": 128, "num_stages": 4}, H200)
    assert "spill" in FAMILY.check(prefill, {**ok, "num_warps": 4}, H200)
    assert "idle" in FAMILY.check(prefill, {**ok, "BLOCK_M": 32}, H200)
    assert "fill" in FAMILY.check(prefill, {**ok, "SPLIT_KV": 2}, H200)
    decode = make_region(1, 32, 8, 1, "Sk", 128, True, "bfloat16", dims={"Sk": (1, 4096)})
    assert "exceeds the problem" in FAMILY.check(decode, ok, H200)
    packed = {**SMALL, "BLOCK_N": 64, "PACK_GQA": True}
    assert FAMILY.check(decode, {**packed, "SPLIT_KV": 16}, H200) is None
    assert "key blocks" in FAMILY.check(make_region(1, 32, 8, 1, 256, 128, True, "bfloat16"),
                                        {**packed, "SPLIT_KV": 16}, H200)
    mha = make_region(1, 4, 4, 16, 16, 64, False)
    assert FAMILY.param_space(mha, H200)["PACK_GQA"] == [False]
    assert "grouped" in FAMILY.check(mha, {**SMALL, "PACK_GQA": True}, H200)
    fp32 = make_region(1, 4, 4, 512, 512, 64, False)
    assert "spill" in FAMILY.check(fp32, {**ok, "BLOCK_M": 64, "num_warps": 4}, H200)
    many_heads = make_region(1024, 128, 128, 1, 64, 64, False, "bfloat16")
    assert "grid limit" in FAMILY.check(many_heads, SMALL, H200)


def test_space_is_bounded():
    dims = {"B": (1, 64), "Sq": (1, 4096), "Sk": (1, 4096)}
    region = make_region("B", 32, 8, "Sq", "Sk", 128, True, "bfloat16", dims=dims)
    space = FAMILY.param_space(region, H200)
    assert all(len(v) <= 5 for v in space.values())
    assert 0 < len(FAMILY.legal_points(region, H200)) < 1000


def test_matches():
    assert FAMILY.matches(make_region(1, 4, 2, 8, 8, 64, True))
    assert not FAMILY.matches(make_region(1, 4, 3, 8, 8, 64, True))  # heads not a multiple
    assert not FAMILY.matches(make_region(1, 4, 2, 8, 8, 512, True))  # head dim too large
    assert not FAMILY.matches(make_region(1, 4, 2, 8, 8, "D", True, scale=0.1))  # symbolic head dim


def test_docstring_examples():
    import doctest

    from coopt.templates import attention

    result = doctest.testmod(attention)
    assert result.attempted > 0 and result.failed == 0


def test_golden_rendering(golden):
    dims = {"B": (1, 8), "Sq": (1, 1), "Sk": (1, 4096)}
    region = make_region("B", 32, 8, "Sq", "Sk", 128, True, "bfloat16", dims=dims)
    params = {"BLOCK_M": 32, "BLOCK_N": 64, "PACK_GQA": True, "SPLIT_KV": 8, "num_warps": 4, "num_stages": 3}
    golden("attention.py", FAMILY.render(region, params))


# -- Hopper compilation (no GPU needed) ---------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_covering_points_compile_for_hopper(tmp_path):
    jobs, expected = [], {}
    for dtype in ("float32", "bfloat16"):
        for head_dim in (128, 80):  # 80: padded to 128 with masks
            region = make_region(2, 8, 2, "Sq", "Sk", head_dim, True, dtype, dims={"Sq": (1, 512), "Sk": (1, 4096)})
            inputs = make_inputs(region, {"Sq": 128, "Sk": 512})
            points = covering_points(FAMILY.legal_points(region, H200))
            for i, params in enumerate(points if head_dim == 128 else points[:1]):
                label = f"{dtype}_{head_dim}_{i}"
                jobs.append((label, FAMILY.render(region, params), inputs))
                expected[label] = (dtype, head_dim, params)
    compiled = compile_for_hopper(jobs, tmp_path)
    for label, (dtype, head_dim, params) in expected.items():
        kernels = compiled[label]
        assert set(kernels) == {"_attention_kernel"} | ({"_combine_splits_kernel"} if params["SPLIT_KV"] > 1 else set())
        assert all(k["pdl"] for k in kernels.values()), f"a launch without programmatic dependent launch: {params}"
        main = kernels["_attention_kernel"]
        if params["num_stages"] > 1 and head_dim == 128:
            assert main["pipelined"], f"K/V loads not pipelined for {label} {params}"
        if dtype == "bfloat16" and params["BLOCK_M"] >= 64:
            assert main["wgmma"], f"no wgmma for {label} {params}"


# -- a prompt over a KV cache: one key count per query position ------------------------------

def lengths_region(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype="float32", dims=None) -> RegionSummary:
    base = make_region(batch, heads, kv_heads, seq_q, seq_k, head_dim, False, dtype, dims=dims)
    return RegionSummary(
        name="prompt", family="attention",
        inputs=(*base.inputs, TensorSpec((seq_q,), "int32")), outputs=base.outputs,
        attrs={**base.attrs, "lengths_input": 3, "lengths_bound": [1, 2]}, dims=base.dims,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [
    SMALL,
    {**SMALL, "PACK_GQA": True},
    {**SMALL, "SPLIT_KV": 2, "BLOCK_N": 16},
    {**SMALL, "PACK_GQA": True, "SPLIT_KV": 2},
], ids=["plain", "pack_gqa", "split_kv", "pack+split"])
def test_query_lengths_mask_each_query_to_its_own_prefix_of_the_cache(load_candidate, params, dtype):
    """lengths [T] in any order (1, the whole cache, block boundaries), not just position + 1:
    query i attends to exactly the first lengths[i] cache positions, for every program layout."""
    region = lengths_region(2, 4, 2, 5, 70, 32, dtype)
    q, k, v = make_inputs(region, seed=3)
    lengths = torch.tensor([1, 70, 16, 33, 17], dtype=torch.int32, device=DEVICE)
    (out,) = run_candidate(load_candidate, region, params, [q, k, v, lengths])
    mask = torch.arange(70, device=DEVICE)[None, :] < lengths[:, None]
    group = 2
    expected = F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1),
        attn_mask=mask, scale=region.attrs["scale"])
    check_close(out, expected)


def test_query_lengths_regions_match_only_with_a_lengths_input():
    region = lengths_region(1, 4, 2, "T", 64, 32, dims={"T": (1, 64)})
    assert FAMILY.matches(region)
    no_lengths = RegionSummary("r", "attention", region.inputs[:3], region.outputs,
                               {k: v for k, v in region.attrs.items() if not k.startswith("lengths")})
    assert FAMILY.matches(no_lengths)
    causal_too = RegionSummary("r", "attention", region.inputs, region.outputs, {**region.attrs, "causal": True})
    assert not FAMILY.matches(causal_too)


def test_query_lengths_variant_compiles_for_hopper(compile_for_sm90):
    region = lengths_region(1, 32, 8, "T", 4096, 128, "bfloat16", dims={"T": (1, 4096)})
    q, k, v = make_inputs(region, {"T": 256})
    lengths = torch.arange(1, 257, dtype=torch.int32)
    params = [{"BLOCK_M": 128, "BLOCK_N": 64, "PACK_GQA": False, "SPLIT_KV": 1, "num_warps": 8, "num_stages": 2},
              {"BLOCK_M": 64, "BLOCK_N": 64, "PACK_GQA": True, "SPLIT_KV": 1, "num_warps": 4, "num_stages": 3}]
    compile_for_sm90([(f"p{i}", FAMILY.render(region, p), [q, k, v, lengths], "_attention_kernel")
                      for i, p in enumerate(params)])


# -- a prompt over an fp8 KV cache (docs/kv-cache.md): K/V float8_e4m3fn read as k * k_scale ----

GRANULARITIES = ("per-tensor", "per-head", "per-token")
E4M3_MAX = 448.0


def fp8_lengths_region(batch, heads, kv_heads, seq_q, seq_k, head_dim, granularity, dtype="bfloat16", dims=None,
                       scale_shapes=None, cache_dtype="float8_e4m3fn") -> RegionSummary:
    base = lengths_region(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, dims=dims)
    cache = TensorSpec(base.inputs[1].shape, cache_dtype)
    shape = {"per-tensor": (1,), "per-head": (kv_heads,), "per-token": (batch, kv_heads, seq_k)}.get(granularity)
    scales = tuple(TensorSpec(s, "float32") for s in (scale_shapes or [shape, shape]))
    return RegionSummary("prompt", "attention", (base.inputs[0], cache, cache, base.inputs[3], *scales),
                         base.outputs, {**base.attrs, "kv_scale": granularity}, dims=base.dims)


def make_fp8_inputs(region: RegionSummary, lengths, concrete=None, seed: int = 0):
    """q as make_inputs; fp8 caches filling e4m3's range with outliers at +-448 and sequence 0's
    kv head 0 all zeros (rounded by torch: the interpreter's fp8 rounding is wrong); positive scales."""
    gen = torch.Generator().manual_seed(seed)
    q = make_inputs(region, concrete, seed)[0]
    shape = region.inputs[1].concrete(concrete or {})
    caches = []
    for _ in "kv":
        values = (torch.randn(shape, generator=gen) * 112).clamp(-E4M3_MAX, E4M3_MAX)
        values.view(-1)[torch.randint(0, values.numel(), (values.numel() // 50,), generator=gen)] = E4M3_MAX
        values.view(-1)[torch.randint(0, values.numel(), (values.numel() // 50,), generator=gen)] = -E4M3_MAX
        values[0, 0] = 0.0
        caches.append(values.to(torch.float8_e4m3fn).to(DEVICE))
    scales = [(torch.rand(region.inputs[i].concrete(concrete or {}), generator=gen) + 0.5).div(112).to(DEVICE)
              for i in (4, 5)]
    return [q, *caches, torch.tensor(lengths, dtype=torch.int32, device=DEVICE), *scales]


def fp8_reference(region: RegionSummary, q, k, v, lengths, k_scale, v_scale) -> torch.Tensor:
    """The region's reference as verification's ref_hi runs it (inputs upcast to float64):
    k.float() * s (broadcast by granularity) in q's dtype, then SDPA with each query's prefix."""
    granularity = region.attrs["kv_scale"]
    broadcast = {"per-tensor": (1, 1, 1, 1), "per-head": (1, -1, 1, 1), "per-token": (*k_scale.shape, 1)}[granularity]
    k, v = ((c.float() * s.double().reshape(broadcast)).to(torch.float64) for c, s in ((k, k_scale), (v, v_scale)))
    group = q.shape[1] // k.shape[1]
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(q.double(), k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         attn_mask=mask, scale=region.attrs["scale"])
    return out.float()


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("params", [
    SMALL,
    {**SMALL, "PACK_GQA": True},
    {**SMALL, "SPLIT_KV": 2},
    {**SMALL, "PACK_GQA": True, "SPLIT_KV": 2},
], ids=["plain", "pack_gqa", "split_kv", "pack+split"])
def test_fp8_query_lengths(params, granularity, load_candidate):
    """Each query over its own prefix of an fp8 cache: 1, the whole cache, tile boundaries, odd."""
    region = fp8_lengths_region(2, 4, 2, 5, 70, 32, granularity)
    inputs = make_fp8_inputs(region, [1, 70, 16, 33, 17], seed=3)
    (out,) = run_candidate(load_candidate, region, params, inputs)
    assert out.dtype == torch.bfloat16
    check_close(out, fp8_reference(region, *inputs))


def test_fp8_query_lengths_mha_fp16_and_saturated_caches(load_candidate):
    region = fp8_lengths_region(2, 2, 2, 7, 40, 16, "per-token", "float16")
    q, k, v, lengths, k_scale, v_scale = make_fp8_inputs(region, [40, 1, 39, 17, 32, 15, 33], seed=4)
    k[1] = E4M3_MAX  # sequence 1 all at the limit: no overflow, no NaN
    v[1] = -E4M3_MAX
    inputs = [q, k, v, lengths, k_scale, v_scale]
    (out,) = run_candidate(load_candidate, region, SMALL, inputs)
    assert torch.isfinite(out.float()).all()
    check_close(out, fp8_reference(region, *inputs))


def test_fp8_only_a_prompt_over_a_cache_and_only_the_contract_matches():
    for granularity in GRANULARITIES:
        region = fp8_lengths_region(1, 4, 2, "T", 64, 32, granularity, dims={"T": (1, 64)})
        assert FAMILY.matches(region) and FAMILY.check(region, SMALL, H200) is None
    region = fp8_lengths_region(1, 4, 2, "T", 64, 32, "per-head", dims={"T": (1, 64)})
    plain_attrs = {k: v for k, v in region.attrs.items() if not k.startswith("lengths")}
    illegal = {
        "causal attention over fp8": RegionSummary("r", "attention", region.inputs[:3], region.outputs,
                                                   {**plain_attrs, "causal": True}),
        "no scales": RegionSummary("r", "attention", region.inputs[:4], region.outputs, region.attrs),
        "no kv_scale": RegionSummary("r", "attention", region.inputs, region.outputs,
                                     {k: v for k, v in region.attrs.items() if k != "kv_scale"}),
        "e5m2": fp8_lengths_region(1, 4, 2, 8, 64, 32, "per-head", cache_dtype="float8_e5m2"),
        "per-token shaped per-head": fp8_lengths_region(1, 4, 2, 8, 64, 32, "per-head", scale_shapes=[(1, 2, 64)] * 2),
        "per-head shaped per-token": fp8_lengths_region(1, 4, 2, 8, 64, 32, "per-token", scale_shapes=[(2,)] * 2),
        "unknown granularity": fp8_lengths_region(1, 4, 2, 8, 64, 32, "per-block", scale_shapes=[(1,)] * 2),
    }
    for name, candidate in illegal.items():
        assert not FAMILY.matches(candidate), name
    assert "k_scale, v_scale" in FAMILY.check(illegal["no scales"], SMALL, H200)
    assert "is not per-head" in FAMILY.check(illegal["per-token shaped per-head"], SMALL, H200)


def test_fp8_register_and_shared_memory_rules():
    region = fp8_lengths_region(1, 32, 8, "T", 4096, 128, "per-token", dims={"T": (1, 4096)})
    ok = {"BLOCK_M": 128, "BLOCK_N": 128, "PACK_GQA": False, "SPLIT_KV": 1, "num_warps": 8, "num_stages": 4}
    assert FAMILY.check(region, ok, H200) is None  # 1-byte stages: 128 KiB less than bf16's
    bf16 = lengths_region(1, 32, 8, "T", 4096, 128, "bfloat16", dims={"T": (1, 4096)})
    assert "shared memory" in FAMILY.check(bf16, ok, H200)
    small_rows = {**ok, "BLOCK_M": 32, "num_warps": 4, "num_stages": 2}  # legal for bf16
    assert FAMILY.check(bf16, small_rows, H200) is None
    assert "widening 128x128 fp8" in FAMILY.check(region, small_rows, H200)
    fp32 = fp8_lengths_region(1, 32, 8, "T", 4096, 128, "per-head", "float32", dims={"T": (1, 4096)})
    assert FAMILY.legal_points(fp32, H200) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_fp8_query_lengths_compile_for_hopper(compile_for_sm90):
    params = [{"BLOCK_M": 128, "BLOCK_N": 64, "PACK_GQA": False, "SPLIT_KV": 1, "num_warps": 8, "num_stages": 3},
              {"BLOCK_M": 16, "BLOCK_N": 64, "PACK_GQA": True, "SPLIT_KV": 1, "num_warps": 4, "num_stages": 4}]
    jobs = []
    for granularity, point in zip(GRANULARITIES, params + params[:1]):
        region = fp8_lengths_region(1, 32, 8, "T", 4096, 128, granularity, dims={"T": (1, 4096)})
        inputs = make_fp8_inputs(region, list(range(1, 257)), {"T": 256})
        assert FAMILY.check(region, point, H200) is None
        jobs.append((granularity, FAMILY.render(region, point), inputs, "_attention_kernel"))
    compile_for_sm90(jobs)


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
@pytest.mark.parametrize("params", [SMALL, {**SMALL, "PACK_GQA": True, "SPLIT_KV": 2}], ids=["plain", "packed-split"])
def test_keys_in_the_query_dtype_beside_fp8_values(params, granularity, load_candidate):
    """fp8-kv-cache{values-only}: a prompt over bf16 keys and fp8 values (K scale ones in a build;
    any positive scale here)."""
    base = fp8_lengths_region(2, 4, 2, 5, 70, 32, granularity)
    region = dataclasses.replace(base, inputs=(base.inputs[0], TensorSpec(base.inputs[1].shape, "bfloat16"), *base.inputs[2:]))
    q, k, v, lengths, k_scale, v_scale = make_fp8_inputs(base, [1, 70, 16, 33, 17], seed=6)
    k = torch.randn(k.shape, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE)
    assert FAMILY.matches(region) and FAMILY.check(region, params, H200) is None
    (out,) = run_candidate(load_candidate, region, params, [q, k, v, lengths, k_scale, v_scale])
    check_close(out, fp8_reference(region, q, k, v, lengths, k_scale, v_scale))
    per_token = fp8_lengths_region(2, 4, 2, 5, 70, 32, "per-token")
    assert not FAMILY.matches(dataclasses.replace(
        per_token, inputs=(per_token.inputs[0], TensorSpec(per_token.inputs[1].shape, "bfloat16"), *per_token.inputs[2:])))
