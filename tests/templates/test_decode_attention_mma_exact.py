"""decode_attention_mma over regions that read each sequence's newest keys unrounded
(fp8-kv-cache's exact-recent: attrs "exact_rows_input", "recent" = N, optionally "ring_write").
On the CPU: which of them it takes, that every form compiles for sm_90a without spills.
On the GPU: agreement with the fp32 reference over caches whose window rows hold NaN (never read),
and the step's rows stored into the rings after they were read."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_attention import make_paged_inputs
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
    folded = folded_fp8()  # exact rows beside a folded write that is not exact-recent's: not this kernel's
    rows = TensorSpec((folded.inputs[0].shape[0], 8, 1, 128), "float32")
    assert not MMA.matches(dataclasses.replace(folded, inputs=(*folded.inputs, rows, rows),
                                               attrs={**folded.attrs, "exact_rows_input": len(folded.inputs), "recent": 1}))
    # through pages: the rings through ring_slots (paged-kv), not by batch row
    assert MMA.matches(paged_exact()) and MMA.legal_points(paged_exact(), H200)
    no_slots = paged_exact()
    no_slots = dataclasses.replace(no_slots, inputs=no_slots.inputs[:-1],
                                   attrs={k: v for k, v in no_slots.attrs.items() if k != "ring_slots_input"})
    assert not MMA.matches(no_slots)


def paged_exact(window: int = 4, slots: int = 5):
    """paged(16) over 3 sequences reading their newest `window` keys unrounded: k_exact, v_exact
    fp32, rings as pools of `slots` ring slots, the step's rows written into them at positions [B],
    ring_slots [B] int32 last (paged-kv's form)."""
    base = paged(16, max_pages=4)
    rows = TensorSpec((3, 8, 1, 128), "float32")
    pool = TensorSpec((slots, 8, window, 128), "float32")
    inputs = (*base.inputs, rows, rows, pool, pool, TensorSpec((3,), "int64"), TensorSpec((3,), "int32"))
    at = len(base.inputs)
    attrs = {**base.attrs, "exact_rows_input": at, "recent": window, "inplace": [at + 2, at + 3],
             "ring_write": {"positions_input": at + 4, "per_row": True}, "ring_slots_input": at + 5}
    return dataclasses.replace(base, inputs=inputs, outputs=(pool, pool, *base.outputs), attrs=attrs)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("window", "rows", "ring_write"), [(1, "float32", False), (4, "float32", True), (4, "bfloat16", True),
                                                           ("paged", "float32", True)])
def test_every_form_compiles_for_hopper_without_spills(hopper_registers, form, window, rows, ring_write):
    params = FORMS[form]
    exact = paged_exact() if window == "paged" else region(window, rows, ring_write)
    source = kernel_source(MMA.render(exact, params))
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


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_pages_and_rings_through_their_slots(load_candidate, form):
    """paged-kv's exact-recent step: keys through the page table up to length - 4 (the window's
    rows of the pages hold NaN: never read), the window from k_exact / v_exact and each row's ring
    slot (the other slots NaN), the step's rows written into the row's slot."""
    window, lengths, slots = 4, [3, 40, 17], [4, 0, 2]
    region = paged_exact(window)
    inputs, caches = make_paged_inputs(dataclasses.replace(region, inputs=region.inputs[:7]), lengths, seed=4)
    table = inputs[4].long()
    for pages in inputs[1:3]:
        for b, length in enumerate(lengths):
            for position in range(max(0, length - window), length):
                pages.view(torch.uint8)[table[b, position // 16], :, position % 16] = 0x7F  # e4m3 NaN
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(3, 8, 1, 128, generator=gen).cuda() for _ in "kv"]
    rings = [torch.randn(3, 8, window, 128, generator=gen).cuda() for _ in "kv"]
    slot_index = torch.tensor(slots, device="cuda")
    pools = [torch.full((5, 8, window, 128), float("nan"), device="cuda") for _ in "kv"]
    for pool, ring in zip(pools, rings):
        pool[slot_index] = ring
    positions = torch.tensor(lengths, device="cuda") - 1
    unpaged = exact_region("per-head", window, shape=(3, 32, 8, caches[0].shape[2], 128))
    want = expected(unpaged, window, [inputs[0], *caches, inputs[3], *inputs[5:7], *rows, *rings], torch.float64)
    after = rings_after_write([*inputs[:6], *rows, *rings], positions, window)  # (the rows at 6, 7, the rings last)
    module = load_candidate(MMA.render(region, FORMS[form]), "mma_paged_exact")
    k_pool, v_pool, out = module.run(*inputs, *rows, *pools, positions, torch.tensor(slots, dtype=torch.int32, device="cuda"))
    check_attention(out, want)
    assert torch.equal(k_pool[slot_index], after[0]) and torch.equal(v_pool[slot_index], after[1])
    assert k_pool[[1, 3]].isnan().all() and v_pool[[1, 3]].isnan().all()  # no slot of another sequence written
