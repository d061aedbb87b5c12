"""bench/cuda_gemv_pdl_probe.py: its GEMV compiles for sm_90 without spilling (nvcc, where the
machine has one), only the PDL form with the ring first issues weight copies before its
griddepcontrol.wait and none reads x there, and on a GPU every mode computes the o -> gate|up ->
down chain, silu(gate) * up stored by the gate|up GEMV (a GPU test: CUDA C++ does not run in
Triton's interpreter)."""

from __future__ import annotations

import re

import pytest
from cuda_gemv_pdl_probe import render, shared_bytes

from coopt.targets import H200


def before_wait(ptx: str) -> str:
    return ptx.split("griddepcontrol.wait")[0]


def test_the_default_points_fit_an_sm_twice():
    # x staged (2 bytes an element) and 8 warps x 8 slabs x 2 rows x 512 bytes
    assert shared_bytes(14336) == 2 * 14336 + 8 * 8 * 2 * 512
    assert 2 * (shared_bytes(14336) + 1024) <= 228 * 1024 and shared_bytes(14336) <= H200.smem_per_block_bytes


@pytest.mark.parametrize("k,glu", [(4096, False), (4096, True), (14336, False)])
@pytest.mark.parametrize("dynamic", [False, True])
def test_the_gemv_compiles_for_hopper_without_spills(hopper_registers, k, glu, dynamic):
    assert hopper_registers(render(k, glu, 2, dynamic=dynamic)) * 256 <= 65536 // 2  # two blocks of 8 warps an SM


def test_a_drawn_row_group_is_taken_after_the_wait_only(hopper_ptx):
    # the counter is reset by the launch before's last draw: drawing before the wait could see it unreset
    ptx = hopper_ptx(render(4096, False, 2, dynamic=True))
    assert "atom.global.add" not in before_wait(ptx) and "atom.global.add" in ptx


def test_only_the_ring_first_form_copies_before_its_wait(hopper_ptx):
    plain, wait_first, ring_first = (hopper_ptx(render(4096, False, mode)) for mode in (0, 1, 2))
    assert "griddepcontrol" not in plain
    assert "cp.async" not in before_wait(wait_first) and "cp.async" in wait_first
    assert re.search(r"cp\.async\.cg\.shared\.global", before_wait(ring_first))
    # x is read after the wait only (it is the kernel before's output): no global load before it
    assert not re.search(r"ld\.global", before_wait(ring_first))
    assert "griddepcontrol.launch_dependents" in ring_first.split("griddepcontrol.wait")[1]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("point,dynamic", [((8, 2, 8, 2), False), ((4, 1, 4, 1), False), ((4, 1, 2, 1), True),
                                           ((8, 2, 2, 2), True)])
def test_every_mode_computes_the_chain_on_the_gpu(mode, point, dynamic):
    import torch
    from cuda_gemv_pdl_probe import Triple, stage_error

    hidden, ffn = 512, 768  # multiples of a 256-element slab; more row groups than some grids' warps
    gen = torch.Generator(device="cuda").manual_seed(mode)
    x = torch.randn(hidden, generator=gen, device="cuda").to(torch.bfloat16)
    ws = [(torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
          for n, k in ((hidden, hidden), (2 * ffn, hidden), (hidden, ffn))]
    triple = Triple(mode, *point, hidden=hidden, ffn=ffn, dynamic=dynamic)
    for _ in range(3):  # the PDL forms back to back: each waits for the one before
        triple(x, *ws)
    torch.cuda.synchronize()
    assert stage_error(triple, x, *ws) < 2e-2
    assert all(gemv.counter.item() == 0 for gemv in triple.stages)  # every launch's last draw reset it
    triple.y2[: ffn // 2] = -triple.y2[: ffn // 2]  # a SwiGLU output of the wrong sign: stage 2 is wrong
    assert stage_error(triple, x, *ws) > 0.5
