"""Per-token fp8 scales through pages (paged-kv with fp8-kv-cache{granularity=per-token}): the
decode attention and the prompt's flash attention read each row's K and V scale from scale pools
[N, Hkv, P] paged like the caches (row j % P of page page_table[b, j // P]).

The sequences' pages (caches and scales alike) are interleaved in a shuffled pool; free pages
and the slots past each length hold NaN (e4m3fn 0x7f in the caches), so a read of anything the
table and the lengths do not name poisons the output. The caches fill e4m3's range with
outliers at +-448 and all-zero heads. References: the dequantized contiguous caches, SDPA over
each sequence's valid prefix (tests/templates/test_decode_attention.py's fp8_reference). The
decode kernel over a runtime pool with per-token scale pages (coopt.runtime.paged) is
test_decode_attention.py's test_paged_kernel_reads_the_runtime_pool.
"""

from __future__ import annotations

import pytest
import torch
from template_helpers import compile_for_hopper, lay_out_in_pages
from template_helpers import run_candidate as _run_candidate
from test_decode_attention import E4M3_MAX, fp8_cache, fp8_reference

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.attention import AttentionFamily
from coopt.templates.decode_attention import DecodeAttentionFamily

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DECODE, PROMPT = DecodeAttentionFamily(), AttentionFamily()
FP8_NAN = 0x7F  # e4m3fn NaN


def paged_region(family: str, batch, heads, kv_heads, seq_q, num_pages, page_size, max_pages, head_dim,
                 dtype="bfloat16") -> RegionSummary:
    """q, k / v pools [N, Hkv, P, D] fp8, lengths ([B] decode, [T] prompt), page_table, k_scale /
    v_scale pools [N, Hkv, P] fp32: the region fuse-attention makes of a paged per-token step."""
    pages = TensorSpec((num_pages, kv_heads, page_size, head_dim), "float8_e4m3fn")
    scales = TensorSpec((num_pages, kv_heads, page_size), "float32")
    q = TensorSpec((batch, heads, seq_q, head_dim), dtype)
    lengths = TensorSpec((batch if family == "decode_attention" else seq_q,), "int32")
    attrs = {"scale": head_dim ** -0.5, "num_heads": heads, "num_kv_heads": kv_heads, "lengths_input": 3,
             "lengths_bound": [1, 2], "page_size": page_size, "page_table_input": 4, "pool_input": 1,
             "kv_scale": "per-token", **({} if family == "decode_attention" else {"causal": False})}
    inputs = (q, pages, pages, lengths, TensorSpec((batch, max_pages), "int32"), scales, scales)
    return RegionSummary("paged", family, inputs, (q,), attrs)


def make_inputs(region: RegionSummary, lengths, seen, seed=0, zero_head=(0, 1)):
    """(kernel inputs, contiguous fp8 caches and scales [B, Hkv, max_pages * P(, D)]): `seen[b]`
    positions of sequence b hold data (its pages), the rest NaN."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, seq_q, head_dim = region.inputs[0].shape
    num_pages, kv_heads, size, _ = region.inputs[1].shape
    max_pages = region.inputs[4].shape[1]
    full = (batch, kv_heads, max_pages * size, head_dim)
    q = torch.randn(batch, seq_q, heads, head_dim, generator=gen).to(torch.bfloat16).transpose(1, 2)
    caches = [fp8_cache(full, gen, zero_head) for _ in "kv"]
    # positive row scales over four octaves (a row at 448 dequantizes to ~2-30)
    scales = [torch.exp2(torch.rand(full[:3], generator=gen) * 4 - 9) for _ in "kv"]
    for b, n in enumerate(seen):
        for cache in caches:
            cache.view(torch.uint8)[b, :, n:] = FP8_NAN
        for scale in scales:
            scale[b, :, n:] = float("nan")
    pools, table = lay_out_in_pages([*caches, *scales], [-(-n // size) for n in seen], num_pages, size, gen)
    k, v, k_scale, v_scale = (p.to(DEVICE) for p in pools)
    inputs = [q.to(DEVICE), k, v, torch.tensor(lengths, dtype=torch.int32, device=DEVICE), table.to(DEVICE),
              k_scale, v_scale]
    return inputs, [t.to(DEVICE) for t in (*caches, *scales)]


def check(out, expected):
    assert torch.isfinite(out.float()).all(), "read a page or slot the table and lengths do not name"
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


DECODE_POINTS = {
    "fma": {"BLOCK_N": 16, "SPLIT_KV": 1, "USE_DOT": False, "num_warps": 4, "num_stages": 2},
    "dot-four-splits": {"BLOCK_N": 16, "SPLIT_KV": 4, "USE_DOT": True, "num_warps": 4, "num_stages": 3},
    "dot-a-page": {"BLOCK_N": 32, "SPLIT_KV": 2, "USE_DOT": True, "num_warps": 4, "num_stages": 2},
    "tile-of-pages": {"BLOCK_N": 64, "SPLIT_KV": 1, "USE_DOT": True, "num_warps": 4, "num_stages": 2},
}
DECODE_LENGTHS = {  # page size, lengths: one row, page edges, whole tables
    "one": (16, [1, 1, 1]),
    "page edges": (16, [15, 16, 17]),
    "across pages": (32, [31, 33, 96]),
    "mixed": (32, [1, 70, 65]),
}


@pytest.mark.parametrize("case", DECODE_LENGTHS)
@pytest.mark.parametrize("point", DECODE_POINTS)
def test_decode_reads_row_scales_through_the_page_table(case, point, load_candidate):
    size, lengths = DECODE_LENGTHS[case]
    params = DECODE_POINTS[point]
    max_pages = max(4, -(-max(lengths) // size))
    region = paged_region("decode_attention", 3, 8, 2, 1, 3 * max_pages + 2, size, max_pages, 64)
    assert DECODE.matches(region)
    inputs, (k, v, k_scale, v_scale) = make_inputs(region, lengths, lengths)
    (out,) = _run_candidate(DECODE, H200, load_candidate, region, params, inputs)
    assert out.dtype == torch.bfloat16
    check(out, fp8_reference(region, inputs[0], k, v, inputs[3], k_scale, v_scale))


def test_decode_all_zero_sequence_and_saturated_rows(load_candidate):
    # sequence 0 all zeros (scales at the floor's order: the values stay zero), sequence 1's
    # rows all at +-448 with the largest scales: no overflow, no NaN
    region = paged_region("decode_attention", 2, 4, 2, 1, 9, 32, 2, 32)
    inputs, (k, v, k_scale, v_scale) = make_inputs(region, [40, 33], [40, 33], seed=2)
    zero, saturated = [], []
    for cache in (k, v):
        cache[0, :, :40] = 0.0
        signs = torch.randint(0, 2, cache[1, :, :33].shape, generator=torch.Generator().manual_seed(3)) * 2 - 1
        cache[1, :, :33] = (signs * E4M3_MAX).to(torch.float8_e4m3fn).to(DEVICE)
    for scale in (k_scale, v_scale):
        scale[0, :, :40], scale[1, :, :33] = 1e-12 / 448, 1 / 16
    pools, table = lay_out_in_pages([k.cpu(), v.cpu(), k_scale.cpu(), v_scale.cpu()], [2, 2], 9, 32,
                                    torch.Generator().manual_seed(4))
    inputs = [inputs[0], *(p.to(DEVICE) for p in pools[:2]), inputs[3], table.to(DEVICE), *(p.to(DEVICE) for p in pools[2:])]
    for i, params in enumerate(DECODE_POINTS.values()):  # (D 32: two warps)
        (out,) = _run_candidate(DECODE, H200, load_candidate, region, {**params, "num_warps": 2}, inputs, stem=f"zero{i}")
        assert out[0].abs().max() == 0
        check(out, fp8_reference(region, inputs[0], k, v, inputs[3], k_scale, v_scale))


PROMPT_POINT = {"BLOCK_M": 16, "BLOCK_N": 16, "PACK_GQA": False, "SPLIT_KV": 1, "num_warps": 4, "num_stages": 2}


def prompt_reference(region, q, k, v, lengths, k_scale, v_scale):
    """Each query position over its own prefix of the (one) sequence's dequantized cache."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        for t, length in enumerate(lengths.tolist()):
            one = [x[b:b + 1] for x in (q[:, :, t:t + 1], k, v, k_scale, v_scale)]
            out[b, :, t] = fp8_reference(region, one[0], one[1], one[2], torch.tensor([length]), one[3], one[4])[0, :, 0]
    return out


@pytest.mark.parametrize("params", [
    PROMPT_POINT,
    {**PROMPT_POINT, "PACK_GQA": True, "SPLIT_KV": 2},
    {**PROMPT_POINT, "BLOCK_N": 32},
    {**PROMPT_POINT, "BLOCK_N": 64},
], ids=["plain", "pack-gqa-split", "block-a-page", "block-of-pages"])
def test_prompt_reads_row_scales_through_the_page_table(params, load_candidate):
    # a chunk of 6 queries per sequence: prefixes of 1, a page edge, across pages, the whole table
    lengths = [1, 16, 17, 64, 33, 31]
    region = paged_region("attention", 2, 4, 2, len(lengths), 9, 32, 2, 32)
    assert PROMPT.matches(region) and PROMPT.check(region, params, H200) is None
    inputs, (k, v, k_scale, v_scale) = make_inputs(region, lengths, [64, 64], seed=1)
    (out,) = _run_candidate(PROMPT, H200, load_candidate, region, params, inputs)
    check(out, prompt_reference(region, inputs[0], k, v, inputs[3], k_scale, v_scale))


def test_schema():
    decode = paged_region("decode_attention", 1, 32, 8, 1, 64, 32, 16, 128)
    prompt = paged_region("attention", 1, 32, 8, 64, 64, 32, 16, 128)
    assert DECODE.matches(decode) and DECODE.legal_points(decode, H200)
    assert PROMPT.matches(prompt) and PROMPT.legal_points(prompt, H200)
    # per-token scales must be pools shaped like the caches' pages
    for family, region in ((DECODE, decode), (PROMPT, prompt)):
        wrong = RegionSummary("r", region.family, (*region.inputs[:5], *(TensorSpec((1, 8, 512), "float32"),) * 2),
                              region.outputs, region.attrs)
        assert not family.matches(wrong)
        assert "per-token" in family.check(wrong, family.legal_points(region, H200)[0], H200)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_compiles_for_hopper(tmp_path):
    # Llama-3-8B heads over pages of 64: a decode step (split, tl.dot) and a prompt chunk of 128
    decode = paged_region("decode_attention", 2, 32, 8, 1, 40, 64, 8, 128)
    prompt = paged_region("attention", 1, 32, 8, 128, 40, 64, 8, 128)
    decode_params = {"BLOCK_N": 64, "SPLIT_KV": 4, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
    prompt_params = {"BLOCK_M": 128, "BLOCK_N": 64, "PACK_GQA": False, "SPLIT_KV": 1, "num_warps": 8, "num_stages": 3}
    jobs = []
    for label, family, region, params, lengths in (
            ("decode", DECODE, decode, decode_params, [300, 100]),
            ("prompt", PROMPT, prompt, prompt_params, list(range(257, 385)))):
        assert family.check(region, params, H200) is None
        inputs, _ = make_inputs(region, lengths, [512] * region.inputs[0].shape[0])
        jobs.append((label, family.render(region, params), inputs))
    compiled = compile_for_hopper(jobs, tmp_path)
    assert compiled["decode"]["_decode_split_kernel"]["pipelined"]
    assert compiled["prompt"]["_attention_kernel"]["pipelined"] and compiled["prompt"]["_attention_kernel"]["wgmma"]
