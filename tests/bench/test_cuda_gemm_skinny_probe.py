"""bench/cuda_gemm_skinny_probe.py: the batch-32 GEMM's points fit a block and compile for sm_90a
without spilling (nvcc, where installed); its PTX meets through the cluster by a split barrier and
distributed shared memory, with no atomics and no global partials; only weight copies go out
before its PDL wait; and on a GPU (CUDA C++ does not run in Triton's interpreter) it agrees with
an fp32 product over drawn shapes and points (the kernel is the template family gemm_skinny_cuda's
plain form: tests/templates/test_gemm_skinny_cuda.py tests its other forms): short last rounds, several rounds a cluster, every
cluster size, one and two partials buffers, PDL launches back to back."""

from __future__ import annotations

import re

import pytest
from cuda_gemm_skinny_probe import DEFAULT_POINTS, SHAPES, parse_point, point_problem, render, shared_bytes
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coopt.verify.profiles import resolve_profile


def test_the_default_points_fit_the_layer_shapes_that_need_them():
    # every shape has default points that fit a block (227 KiB), and K = 14336 keeps the ones
    # whose x slice, rings and partials do
    for n, k in SHAPES.values():
        fitting = [p for p in DEFAULT_POINTS.split(",") if point_problem(32, n, k, *parse_point(p)) is None]
        assert len(fitting) >= 3, (n, k)
    assert point_problem(32, 4096, 14336, 8, 8, 3, 64) is not None  # 112 KB of x beside 96 KB of rings
    # x's slice padded 16 bytes a row, 8 warps x 3 slabs x 32 rows x 128 bytes, two rounds of partials
    assert shared_bytes(32, 4096, 4096, 8, 8, 3, 64) == 32 * 520 * 2 + 8 * 3 * 32 * 128 + 2 * 32 * 260 * 4


@pytest.mark.parametrize("m,n,k,point,why", [
    (32, 4100, 4096, (8, 8, 3, 64), "groups of 32"),
    (32, 4096, 3072, (16, 4, 3, 128), "whole slabs"),     # 192 columns a share: not whole 128-column slabs
    (40, 4096, 4096, (8, 3, 3, 64), "split evenly"),     # 96 threads over 64 batch rows
    (16, 4096, 4096, (16, 4, 3, 64), "outputs a thread"),  # 128 rows a round over 16 blocks: 1 a thread
    (32, 4096, 14336, (4, 8, 4, 64), "shared memory"),
])
def test_points_the_kernel_cannot_run_are_refused_with_the_reason(m, n, k, point, why):
    assert why in point_problem(m, n, k, *point)


@pytest.mark.parametrize("m,k,point", [(32, 4096, (8, 8, 3, 64, 2)), (32, 14336, (16, 8, 4, 64, 1)),
                                       (32, 4096, (4, 4, 6, 128, 2)), (64, 4096, (8, 4, 4, 64, 2)),
                                       (16, 4096, (2, 8, 4, 64, 1)), (32, 4096, (8, 12, 2, 64, 1)),
                                       (32, 4096, (2, 6, 3, 64, 1))])
def test_it_compiles_for_hopper_without_spills(hopper_registers, m, k, point):
    registers = hopper_registers(render(m, 4096, k, *point))
    assert registers * point[1] * 32 <= 65536  # the block's registers fit an SM


@pytest.mark.parametrize("parts", [1, 2])
def test_the_cluster_meets_through_shared_memory_only(hopper_ptx, parts):
    ptx = hopper_ptx(render(32, 4096, 4096, 8, 8, 3, 64, parts))
    assert ".reqnctapercluster 8, 1, 1" in ptx
    assert "ld.shared::cluster.v4.f32" in ptx and "mapa.shared::cluster" in ptx
    # split barriers: arrive after storing (or reading) a round's partials, wait where they are needed
    assert "barrier.cluster.arrive.release" in ptx and "barrier.cluster.wait.acquire" in ptx
    assert not re.search(r"\batom\.|\bred\.|st\.global\.f32", ptx)  # no counters, no partials in global memory
    # a slab's 4 column steps, each 2 row tiles x 4 batch tiles
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 4 * 2 * 4
    before_wait = ptx.split("griddepcontrol.wait")[0]
    assert "cp.async.cg.shared.global" in before_wait and not re.search(r"ld\.global", before_wait)


@pytest.mark.gpu
@settings(max_examples=resolve_profile().max_examples, deadline=None)  # COOPT_VERIFY_PROFILE=thorough: 200
@given(m=st.sampled_from([16, 32, 64]), groups=st.sampled_from([1, 7, 40, 129, 600]),
       shares=st.sampled_from([1, 2, 3, 7]), cluster=st.sampled_from([1, 2, 4, 8, 16]),
       warps=st.sampled_from([2, 4, 6, 8, 12]), stages=st.sampled_from([2, 3, 4]), kw=st.sampled_from([64, 128]),
       parts=st.sampled_from([1, 2]), pdl=st.booleans(), seed=st.integers(0, 2**16))
def test_it_agrees_with_an_fp32_product(m, groups, shares, cluster, warps, stages, kw, parts, pdl, seed):
    import torch
    from cuda_gemm_skinny_probe import SkinnyGemm

    n, k = 32 * groups, cluster * kw * shares  # a block's share of K: 1, 2, 3 or 7 slabs
    assume(point_problem(m, n, k, cluster, warps, stages, kw, parts) is None)  # e.g. M 16 over 16 blocks: 1 output a thread
    gemm = SkinnyGemm(m, n, k, cluster, warps, stages, kw, parts, pdl)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
    outs = [gemm(x, w) for _ in range(3)]  # back to back: under PDL each waits for the one before
    torch.cuda.synchronize()
    expected = x.float() @ w.float().T
    for out in outs:
        error = (out.float() - expected).abs().max() / expected.abs().max()
        assert error < 1e-2, (float(error), gemm.clusters)
