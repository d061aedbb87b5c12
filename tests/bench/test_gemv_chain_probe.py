"""bench/gemv_chain_probe.py without a GPU: the chain kernel as one launch a phase (the classic
grid) computes o, gate|up and down with SwiGLU between them in Triton's interpreter, and the
stage-by-stage check catches a wrong stage. The persistent form meets the other programs
between phases, which the interpreter (programs one after another) cannot run: the GPU test
compares it with the launches."""

from __future__ import annotations

import pytest
import torch
from gemv_chain_probe import Chain, stage_error

HIDDEN, FFN = 64, 96
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the kernels without a GPU


def weights(device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(HIDDEN, generator=gen, device=device).to(torch.bfloat16)
    ws = [(torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(torch.bfloat16)
          for n, k in ((HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN))]
    return [x, *ws]


def test_one_launch_a_phase_computes_the_chain():
    args = weights()
    chain = Chain(0, 16, 32, 2, False, DEVICE, hidden=HIDDEN, ffn=FFN)
    chain(*args)
    assert stage_error(chain, *args) < 2e-2
    chain.y2[FFN:] = -chain.y2[FFN:]  # an up half of the wrong sign: down's input is wrong
    assert stage_error(chain, *args) > 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [False, True])
def test_one_persistent_launch_matches_the_launches_on_the_gpu(prefetch):
    args = weights("cuda")
    launches = Chain(0, 16, 32, 2, False, "cuda", hidden=HIDDEN, ffn=FFN)
    expected = launches(*args).clone()
    persistent = Chain(4, 16, 32, 2, prefetch, "cuda", hidden=HIDDEN, ffn=FFN)
    assert persistent.resident(1, *args)
    for _ in range(3):  # the counters come back to zero for the next launch
        out = persistent(*args)
    torch.testing.assert_close(out, expected)
    assert persistent.counters.count_nonzero() == 0
