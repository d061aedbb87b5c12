"""bench/cuda_fp8_attention_probe.py: the tensor-core fp8 attention's source compiles for sm_90
without spilling (with nvcc, where the machine has one: on the GPU machine the probe compiles it
with NVRTC), and on a GPU it computes the attention over an e4m3 cache with per-head scales for
1 .. S valid keys: lengths inside one 16-key block, across blocks, chunks and splits, and blocks
and warps left without keys."""

from __future__ import annotations

import re

import pytest
import torch
from cuda_fp8_attention_probe import Fp8Attention, render, shared_bytes

from coopt.targets import H200

GPU_POINTS = [(16, 4, 32, 4, "cluster"), (8, 8, 32, 2, "cluster"), (4, 4, 16, 3, "cluster"),
              (32, 4, 32, 2, "global"), (64, 8, 32, 2, "global"), (7, 4, 16, 3, "global")]
WIDENS = ["cvt", "bits"]
COPY_POINTS = [(16, 4, 32, 2, "cluster"), (32, 4, 16, 3, "global"), (7, 8, 32, 2, "global")]


def test_the_rings_are_what_grows_and_the_default_sweep_has_points_that_fit():
    # a warp's ring holds STAGES chunks of K and V rows, 128 bytes a row
    assert shared_bytes(16, 4, 32, 4) - shared_bytes(16, 4, 32, 3) == 4 * 2 * 32 * 128
    fitting = [(w, c, s) for w in (4, 8) for c in (32, 64) for s in (2, 3)
               if shared_bytes(16, w, c, s) <= H200.smem_per_block_bytes]
    assert (4, 64, 3) in fitting and (8, 32, 3) in fitting and (8, 64, 3) not in fitting
    # the global merge keeps no block partials in shared memory: 4 bytes x GROUP x (m, l, 128 dims) less
    assert shared_bytes(16, 4, 32, 2) - shared_bytes(16, 4, 32, 2, "global") == 4 * 4 * 130
    assert all(shared_bytes(*p) <= H200.smem_per_block_bytes for p in GPU_POINTS)
    # bulk copies place rows 144 bytes apart and keep an mbarrier a slot
    assert shared_bytes(16, 4, 32, 2, copy="bulk") - shared_bytes(16, 4, 32, 2) == 4 * 2 * 2 * 32 * 16 + 8 * 4 * 2
    assert all(shared_bytes(*p, copy="bulk") <= H200.smem_per_block_bytes for p in COPY_POINTS)


@pytest.mark.parametrize("point,widen", [((16, 4, 32, 4, "cluster"), "cvt"), ((8, 4, 64, 3, "cluster"), "bits"),
                                         ((16, 8, 16, 4, "cluster"), "cvt"), ((32, 4, 32, 2, "global"), "bits"),
                                         ((64, 8, 32, 3, "global"), "cvt")])
def test_the_source_compiles_for_hopper_without_spills(hopper_registers, point, widen):
    assert hopper_registers(render(*point, widen=widen)) * 32 * point[1] <= 65536


@pytest.mark.parametrize("copy", ["ca", "bulk"])
@pytest.mark.parametrize("loads_only", [False, True])
def test_every_copy_form_compiles_for_hopper_without_spills(hopper_registers, copy, loads_only):
    assert hopper_registers(render(16, 8, 32, 2, "global", copy=copy, loads_only=loads_only)) * 256 <= 65536


@pytest.mark.gpu
@pytest.mark.parametrize("point,options", [(p, {"widen": w}) for p in GPU_POINTS for w in WIDENS]
                         + [(p, {"copy": c}) for p in COPY_POINTS for c in ("ca", "bulk")])
def test_the_fp8_attention_matches_an_fp32_softmax(point, options):
    """Every length twice: the global merge's last block must leave its counts at zero for the next call."""
    from attention_sweep import make_inputs, make_region, reference

    probe = Fp8Attention(*point, **options)
    for length in (1, 15, 16, 17, 100, 1000, 4096):
        region = make_region(1, length, 4096, True)
        inputs = make_inputs(region, length, seed=length)
        expected = reference(region, *inputs).float()
        for _ in range(2):
            out = torch.full((1, 32, 1, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
            got = probe.run(*inputs, out).float()
            assert (got - expected).abs().max() <= 2e-2 * expected.abs().max(), (point, options, length)


@pytest.mark.gpu
@pytest.mark.parametrize("copy,widen", [("cg", "bits"), ("bulk", "cvt")])
def test_rows_past_the_length_never_reach_the_output(copy, widen):
    """NaN bytes (e4m3 0x7f) past the valid length: the cp.async forms zero-fill the rows they do
    not load, the bulk form reads them as zeros, so none leaks through a zero weight."""
    from attention_sweep import make_inputs, make_region, reference

    probe = Fp8Attention(32, 4, 32, 2, "global", widen=widen, copy=copy)
    region = make_region(1, 1000, 4096, True)
    q, k, v, lengths, *scales = make_inputs(region, 1000, seed=3)
    expected = reference(region, q, k, v, lengths, *scales).float()
    for cache in (k, v):
        cache.view(torch.uint8)[:, :, 1000:] = 0x7F
    got = probe.run(q, k, v, lengths, *scales, torch.empty(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)).float()
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_the_integer_widening_is_exact_for_every_e4m3_byte():
    """The "bits" form's f16x2_from_high_bytes, its expression taken from the rendered source and
    evaluated on every e4m3 byte but NaN in both halves: 2^-8 times the byte's value, exactly."""
    import numpy as np

    source = render(16, 4, 32, 2, "global", widen="bits")
    body = re.search(r"f16x2_from_high_bytes\(unsigned int u\) \{\s*return (.*?);", source).group(1)
    expression = re.sub(r"(0x[0-9a-f]+)u", r"\1", body)
    codes = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint32)
    u = (codes << 8) | (codes[::-1] << 24) | 0x00A500A5  # garbage in the low bytes: ignored
    words = eval(expression, {"u": u})  # noqa: S307 (the test's own rendered source)
    halves = words.astype(np.uint32).view(np.uint16).reshape(-1, 2).view(np.float16).astype(np.float64)
    values = torch.tensor(codes.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()
    assert np.array_equal(halves[:, 0], values / 256) and np.array_equal(halves[:, 1], values[::-1] / 256)
