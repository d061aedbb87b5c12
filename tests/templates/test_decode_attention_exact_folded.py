"""decode_attention reading its newest keys unrounded with the step's cache write folded in
(fuse-kv-write-attention over fp8-kv-cache's exact-recent: attrs "exact_rows": "folded",
"recent", "rings_input"): the own rows are what the folded write computes before rounding (K
roped, rounded to k_new's dtype, less its offset; V less its), the older ones come from the
rings, which the step then writes at its position. The cache rows of every window hold NaN.

The Triton template in the interpreter against torch; the CUDA family compiled for sm_90a on the
CPU and, on the GPU, against the Triton template (caches and rings byte for byte)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_attention import DEVICE, FAMILY, FP8_DOT, FP8_FMA, fp8_region, make_fp8_inputs, run_candidate
from test_decode_attention_exact_recent import expected
from test_decode_attention_kv_write import write_inputs
from test_decode_attention_kv_write_fp8 import fp8_folded, quantized, truncated
from test_decode_attention_mma import FORMS, MMA, check_attention, folded_fp8, gpu_points  # noqa: F401
from test_decode_attention_rope import rope_tables, rotated

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from template_helpers import kernel_source

POSITION = 45
LENGTHS = [46, 17, 46]  # the write at each sequence's own position (0, 2), and past sequence 1's: its own row all the same
OFFSETS = {"smooth-k": ("k",), "smooth-k and smooth-v": ("k", "v")}


def folded_exact(region: RegionSummary, window: int) -> RegionSummary:
    """A folded fp8 region reading each sequence's newest `window` keys unrounded: the write's rows
    before rounding as its own, the rings (of those rows' dtypes) last, written in place."""
    write = region.attrs["kv_write"]
    k_new, v_new = region.inputs[write["positions_input"] + 1:write["positions_input"] + 3]
    batch, kv_heads, _, head_dim = k_new.shape
    dtypes = ["float32" if f"{x}_offset_input" in write else row.dtype for x, row in zip("kv", (k_new, v_new))]
    rings = tuple(TensorSpec((batch, kv_heads, window, head_dim), d) for d in dtypes) if window > 1 else ()
    at = len(region.inputs)
    attrs = {**region.attrs, "exact_rows": "folded", "recent": window, "inplace": [1, 2, at, at + 1] if rings else [1, 2]}
    if rings:
        attrs["rings_input"] = at
    return dataclasses.replace(region, inputs=(*region.inputs, *rings), outputs=(*region.outputs[:2], *rings, region.outputs[-1]),
                               attrs=attrs)


def step_inputs(region: RegionSummary, window: int, lengths, seed: int = 0):
    """The folded exact region's inputs: fp8 caches with NaN in every window's rows, the write's
    tables, offsets, rings ~N(0, 1); and the own rows (K rounded to nearest, as on the GPU)."""
    batch, heads, kv_heads, max_length, head_dim = (region.inputs[0].shape[0], region.attrs["num_heads"],
                                                    region.attrs["num_kv_heads"], region.inputs[1].shape[2],
                                                    region.inputs[0].shape[3])
    plain = fp8_region(batch, heads, kv_heads, max_length, head_dim, "per-head")
    q, k, v, lengths_t, k_scale, v_scale = make_fp8_inputs(plain, lengths, seed=seed)
    for cache in (k, v):
        for b, length in enumerate(lengths):
            cache.view(torch.uint8)[b, :, max(0, length - window):length] = 0x7F  # e4m3 NaN
    cos, sin = rope_tables((1, head_dim), torch.bfloat16)
    k_cos, k_sin = rope_tables((1, head_dim), torch.bfloat16, seed=2)
    k_new, v_new = write_inputs(batch, kv_heads, head_dim, torch.bfloat16, seed=seed + 5)
    write = region.attrs["kv_write"]
    gen = torch.Generator().manual_seed(seed + 9)
    offsets = {x: torch.randn(1, kv_heads, 1, head_dim, generator=gen).to(DEVICE) for x in "kv" if f"{x}_offset_input" in write}
    at = region.attrs.get("rings_input")
    rings = [torch.randn(spec.shape, generator=gen).to(getattr(torch, spec.dtype)).to(DEVICE)
             for spec in region.inputs[at:]] if at is not None else []
    inputs = [q, k, v, lengths_t, cos, sin, k_scale, v_scale, torch.tensor([POSITION], device=DEVICE), k_new, v_new,
              k_cos, k_sin, *offsets.values(), *rings]
    roped = rotated(k_new.float(), k_cos.float(), k_sin.float())
    own = [roped.to(torch.bfloat16).float() - offsets.get("k", 0.0), v_new.float() - offsets.get("v", 0.0)]
    if "v" not in offsets:
        own[1] = v_new  # (kept in v_new's dtype: no offset, no rounding)
    return inputs, own, roped, offsets


def want(region: RegionSummary, window: int, inputs, own, caches, dequantized=None) -> torch.Tensor:
    """The attention over the written `caches` (the position a key where it lies below a length
    and outside the window), the own rows and the rings before the write (the exact-recent
    reference), q rotated."""
    q, _, _, lengths, cos, sin, k_scale, v_scale = inputs[:8]
    k, v = caches
    at = region.attrs.get("rings_input")
    rings = inputs[at:at + 2] if at is not None else []
    plain = fp8_region(q.shape[0], region.attrs["num_heads"], region.attrs["num_kv_heads"], k.shape[2], q.shape[3], "per-head")
    return expected(plain, window, [rotated(q, cos, sin), k, v, lengths, k_scale, v_scale, *own, *rings], dequantized)


@pytest.mark.parametrize("window", [1, 4])
@pytest.mark.parametrize("offsets", OFFSETS)
@pytest.mark.parametrize("params", [FP8_FMA, {**FP8_DOT, "SPLIT_KV": 4}], ids=["fma", "dot-four-splits"])
def test_the_own_rows_are_the_folded_writes_before_rounding(window, offsets, params, load_candidate):
    _, folded = fp8_folded("per-head", OFFSETS[offsets])
    region = folded_exact(folded, window)
    assert FAMILY.matches(region) and FAMILY.check(region, params, H200) is None
    inputs, own, roped, centres = step_inputs(region, window, LENGTHS)
    before = [t.clone() for t in inputs]
    outputs = run_candidate(load_candidate, region, params, inputs)
    k_out, v_out, *rings_out, out = outputs
    torch.testing.assert_close(out.float(), want(region, window, before, own, (k_out, v_out)), rtol=2e-2, atol=2e-2)
    # the caches: the quantized row at the position (K rounded to nearest or, the interpreter,
    # truncated to bf16 first), every other row untouched, NaN bytes included
    k_rows = [roped.to(torch.bfloat16).float(), truncated(roped, torch.bfloat16)]
    stored = [quantized(row[:, :, 0] - centres["k"][:, :, 0], before[6]).float() for row in k_rows]
    new_row = k_out[:, :, POSITION].float()
    assert ((new_row == stored[0]) | (new_row == stored[1])).all()
    assert torch.equal(v_out[:, :, POSITION].float(), quantized(own[1][:, :, 0].float(), before[7]).float())
    others = [p for p in range(k_out.shape[2]) if p != POSITION]
    for got, was in ((k_out, before[1]), (v_out, before[2])):
        assert torch.equal(got[:, :, others].view(torch.uint8), was[:, :, others].view(torch.uint8))
    if window > 1:  # slot POSITION % window holds the own rows, the others as they were
        slot, kept = POSITION % window, [s for s in range(window) if s != POSITION % window]
        k_ring, v_ring = rings_out
        k_own = [row[:, :, 0] - centres["k"][:, :, 0] for row in k_rows]  # (either rounding, as the cache's)
        assert ((k_ring[:, :, slot] == k_own[0]) | (k_ring[:, :, slot] == k_own[1])).all()
        assert torch.equal(v_ring[:, :, slot], own[1][:, :, 0])
        for got, was in zip(rings_out, before[-2:]):
            assert torch.equal(got[:, :, kept], was[:, :, kept])


def test_the_schema_of_folded_exact_rows():
    _, folded = fp8_folded("per-head", ("k",))
    region = folded_exact(folded, 4)
    assert FAMILY.matches(region)
    at = region.attrs["rings_input"]
    wrong_ring = TensorSpec(region.inputs[at].shape, "bfloat16")  # K's rows are fp32 (centred)
    assert not FAMILY.matches(dataclasses.replace(region, inputs=(*region.inputs[:at], wrong_ring, region.inputs[at + 1])))
    assert not FAMILY.matches(dataclasses.replace(region, inputs=region.inputs[:at]))  # rings missing
    assert not FAMILY.matches(dataclasses.replace(region, attrs={**region.attrs, "inplace": [1, 2]}))


# -- the CUDA family ---------------------------------------------------------------------------


def mma_region(window: int, offsets=("k",)) -> RegionSummary:
    return folded_exact(folded_fp8(batch=3, offsets=offsets), window)


def test_the_cuda_family_takes_folded_exact_rows(gpu_points):  # noqa: F811
    for window in (1, 4, 16):
        assert MMA.matches(mma_region(window)) and MMA.legal_points(mma_region(window), H200)
    assert not MMA.matches(mma_region(17))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("offsets", OFFSETS)
def test_the_cuda_form_compiles_for_hopper_without_spills(hopper_registers, form, offsets):
    params = FORMS[form]
    source = kernel_source(MMA.render(mma_region(4, OFFSETS[offsets]), params))
    assert hopper_registers(source) * 32 * params["num_warps"] <= 65536


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("window", "offsets"), [(1, "smooth-k"), (4, "smooth-k"), (4, "smooth-k and smooth-v")])
@pytest.mark.parametrize("lengths", [[46, 17, 46], [46, 3, 512]], ids=["one-past", "short-and-full"])
def test_the_cuda_kernel_writes_and_reads_as_the_triton_template(load_candidate, form, window, offsets, lengths):
    region = mma_region(window, OFFSETS[offsets])
    inputs, own, _, _ = step_inputs(region, window, lengths)
    fresh = lambda: [t.clone() for t in inputs]
    triton_params = {"BLOCK_N": 64, "SPLIT_KV": 4, "USE_DOT": True, "TILE_FP16": True, "num_warps": 4, "num_stages": 2}
    got = load_candidate(MMA.render(region, FORMS[form]), "mma_exact_folded").run(*fresh())
    ref = load_candidate(FAMILY.render(region, triton_params), "triton_exact_folded").run(*fresh())
    for mine, theirs in zip(got[:-1], ref[:-1]):  # the caches, then the rings
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    check_attention(got[-1], want(region, window, inputs, own, got[:2], torch.float64))
