"""decode_attention_mma over regions that read each sequence's newest keys unrounded
(fp8-kv-cache's exact-recent: attrs "exact_rows_input", "recent" = N, optionally "ring_write").
On the CPU: which of them it takes, that every form compiles for sm_90a without spills.
On the GPU: agreement with the fp32 reference over caches whose window rows hold NaN (never read),
and the step's rows stored into the rings after they were read."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_attention_exact_recent import exact_inputs, exact_region, expected, rings_after_write, with_ring_write
from test_decode_attention_mma import FORMS, MMA, check_attention, folded_fp8, gpu_points, paged  # noqa: F401

from coopt.ir.region import TensorSpec
from coopt.targets import H200
from template_helpers import kernel_source

SHAPE = (3, 32, 8, 512, 128)  # batch, heads, kv heads, S_max, D: Llama-3-8B's heads
# past the cache's first rows (sequence 0: the window starts at position 0), a length of 1 (only
# the own row), a chunk's edge, the cache's end
LENGTHS = {"short": [3, 1, 300], "edges": [257, 4, 512]}


def region(window: int, rows_dtype: str = "float32", ring_write: bool = False):
    plain = exact_region("per-head", window, rows_dtype=rows_dtype, shape=SHAPE)
    return with_ring_write(plain, per_row=True) if ring_write else plain


def test_it_takes_exact_rows_without_a_folded_write_or_pages(gpu_points):  # noqa: F811
    for window, rows, ring_write in ((1, "float32", False), (4, "float32", True), (4, "bfloat16", False), (16, "float32", True)):
        exact = region(window, rows, ring_write)
        assert MMA.matches(exact), (window, rows, ring_write)
        assert MMA.legal_points(exact, H200)
    assert not MMA.matches(region(17))  # its window's rows in shared memory: at most 16
    mixed = region(4)
    at = mixed.attrs["exact_rows_input"]
    k_ring = TensorSpec(mixed.inputs[at + 2].shape, "bfloat16")  # a ring in another dtype than its rows
    assert not MMA.matches(dataclasses.replace(mixed, inputs=(*mixed.inputs[:at + 2], k_ring, *mixed.inputs[at + 3:])))
    for other in (folded_fp8(), paged(16)):  # exact rows beside a folded write or pages: not this kernel's
        rows = TensorSpec((other.inputs[0].shape[0], 8, 1, 128), "float32")
        with_rows = dataclasses.replace(other, inputs=(*other.inputs, rows, rows),
                                        attrs={**other.attrs, "exact_rows_input": len(other.inputs), "recent": 1})
        assert not MMA.matches(with_rows)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("window", "rows", "ring_write"), [(1, "float32", False), (4, "float32", True), (4, "bfloat16", True)])
def test_every_form_compiles_for_hopper_without_spills(hopper_registers, form, window, rows, ring_write):
    params = FORMS[form]
    source = kernel_source(MMA.render(region(window, rows, ring_write), params))
    assert hopper_registers(source) * 32 * params["num_warps"] <= 65536


# -- on the GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize(("window", "rows"), [(1, "float32"), (4, "float32"), (4, "bfloat16"), (16, "float32")])
@pytest.mark.parametrize("form", FORMS)
def test_the_newest_rows_come_from_the_exact_inputs(load_candidate, form, window, rows, lengths):
    exact = region(window, rows)
    inputs = exact_inputs(exact, window, seed=window, lengths=LENGTHS[lengths])
    inputs[0] = inputs[0] * 37.0  # scores far from 1: the fp16 shift must keep q exact in the window too
    module = load_candidate(MMA.render(exact, FORMS[form]), "mma_exact")
    for _ in range(2):  # the merge's counters are zero again after a launch
        (out,) = module.run(*inputs)
        check_attention(out, expected(exact, window, inputs, torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_a_decode_step_writes_its_rows_into_the_rings_after_reading_them(load_candidate, form):
    window = 4
    plain = region(window)
    inputs = exact_inputs(plain, window, seed=2, lengths=LENGTHS["edges"])
    written = torch.tensor([256, 3, 511], dtype=torch.int64, device="cuda")  # each sequence's own position
    want, rings = expected(plain, window, inputs, torch.float64), rings_after_write(inputs, written, window)
    module = load_candidate(MMA.render(region(window, ring_write=True), FORMS[form]), "mma_ring_write")
    k_ring, v_ring, out = module.run(*inputs, written)
    check_attention(out, want)
    assert k_ring.data_ptr() == inputs[-2].data_ptr() and v_ring.data_ptr() == inputs[-1].data_ptr()  # in place
    assert torch.equal(k_ring, rings[0]) and torch.equal(v_ring, rings[1])
