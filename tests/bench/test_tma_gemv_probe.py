"""bench/tma_gemv_probe.py without a GPU (Triton's interpreter): both forms of its split GEMV
agree with x @ w.T, its splits meet once per call (the arrival counters are reset for the next),
and the points it would time are ones the kernel takes."""

from __future__ import annotations

import pytest
import torch
from tma_gemv_probe import SHAPES, SplitGemv, fixed_costs, points


@pytest.mark.parametrize("use_tma", [True, False])
@pytest.mark.parametrize("m, n, k, split_k", [(5, 96, 192, 3), (32, 64, 128, 1), (17, 80, 200, 2)])
def test_both_forms_agree_with_a_matmul(use_tma, m, n, k, split_k):
    # N, K off the tiles (80 rows of 64, K 200 of 64): the edges read as zero; K a multiple of 8
    # keeps the rows 16-byte aligned, as a tensor descriptor needs
    gemv = SplitGemv(m, n, k, block_n=64, block_k=64, split_k=split_k, stages=2, warps=4, use_tma=use_tma,
                     device="cpu")
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    expected = x.float() @ w.float().T
    for _ in range(2):  # the second call meets again: the last split reset the counters
        out = gemv(x, w)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    assert not gemv.arrivals.any()


@pytest.mark.parametrize("name", list(SHAPES))
def test_points_fill_the_gpu_and_pair_the_forms(name):
    m, n, k = SHAPES[name]
    chosen = points(m, n, k, sms=132)
    assert {p["use_tma"] for p in chosen} == {True, False}
    for p in chosen:
        blocks = -(-n // p["block_n"])
        assert 1 <= p["split_k"] <= k // p["block_k"]
        assert blocks * p["split_k"] >= 60  # at least about half of the SMs have a program
        twin = {**p, "use_tma": not p["use_tma"]}
        assert twin in chosen  # every point is timed in both forms


def test_fixed_costs_recover_a_line():
    # times made as 4 us + bytes at 3 TB/s give back 4 us and 3 TB/s; one shape alone gives no line
    def best(name):
        _, n, k = SHAPES[name]
        return (4.0 + n * k * 2 / 3e6, "x", 0.0, 0.0, True)

    table = [(name, {"cublas": best(name), "template": None, "tma": None, "ptr": None}) for name in SHAPES]
    intercept, tb_s = fixed_costs(table)["cublas"]
    assert abs(intercept - 4.0) < 1e-6 and abs(tb_s - 3.0) < 1e-6
    assert fixed_costs(table[:1]) == {}
