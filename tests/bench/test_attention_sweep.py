"""bench/attention_sweep.py without a GPU: its regions are decode_attention regions the family
accepts, the points it times are legal and start with the advisor's, and its reference agrees
with SDPA (the sweep's correctness check must itself be right)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F
from attention_sweep import CASES, advised, make_region, reference, select_points

from coopt.targets import H200
from coopt.templates.decode_attention import DecodeAttentionFamily

FAMILY = DecodeAttentionFamily()


@pytest.mark.parametrize("case", list(CASES))
def test_points_are_legal_advised_first_and_distinct(case):
    region = make_region(*CASES[case])
    assert FAMILY.matches(region)
    args = argparse.Namespace(advised=3, sample=5)
    points = select_points(region, FAMILY, args)
    page = region.attrs.get("page_size")
    count = 8 + (2 if page else 0)  # paged: the advisor's first two tiles of one page or less join
    assert len(points) == count and len({tuple(sorted(p.items())) for p in points}) == count
    assert all(FAMILY.check(region, p, H200) is None for p in points)
    again = select_points(region, FAMILY, argparse.Namespace(advised=3, sample=0))
    assert points[:len(again)] == again  # the advisor's first, then the seeded sample
    if page:
        assert all(p["BLOCK_N"] <= page for p in again[3:]) and any(p["BLOCK_N"] > page for p in again[:3])
    if CASES[case][3]:  # the fp8 case offers the fp16-widened tiles
        assert any(p.get("TILE_FP16") for p in select_points(region, FAMILY, argparse.Namespace(advised=8, sample=0)))


def test_reference_is_attention_over_the_valid_keys():
    region = make_region(2, 16, 32, False)
    torch.manual_seed(0)
    q = torch.randn(2, 32, 1, 128)
    k, v = torch.randn(2, 8, 32, 128), torch.randn(2, 8, 32, 128)
    lengths = torch.tensor([16, 16])
    expected = F.scaled_dot_product_attention(q, k[:, :, :16].repeat_interleave(4, 1), v[:, :, :16].repeat_interleave(4, 1))
    torch.testing.assert_close(reference(region, q, k, v, lengths), expected, rtol=1e-4, atol=1e-4)
    # fp8 scales multiply the cache back
    scale = torch.full((8,), 0.5)
    torch.testing.assert_close(reference(region, q, 2 * k, 2 * v, lengths, scale, scale), expected, rtol=1e-4, atol=1e-4)
    # the rope case rotates q first (rotate-half): by a quarter turn, cos 0 and sin 1, q's halves swap
    roped = make_region(2, 16, 32, False, True)
    cos, sin = torch.zeros(1, 128), torch.ones(1, 128)
    turned = torch.cat([-q[..., 64:], q[..., :64]], dim=-1)
    expected = F.scaled_dot_product_attention(turned, k[:, :, :16].repeat_interleave(4, 1), v[:, :, :16].repeat_interleave(4, 1))
    torch.testing.assert_close(reference(roped, q, k, v, lengths, cos, sin), expected, rtol=1e-4, atol=1e-4)


def test_paged_reference_reads_each_sequence_through_its_table():
    # two sequences of 2 pages of 16 in a shuffled pool of 5: the reference gathers the pages
    # back in table order, so it equals the contiguous caches' attention
    region = make_region(2, 20, 32, False, False, 16)
    torch.manual_seed(1)
    q = torch.randn(2, 32, 1, 128)
    k, v = torch.randn(2, 8, 32, 128), torch.randn(2, 8, 32, 128)
    table = torch.tensor([[3, 1], [4, 2]], dtype=torch.int32)
    pools = []
    for cache in (k, v):
        pool = torch.full((5, 8, 16, 128), float("nan"))
        for b in range(2):
            for i in range(2):
                pool[table[b, i]] = cache[b, :, 16 * i:16 * (i + 1)]
        pools.append(pool)
    lengths = torch.tensor([20, 20])
    torch.testing.assert_close(reference(region, q, *pools, lengths, table),
                               reference(make_region(2, 20, 32, False), q, k, v, lengths), rtol=1e-5, atol=1e-5)


def test_gemm_sample_is_the_advisors_gemv_points_then_a_seeded_draw():
    from gemm import SHAPES, advised_points, make_region, select_points

    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    region = make_region(*SHAPES["layer"][4])  # q|k|v + norm at 32 rows
    args = argparse.Namespace(quick=False, variants="gemv", sample=6, advised=3, limit=None)
    points = select_points(region, args)
    assert points[:3] == advised_points(region, 3) and len(points) == 9
    assert all(p["GEMV"] and MatmulEpilogueFamily().check(region, p, H200) is None for p in points)
    assert select_points(region, args) == points  # the same draw every run


def test_latency_fit_recovers_a_fixed_cost_and_a_bandwidth():
    from attention_sweep import fit_latency

    # 3 us fixed, 2 TB/s (2e6 bytes a us): exact points give the line back
    points = [(b, 3.0 + b / 2e6) for b in (2e6, 4e6, 8.4e6, 16.8e6)]
    intercept, bandwidth = fit_latency(points)
    assert intercept == pytest.approx(3.0) and bandwidth == pytest.approx(2.0)
    # time that does not grow with bytes has no bandwidth to report
    assert math.isnan(fit_latency([(1e6, 5.0), (2e6, 5.0)])[1])


def test_latency_takes_only_unpaged_cases(monkeypatch, capsys):
    import sys

    from attention_sweep import parse_args

    monkeypatch.setattr(sys, "argv", ["attention_sweep.py", "--latency", "b32-2048-paged16"])
    with pytest.raises(SystemExit):
        parse_args()
    assert "--latency takes an unpaged case" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["attention_sweep.py", "--latency", "b1-2048-rope"])
    assert parse_args().latency == "b1-2048-rope"


@pytest.mark.parametrize("case", ["b1-32768-fp8", "b32-2048-fp8"])
def test_v_words_is_ranked_behind_the_points_without_it(case):
    # V read as words measured slower at every point on the H200 (session 17, docs/kv-cache.md):
    # a build's measurements (its top 4) and a sweep's advised points (6) go to the points without
    # it; the bf16-widened tiles (slower, q rounded to 8 bits) come after it
    region = make_region(*CASES[case])
    assert "V_WORDS" in FAMILY.param_space(region, H200)
    ranked = advised(region, FAMILY)
    assert not any(p.get("V_WORDS") for p in ranked[:8])
    first_words = next(i for i, p in enumerate(ranked) if p.get("V_WORDS"))
    assert all(p["TILE_FP16"] for p in ranked[:first_words + 1])
    assert any(p.get("V_WORDS") for p in ranked)


@pytest.mark.parametrize("share", [0.25, 0.5, 1.0])
def test_bulk_prefetch_chunks_stay_inside_the_weight(share):
    from attention_sweep import bulk_prefetch_chunks

    total = 4096 * 4096 * 2  # the o projection's bf16 weight
    programs, chunk = bulk_prefetch_chunks(total, share)
    covered = programs * 32 * chunk
    assert chunk % 16 == 0 and 0 < chunk <= 1 << 20
    assert covered <= total * share and covered > total * share - programs * 32 * 16


def test_the_bulk_prefetch_kernel_compiles_for_sm90(tmp_path):
    import inspect
    import sys
    from pathlib import Path

    import attention_sweep

    pytest.importorskip("triton.backends.compiler")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the experiment compiles it for real")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "templates"))
    from template_helpers import compile_for_hopper

    kernel = inspect.getsource(attention_sweep._bulk_prefetch_l2_kernel.fn)
    source = ("import torch\nimport triton\nimport triton.language as tl\n\n\n" + kernel
              + "\n\ndef run(weight):\n    _bulk_prefetch_l2_kernel[(2,)](weight, CHUNK_ELEMENTS=4096, "
              "CHUNK_BYTES=8192, LANES=32, num_warps=1)\n")
    compiled = compile_for_hopper([("bulk", source, [torch.zeros(2 * 32 * 4096, dtype=torch.bfloat16)])], tmp_path)
    assert {name: facts["launches"] for name, facts in compiled["bulk"].items()} == {"_bulk_prefetch_l2_kernel": 1}
