"""decode_attention over an fp8 cache whose newest keys are read unrounded (fp8-kv-cache's
exact-recent, attrs "exact_rows_input" and "recent" = N): each sequence's own row (position
lengths[b] - 1) from k_exact / v_exact, the N - 1 before it from the rings (position p at slot
p % N), older rows from the cache. The cache rows inside the window hold NaN: the kernel must not
read them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_attention import SMALL, fp8_lengths_region
from test_attention import make_fp8_inputs as make_prompt_inputs
from test_decode_attention import (
    DEVICE,
    FAMILY,
    FP8_DOT,
    FP8_FMA,
    dequantize,
    fp8_region,
    make_fp8_inputs,
    run_candidate,
)

from coopt.ir.region import TensorSpec
from coopt.targets import H200
from coopt.templates.attention import AttentionFamily
from coopt.templates.decode_attention_mma import DecodeAttentionMmaFamily

BATCH, KV_HEADS, HEAD_DIM, MAX_LENGTH = 3, 2, 64, 80
LENGTHS = [46, 3, 80]  # the window past the first position in sequence 1 (for N 4), at the cache's end in 2


def exact_region(granularity: str, window: int, dtype: str = "bfloat16", rows_dtype: str = "float32",
                 shape=(BATCH, 8, KV_HEADS, MAX_LENGTH, HEAD_DIM)):
    """decode_attention over fp8 caches reading each sequence's newest `window` keys unrounded;
    `shape` = (batch, heads, kv heads, S_max, D)."""
    batch, heads, kv_heads, max_length, head_dim = shape
    base = fp8_region(batch, heads, kv_heads, max_length, head_dim, granularity, dtype)
    rows = TensorSpec((batch, kv_heads, 1, head_dim), rows_dtype)
    rings = (TensorSpec((batch, kv_heads, window, head_dim), rows_dtype),) * 2 if window > 1 else ()
    return dataclasses.replace(base, inputs=(*base.inputs, rows, rows, *rings),
                               attrs={**base.attrs, "exact_rows_input": len(base.inputs), "recent": window})


def exact_inputs(region, window: int, seed: int = 0, lengths=LENGTHS):
    """The fp8 inputs with NaN in every cache row of the window, the exact rows and rings ~N(0, 1)."""
    inputs = make_fp8_inputs(dataclasses.replace(region, inputs=region.inputs[:6]), lengths, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dtype = getattr(torch, region.inputs[6].dtype)
    batch, kv_heads, _, head_dim = region.inputs[6].shape
    rows = [torch.randn(batch, kv_heads, 1, head_dim, generator=gen).to(dtype).to(DEVICE) for _ in "kv"]
    rings = [torch.randn(batch, kv_heads, window, head_dim, generator=gen).to(dtype).to(DEVICE) for _ in "kv"] \
        if window > 1 else []
    for cache in inputs[1:3]:
        for b, length in enumerate(lengths):
            cache.view(torch.uint8)[b, :, max(0, length - window):length] = 0x7F  # e4m3 NaN
    return inputs + rows + rings


def expected(region, window: int, inputs, dequantized=None) -> torch.Tensor:
    """Each sequence over the dequantized cache with its window's rows replaced (SDPA in fp32; in
    float64 where `dequantized` is float64, as verification's ref_hi runs it: the region's own
    reference dequantizes to q's dtype, whose rounding is past the tolerance at large scores)."""
    q, k, v, lengths, k_scale, v_scale, k_own, v_own, *rings = inputs
    granularity, group = region.attrs["kv_scale"], q.shape[1] // k.shape[1]
    dequantized = dequantized or q.dtype
    work = torch.float64 if dequantized == torch.float64 else torch.float32
    keys, values = (dequantize(c, s.to(work), granularity, dequantized).to(work) for c, s in ((k, k_scale), (v, v_scale)))
    out = torch.empty(q.shape, dtype=work, device=q.device)
    for b, length in enumerate(lengths.tolist()):
        for position in range(max(0, length - window), length):
            for cache, own, ring in ((keys, k_own, rings[0] if rings else None), (values, v_own, rings[1] if rings else None)):
                cache[b, :, position] = (own[b, :, 0] if position == length - 1 else ring[b, :, position % window]).to(work)
        kb, vb = (t[b:b + 1, :, :length].repeat_interleave(group, 1) for t in (keys, values))
        out[b] = F.scaled_dot_product_attention(q[b:b + 1].to(work), kb, vb, scale=region.attrs["scale"])[0]
    return out.float()


@pytest.mark.parametrize("window", [1, 3, 4])
@pytest.mark.parametrize("granularity", ["per-head", "per-token"])
@pytest.mark.parametrize("params", [FP8_FMA, FP8_DOT, {**FP8_DOT, "TILE_FP16": True}, {**FP8_FMA, "SPLIT_KV": 4},
                                    {**FP8_DOT, "SPLIT_KV": 1}],
                         ids=["fma", "dot-four-splits", "fp16-tiles", "fma-four-splits", "dot"])
def test_the_newest_rows_come_from_the_exact_inputs(window, granularity, params, load_candidate):
    if params.get("TILE_FP16") and granularity == "per-token":
        pytest.skip("TILE_FP16 is for per-tensor / per-head scales")
    region = exact_region(granularity, window)
    inputs = exact_inputs(region, window)
    (out,) = run_candidate(load_candidate, region, params, inputs)
    torch.testing.assert_close(out.float(), expected(region, window, inputs), rtol=2e-2, atol=2e-2)


def test_bf16_rows_and_the_schema(load_candidate):
    region = exact_region("per-head", 4, rows_dtype="bfloat16")
    inputs = exact_inputs(region, 4, seed=3)
    (out,) = run_candidate(load_candidate, region, FP8_FMA, inputs)
    torch.testing.assert_close(out.float(), expected(region, 4, inputs), rtol=2e-2, atol=2e-2)
    assert FAMILY.matches(region) and FAMILY.check(region, FP8_FMA, H200) is None
    # the CUDA family takes D = 128 only (tests/templates/test_decode_attention_mma_exact.py)
    assert not DecodeAttentionMmaFamily().matches(region)
    # rings missing, of another window, or rows of the wrong shape: not this schema
    assert not FAMILY.matches(dataclasses.replace(region, inputs=region.inputs[:-2]))
    assert not FAMILY.matches(dataclasses.replace(region, attrs={**region.attrs, "recent": 8}))
    short = TensorSpec((BATCH, KV_HEADS, 2, HEAD_DIM), "bfloat16")
    assert not FAMILY.matches(dataclasses.replace(region, inputs=(*region.inputs[:6], short, short, *region.inputs[8:])))


# -- the prompt over the cache (family attention): query i's window counted back from its own row --

PROMPT = AttentionFamily()
PROMPT_LENGTHS = {"a chunk at 10..15": [11, 12, 13, 14, 15, 16], "from position 0": [1, 2, 3, 4, 5, 6],
                  "any lengths (as fuzzing draws them)": [70, 1, 17, 3, 16, 33]}


def prompt_region(granularity: str, window: int, rows_dtype: str = "float32"):
    base = fp8_lengths_region(2, 4, 2, 6, 70, 32, granularity)
    rows = TensorSpec((2, 2, 6, 32), rows_dtype)
    rings = (TensorSpec((2, 2, window, 32), rows_dtype),) * 2 if window > 1 else ()
    return dataclasses.replace(base, inputs=(*base.inputs, rows, rows, *rings),
                               attrs={**base.attrs, "exact_rows_input": len(base.inputs), "recent": window})


def prompt_expected(region, window: int, inputs) -> torch.Tensor:
    """The op's semantics, query by query: keys p - d (d < window, p - d >= 0) from k_exact row
    i - d while that is >= 0, else from the ring's slot (p - d) % window; older keys dequantized."""
    q, k, v, lengths, k_scale, v_scale, k_rows, v_rows, *rings = inputs
    granularity, group = region.attrs["kv_scale"], q.shape[1] // k.shape[1]
    keys, values = (dequantize(c, s, granularity, q.dtype).float() for c, s in ((k, k_scale), (v, v_scale)))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i, length in enumerate(lengths.tolist()):
        kq, vq = keys[:, :, :length].clone(), values[:, :, :length].clone()
        for d in range(min(window, length)):
            row = (k_rows[:, :, i - d], v_rows[:, :, i - d]) if i - d >= 0 else \
                (rings[0][:, :, (length - 1 - d) % window], rings[1][:, :, (length - 1 - d) % window])
            kq[:, :, length - 1 - d], vq[:, :, length - 1 - d] = row[0].float(), row[1].float()
        out[:, :, i:i + 1] = F.scaled_dot_product_attention(q[:, :, i:i + 1].float(), kq.repeat_interleave(group, 1),
                                                            vq.repeat_interleave(group, 1), scale=region.attrs["scale"])
    return out


@pytest.mark.parametrize("case", PROMPT_LENGTHS)
@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("params", [SMALL, {**SMALL, "PACK_GQA": True}, {**SMALL, "SPLIT_KV": 2}],
                         ids=["plain", "pack_gqa", "split_kv"])
def test_a_prompt_reads_its_rows_then_the_rings_for_each_querys_window(case, window, params, load_candidate):
    region = prompt_region("per-head", window)
    inputs = make_prompt_inputs(dataclasses.replace(region, inputs=region.inputs[:6]), PROMPT_LENGTHS[case], seed=5)
    gen = torch.Generator().manual_seed(6)
    inputs += [torch.randn(2, 2, 6, 32, generator=gen).to(DEVICE) for _ in "kv"]
    inputs += [torch.randn(2, 2, window, 32, generator=gen).to(DEVICE) for _ in "kv"] if window > 1 else []
    assert PROMPT.matches(region) and not FAMILY.matches(region)
    (out,) = run_candidate.func(PROMPT, H200, load_candidate, region, params, inputs)
    torch.testing.assert_close(out.float(), prompt_expected(region, window, inputs), rtol=2e-2, atol=2e-2)


def test_prompt_schema():
    region = prompt_region("per-token", 3)
    assert PROMPT.matches(region)
    assert not PROMPT.matches(dataclasses.replace(region, inputs=region.inputs[:-2]))  # rings missing
    short = TensorSpec((2, 2, 5, 32), "float32")  # one row fewer than the queries
    assert not PROMPT.matches(dataclasses.replace(region, inputs=(*region.inputs[:6], short, short, *region.inputs[8:])))


def with_ring_write(region, per_row: bool):
    """The region storing the step's rows into its rings (attrs "ring_write"): positions last, the
    rings written in place."""
    positions = TensorSpec((region.inputs[0].shape[0],) if per_row else (1,), "int64")
    at = region.attrs["exact_rows_input"]
    return dataclasses.replace(region, inputs=(*region.inputs, positions),
                               outputs=(region.inputs[at + 2], region.inputs[at + 3], *region.outputs),
                               attrs={**region.attrs, "ring_write": {"positions_input": len(region.inputs), "per_row": per_row},
                                      "inplace": [at + 2, at + 3]})


def rings_after_write(inputs, written, window: int):
    """The rings as the step leaves them: each sequence's own row at slot written[b] % window."""
    rings = [r.clone() for r in inputs[-2:]]
    per_row = written.numel() > 1
    for b in range(rings[0].shape[0]):
        slot = int(written[b if per_row else 0]) % window
        for ring, rows in zip(rings, inputs[6:8]):
            ring[b, :, slot] = rows[b, :, 0]
    return rings


@pytest.mark.parametrize("per_row", [False, True], ids=["shared-position", "per-row"])
@pytest.mark.parametrize("params", [FP8_FMA, FP8_DOT], ids=["fma", "dot-four-splits"])
def test_a_decode_step_writes_its_rows_into_the_rings_after_reading_them(per_row, params, load_candidate):
    """attrs "ring_write": the output as without it (the rings read before the write), then each
    sequence's own row at slot positions[b] % N of both rings, every other slot unchanged."""
    window = 4
    base = exact_region("per-head", window)
    region = with_ring_write(base, per_row)
    assert FAMILY.matches(region) and not PROMPT.matches(region)
    inputs = exact_inputs(base, window, seed=2)
    written = torch.tensor([45, 2, 79] if per_row else [45], dtype=torch.int64, device=DEVICE)
    want = expected(base, window, inputs)
    rings = rings_after_write(inputs, written, window)
    k_ring, v_ring, out = run_candidate(load_candidate, region, params, inputs + [written])
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    assert torch.equal(k_ring.cpu(), rings[0].cpu()) and torch.equal(v_ring.cpu(), rings[1].cpu())


# -- paged-kv's ring slots (attrs "ring_slots_input"): row b's ring is pool[ring_slots[b]] ---------

SLOTS = [4, 0, 2]  # shuffled, in a pool of 5 rings: slots 1 and 3 belong to no row (NaN)


def in_ring_slots(region, inputs, rings_at: int, pool: int = 5):
    """The region reading its rings as pools of `pool` slots through ring_slots [B] int32 (last),
    and its inputs with each row's ring moved to its slot of SLOTS, NaN in every other slot."""
    batch = region.inputs[0].shape[0]
    ring = region.inputs[rings_at]
    pools = (TensorSpec((pool, *ring.shape[1:]), ring.dtype),) * 2
    slots = torch.tensor(SLOTS[:batch], dtype=torch.int32, device=DEVICE)
    moved = []
    for tensor in inputs[rings_at:rings_at + 2]:
        slotted = torch.full((pool, *tensor.shape[1:]), float("nan"), dtype=tensor.dtype, device=DEVICE)
        slotted[slots.long()] = tensor
        moved.append(slotted)
    spec = (*region.inputs[:rings_at], *pools, *region.inputs[rings_at + 2:], TensorSpec((batch,), "int32"))
    outputs = tuple(pools[i] if o is ring else o for i, o in enumerate(region.outputs))
    region = dataclasses.replace(region, inputs=spec, outputs=outputs,
                                 attrs={**region.attrs, "ring_slots_input": len(spec) - 1})
    return region, [*inputs[:rings_at], *moved, *inputs[rings_at + 2:], slots]


@pytest.mark.parametrize("params", [FP8_FMA, FP8_DOT], ids=["fma", "dot-four-splits"])
def test_a_decode_step_reads_and_writes_each_rows_ring_through_its_slot(params, load_candidate):
    """The ring-write test above with the rings in shuffled slots of larger pools: the same
    output (no row reads another's ring, nor a NaN slot) and each row's write in its own slot."""
    window = 4
    base = exact_region("per-head", window)
    inputs = exact_inputs(base, window, seed=2)
    written = torch.tensor([45, 2, 79], dtype=torch.int64, device=DEVICE)
    want, rings = expected(base, window, inputs), rings_after_write(inputs, written, window)
    region, slotted = in_ring_slots(with_ring_write(base, per_row=True), inputs + [written], 8)
    assert FAMILY.matches(region) and not DecodeAttentionMmaFamily().matches(region)
    k_ring, v_ring, out = run_candidate(load_candidate, region, params, slotted)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    slots = torch.tensor(SLOTS).long()
    assert torch.equal(k_ring.cpu()[slots], rings[0].cpu()) and torch.equal(v_ring.cpu()[slots], rings[1].cpu())
    assert k_ring.cpu()[[1, 3]].isnan().all()  # no write outside the rows' slots
    # ring_slots must be [B] int32, last
    wrong = dataclasses.replace(region, inputs=(*region.inputs[:-1], TensorSpec((3,), "int64")))
    assert not FAMILY.matches(wrong)


def test_a_prompt_reads_each_rows_ring_through_its_slot(load_candidate):
    window, lengths = 3, PROMPT_LENGTHS["a chunk at 10..15"]
    base = prompt_region("per-head", window)
    inputs = make_prompt_inputs(dataclasses.replace(base, inputs=base.inputs[:6]), lengths, seed=5)
    gen = torch.Generator().manual_seed(6)
    inputs += [torch.randn(2, 2, 6, 32, generator=gen).to(DEVICE) for _ in "kv"]
    inputs += [torch.randn(2, 2, window, 32, generator=gen).to(DEVICE) for _ in "kv"]
    want = prompt_expected(base, window, inputs)
    region, slotted = in_ring_slots(base, inputs, 8)
    assert PROMPT.matches(region)
    (out,) = run_candidate.func(PROMPT, H200, load_candidate, region, SMALL, slotted)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
