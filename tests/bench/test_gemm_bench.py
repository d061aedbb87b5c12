"""bench/gemm.py's batch-32 statistics form (`--shapes stats32`) without a GPU: its regions are
regions the GEMV family takes, its eager reference is the RMSNorm GEMV it stands for (h * g and
the chunk sums of h^2 give F.rms_norm(h) * g @ W), and a rendered point agrees with it in the
interpreter (a wrong reference would mark right kernels WRONG on the device)."""

from __future__ import annotations

import math

import pytest
import torch
from gemm import SHAPES, STATS_CHUNK, advised_points, eager, make_region

from coopt.targets import H200
from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

FAMILY = MatmulEpilogueFamily()


@pytest.mark.parametrize("shape", SHAPES["stats32"])
def test_stats_regions_are_taken_and_their_advised_points_legal(shape):
    region = make_region(*shape)
    assert FAMILY.matches(region)
    points = advised_points(region, 4)
    assert len(points) == 4 and all(FAMILY.check(region, p, H200) is None for p in points)


def stats_inputs(m, n, k, swiglu, seed=0):
    """(norm-form inputs h, W, g; stats-form inputs h * g, W, chunk sums of h^2)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(2 * n if swiglu else n, k, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.bfloat16)
    squares = h.float().square().view(m, k // STATS_CHUNK, STATS_CHUNK).sum(-1).t().contiguous()
    return [h, w, g], [(h * g).to(torch.bfloat16), w, squares]


@pytest.mark.parametrize("epilogue", ["stats", "stats_swiglu"])
def test_stats_reference_is_the_rms_norm_gemv_and_a_kernel_agrees(epilogue, monkeypatch, tmp_path):
    m, n, k = 32, 64, 256
    swiglu = epilogue.endswith("swiglu")
    norm_inputs, stats = stats_inputs(m, n, k, swiglu)
    norm_region = make_region(m, n, k, "norm_swiglu" if swiglu else "norm")
    region = make_region(m, n, k, epilogue)
    expected = eager(norm_region, norm_inputs).float()
    got = eager(region, stats).float()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 0.02 * scale  # bf16 roundings of h * g and the output
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from coopt.runtime.kernel_loader import load_module_from_file

    point = advised_points(region, 1)[0]
    path = tmp_path / "stats_point.py"
    path.write_text(FAMILY.render(region, point))
    out = load_module_from_file(str(path)).run(*stats)
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert (out.float() - got).abs().max().item() <= 0.01 * scale


def test_producer_regions_reference_and_a_kernel_agree(monkeypatch, tmp_path):
    """`--shapes b32cuda`'s residual GEMVs produce the next norm's inputs: the eager reference
    adds the residual (inputs a, W, residual, g), and the template's outputs (h, h * g, the chunk
    sums of h^2) agree with it in the interpreter."""
    m, n, k = 32, 128, 256
    region = make_region(m, n, k, "producer")
    assert FAMILY.matches(region) and [s.shape for s in region.outputs] == [(m, n), (m, n), (n // STATS_CHUNK, m)]
    gen = torch.Generator().manual_seed(3)
    a, residual = (torch.randn(m, d, generator=gen).to(torch.bfloat16) for d in (k, n))
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    g = (1 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)
    expected = eager(region, [a, w, residual, g]).float()
    assert torch.allclose(expected, (a.float() @ w.float().T + residual.float()), atol=0.05)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from coopt.runtime.kernel_loader import load_module_from_file

    path = tmp_path / "producer_point.py"
    path.write_text(FAMILY.render(region, advised_points(region, 1)[0]))
    h, hg, sq = load_module_from_file(str(path)).run(a, w, residual, g)
    assert (h.float() - expected).abs().max().item() <= 0.02 * expected.abs().max().item()
    torch.testing.assert_close(hg.float(), (h.float() * g.float()).to(torch.bfloat16).float(), rtol=8e-3, atol=0)
    torch.testing.assert_close(sq, h.float().square().view(m, -1, STATS_CHUNK).sum(-1).t(), rtol=1e-4, atol=0)
