"""bench/mlp_dataflow_probe.py without a GPU: the MLP's gate|up and down tasks compute
silu(gate) * up then down + residual in Triton's interpreter, as two launches and as the dataflow
launch (the interpreter runs programs one after another, so the first takes every task in ticket
order and no down task ever waits: the waiting itself is the GPU test's), and the counters come
back to zero for the next launch."""

from __future__ import annotations

import pytest
import torch
from mlp_dataflow_probe import Mlp, make_inputs, reference, relative_error

HIDDEN, FFN, BATCH = 64, 128, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the kernels without a GPU


def probe(programs: int, device=DEVICE) -> Mlp:
    return Mlp(programs, BATCH, 2, 16, 32, 16, 32, 2, 4, device, hidden=HIDDEN, ffn=FFN)


@pytest.mark.parametrize("programs", [0, 3])
def test_the_tasks_compute_the_mlp_and_leave_the_counters_at_zero(programs):
    inputs = make_inputs(BATCH, HIDDEN, FFN, DEVICE)
    mlp = probe(programs)
    for _ in range(2):  # a second launch starts from the counters the first left
        out = mlp(*inputs)
        assert relative_error(out, reference(*inputs)) < 2e-2
        assert mlp.counters.count_nonzero() == 0


def test_the_check_sees_a_wrong_up_half():
    x, w_gu, w_down, residual = make_inputs(BATCH, HIDDEN, FFN, DEVICE)
    out = probe(3)(x, w_gu, w_down, residual).clone()
    w_gu[FFN:] = -w_gu[FFN:]
    assert relative_error(out, reference(x, w_gu, w_down, residual)) > 0.5


def test_tiles_that_do_not_divide_the_shapes_are_refused():
    with pytest.raises(ValueError, match="do not divide"):
        Mlp(0, BATCH, 3, 16, 32, 16, 32, 2, 4, DEVICE, hidden=HIDDEN, ffn=FFN)


@pytest.mark.gpu
def test_the_dataflow_launch_matches_the_launches_on_the_gpu():
    inputs = make_inputs(BATCH, HIDDEN, FFN, "cuda")
    expected = probe(0, "cuda")(*inputs).clone()
    dataflow = probe(8, "cuda")  # more programs than a tile's tasks: waits happen on the GPU
    for _ in range(3):
        out = dataflow(*inputs)
    torch.testing.assert_close(out, expected)
    assert dataflow.counters.count_nonzero() == 0
