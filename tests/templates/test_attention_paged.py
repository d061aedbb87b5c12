"""attention over a paged KV cache (paged-kv): a prompt chunk whose queries each see their own
prefix of one sequence's cache, read through the page table (nothing gathered).

Kernels run in Triton's interpreter without a GPU (on the GPU machine, for real). The pool holds
the sequences' pages in shuffled order; free pages and every slot past the longest prefix hold
NaN (e4m3fn 0x7f for fp8), so a read of anything the table and the lengths do not name poisons
the output. References: SDPA over each sequence's contiguous, NaN-free cache.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from template_helpers import compile_for_hopper, lay_out_in_pages
from template_helpers import run_candidate as _run_candidate

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.attention import AttentionFamily

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILY = AttentionFamily()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
run_candidate = partial(_run_candidate, FAMILY, H200)
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "PACK_GQA": False, "SPLIT_KV": 1, "num_warps": 4, "num_stages": 2}


def paged_prompt_region(batch, heads, kv_heads, seq_q, num_pages, page_size, max_pages, head_dim,
                        dtype="float32", granularity=None, dims=None) -> RegionSummary:
    """q [B, H, T, D], k / v pages [N, Hkv, P, D], lengths [T], page_table [B, max_pages][, scales]."""
    pages = TensorSpec((num_pages, kv_heads, page_size, head_dim), "float8_e4m3fn" if granularity else dtype)
    q = TensorSpec((batch, heads, seq_q, head_dim), dtype)
    inputs = (q, pages, pages, TensorSpec((seq_q,), "int32"), TensorSpec((batch, max_pages), "int32"))
    attrs = {"causal": False, "scale": head_dim ** -0.5, "num_heads": heads, "num_kv_heads": kv_heads,
             "lengths_input": 3, "lengths_bound": [1, 2], "page_size": page_size, "page_table_input": 4,
             "pool_input": 1}
    if granularity:
        shape = (1,) if granularity == "per-tensor" else (kv_heads,)
        inputs += (TensorSpec(shape, "float32"),) * 2
        attrs["kv_scale"] = granularity
    return RegionSummary("prompt", "attention", inputs, (q,), attrs, dims=dims or {})


def make_paged_inputs(region: RegionSummary, lengths, seed: int = 0):
    """(kernel inputs, dequantized contiguous caches [B, Hkv, max_pages * P, D] for the reference)."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, seq_q, head_dim = region.inputs[0].shape
    num_pages, kv_heads, size, _ = region.inputs[1].shape
    max_pages = region.inputs[4].shape[1]
    fp8 = region.inputs[1].dtype == "float8_e4m3fn"
    dtype = DTYPES[region.inputs[0].dtype]
    q = torch.randn(batch, seq_q, heads, head_dim, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    full = (batch, kv_heads, max_pages * size, head_dim)
    seen = max(lengths)
    caches = []
    for _ in "kv":
        values = torch.randn(full, generator=gen)
        if fp8:
            values = (values * 112).clamp(-448, 448).to(torch.float8_e4m3fn)
        caches.append(values.to(torch.float8_e4m3fn if fp8 else dtype))
    clean = [c.clone() for c in caches]
    for cache in caches:  # slots past the longest prefix: never read
        if fp8:
            cache.view(torch.uint8)[:, :, seen:] = 0x7F
        else:
            cache[:, :, seen:] = float("nan")
    pool, table = lay_out_in_pages(caches, [-(-seen // size)] * batch, num_pages, size, gen)
    inputs = [q, *(p.to(DEVICE) for p in pool), torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
              table.to(DEVICE)]
    if fp8:
        scales = [(torch.rand(region.inputs[i].shape, generator=gen) + 0.5).div(112) for i in (5, 6)]
        inputs += [s.to(DEVICE) for s in scales]
        broadcast = (1, -1, 1, 1)
        clean = [c.double() * s.double().reshape(broadcast) for c, s in zip(clean, scales)]
    return inputs, [c.to(DEVICE) for c in clean]


def reference(region: RegionSummary, q, caches, lengths) -> torch.Tensor:
    k, v = caches
    group = q.shape[1] // k.shape[1]
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < torch.tensor(lengths, device=q.device)[:, None]
    return F.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1),
        attn_mask=mask, scale=region.attrs["scale"]).float()


def check_close(actual: torch.Tensor, expected: torch.Tensor):
    assert torch.isfinite(actual.float()).all(), "read a page or slot the table and lengths do not name"
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=2e-2)


# lengths per query position of a chunk: 1, page edges, the whole table, out of order
LENGTHS = [1, 16, 17, 64, 33, 15]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [
    SMALL,
    {**SMALL, "PACK_GQA": True},
    {**SMALL, "SPLIT_KV": 2},
    {**SMALL, "BLOCK_N": 32, "PACK_GQA": True},
    {**SMALL, "BLOCK_N": 64, "PACK_GQA": True},
], ids=["plain", "pack_gqa", "split_kv", "block-a-page", "block-of-pages"])
def test_paged_prompt_reads_through_the_table(params, dtype, load_candidate):
    # 2 sequences, 4 query heads over 2 kv heads, pages of 32 (BLOCK_N 16: two blocks a page; 32: one)
    region = paged_prompt_region(2, 4, 2, len(LENGTHS), 9, 32, 2, 32, dtype)
    assert FAMILY.matches(region) and FAMILY.check(region, params, H200) is None
    inputs, caches = make_paged_inputs(region, LENGTHS)
    (out,) = run_candidate(load_candidate, region, params, inputs)
    check_close(out, reference(region, inputs[0], caches, LENGTHS))


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
def test_paged_prompt_over_fp8_pages(granularity, load_candidate):
    region = paged_prompt_region(2, 4, 2, len(LENGTHS), 9, 32, 2, 32, "bfloat16", granularity)
    params = {**SMALL, "PACK_GQA": True, "SPLIT_KV": 2}
    assert FAMILY.check(region, params, H200) is None
    inputs, caches = make_paged_inputs(region, LENGTHS, seed=1)
    (out,) = run_candidate(load_candidate, region, params, inputs)
    check_close(out, reference(region, inputs[0], caches, LENGTHS))


def test_paged_schema_and_tiles():
    region = paged_prompt_region(2, 4, 2, 6, 9, 16, 4, 32, "bfloat16")
    assert FAMILY.matches(region)
    # a K/V block lies in one page or covers whole pages (32: two pages of 16)
    assert FAMILY.check(region, {**SMALL, "BLOCK_N": 32}, H200) is None
    assert {p["BLOCK_N"] for p in FAMILY.legal_points(region, H200)} >= {16, 32, 64}
    # without the page table input, or with a table of another batch, it is no paged region
    no_table = RegionSummary("p", "attention", region.inputs[:4], region.outputs, region.attrs)
    assert not FAMILY.matches(no_table)
    wrong = RegionSummary("p", "attention", (*region.inputs[:4], TensorSpec((3, 4), "int32")), region.outputs,
                          region.attrs)
    assert not FAMILY.matches(wrong)
    # per-token scales with pages: scale pools [N, Hkv, P] (tests/templates/test_paged_per_token.py)
    per_token = paged_prompt_region(2, 4, 2, 6, 9, 16, 4, 32, "bfloat16", "per-head")
    per_token = RegionSummary("p", "attention", (*per_token.inputs[:5], *(TensorSpec((9, 2, 16), "float32"),) * 2),
                              per_token.outputs, {**per_token.attrs, "kv_scale": "per-token"})
    assert FAMILY.matches(per_token) and FAMILY.check(per_token, SMALL, H200) is None


def test_heuristic_blocks_span_small_pages():
    # pages of 16 do not shrink the key blocks: the first point's BLOCK_N is the 64 a prompt
    # over 4096 keys gets, each block covering 4 pages
    from coopt.llm_advisor import AdviceRequest, HeuristicAdvisor

    region = paged_prompt_region(1, 32, 8, 256, 512, 16, 256, 128, "bfloat16")
    request = AdviceRequest(region, FAMILY.name, FAMILY.param_space(region, H200),
                            tuple(FAMILY.legal_points(region, H200)), H200.facts())
    best = HeuristicAdvisor().advise(request).ranked[0]
    assert best["BLOCK_N"] == 64 and FAMILY.check(region, best, H200) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_paged_prompt_compiles_for_hopper(tmp_path):
    # Llama-3-8B heads, a chunk of 256 queries over pages of 64 (bf16 and fp8 per-head)
    jobs = []
    for granularity in (None, "per-head"):
        region = paged_prompt_region(1, 32, 8, 256, 40, 64, 8, 128, "bfloat16", granularity)
        params = {"BLOCK_M": 128, "BLOCK_N": 64, "PACK_GQA": False, "SPLIT_KV": 1, "num_warps": 8, "num_stages": 3}
        assert FAMILY.check(region, params, H200) is None
        inputs, _ = make_paged_inputs(region, list(range(257, 513)))
        jobs.append((granularity or "bf16", FAMILY.render(region, params), inputs))
    compiled = compile_for_hopper(jobs, tmp_path)
    for label, _, _ in jobs:
        kernel = compiled[label]["_attention_kernel"]
        assert kernel["pdl"] and kernel["wgmma"], label
        # a table lookup per block must not stop the K/V loads from pipelining
        assert kernel["pipelined"], label
