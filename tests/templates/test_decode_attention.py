"""decode_attention family: valid-prefix softmax, GQA packing, splits, the bounded space.

Kernels run in Triton's interpreter without a GPU (on the GPU machine, for real): shapes stay
small. The reference is an explicit fp32 softmax over each sequence's valid prefix, kv heads
repeated for GQA; one test also checks it against SDPA with a padding mask.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from template_helpers import compile_for_hopper, covering_points
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
    best = HeuristicAdvisor().advise(request).ranked[0]
    assert best["SPLIT_KV"] == split, best
    assert best["USE_DOT"] and best["BLOCK_N"] == 64


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
    compiled = compile_for_hopper(jobs, tmp_path)
    for label, params in expected.items():
        kernels = compiled[label]
        reduce = {"_decode_reduce_kernel"} if params["SPLIT_KV"] > 1 else set()
        assert set(kernels) == {"_decode_split_kernel"} | reduce
        split = kernels["_decode_split_kernel"]
        # streaming K/V is the whole cost: with stages, the loads must be asynchronous copies
        assert split["pipelined"] == (params["num_stages"] > 1), f"K/V pipelining for {label} {params}"
        assert split["shared"] <= H200.smem_per_block_bytes

