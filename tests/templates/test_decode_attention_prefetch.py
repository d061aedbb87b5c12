"""decode_attention's L2 prefetch before the PDL wait (templates/triton/decode_attention.py.j2,
prefetch_kv): launched with programmatic dependent launch, each program pulls the first tiles of
its split's K and V rows into L2 while the previous kernel drains. Run in Triton's interpreter
with PDL forced on (gdc_wait a no-op, the prefetch recorded instead of issued): the addresses
must be exactly the rows of the split's first tiles of its own (sequence, kv head), every
128-byte line of them, and nothing outside the caches. The answers stay the plain kernel's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.language as tl
from test_decode_attention import DEVICE, FAMILY, check_close, make_inputs, make_region, reference

from coopt.targets import H200
from coopt.templates.decode_attention import _PREFETCH_TILES

if DEVICE != "cpu":
    pytest.skip("the interpreter records the prefetches; a GPU issues them", allow_module_level=True)

BATCH, HEADS, KV_HEADS, S_MAX, HEAD_DIM = 2, 8, 2, 256, 128
POINTS = {
    "splits": {"BLOCK_N": 16, "SPLIT_KV": 4, "USE_DOT": True, "num_warps": 2, "num_stages": 2},
    "one-split": {"BLOCK_N": 32, "SPLIT_KV": 1, "USE_DOT": True, "num_warps": 2, "num_stages": 2},
}


def _line_aligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` starting on a 128-byte line, as the GPU's allocator places every cache (the
    CPU's gives 64 bytes: a 256-byte row would then straddle three lines, not two)."""
    flat = torch.empty(t.numel() + 128 // t.element_size(), dtype=t.dtype)
    skip = (-flat.data_ptr() % 128) // t.element_size()
    return flat[skip:skip + t.numel()].view(t.shape).copy_(t)


def _expected_lines(k, v, lengths, params) -> set[int]:
    """Every 128-byte line of the rows the programs should prefetch: per (sequence, kv head,
    split) the split's first _PREFETCH_TILES tiles of keys, in K and in V."""
    block_n, splits = params["BLOCK_N"], params["SPLIT_KV"]
    lines = set()
    for b, length in enumerate(lengths.tolist()):
        chunk = -(-(-(-length // splits)) // block_n) * block_n
        for split in range(splits):
            start = min(split * chunk, length)
            end = min(start + min(chunk, _PREFETCH_TILES * block_n), length)
            for cache in (k, v):
                for h in range(KV_HEADS):
                    for key in range(start, end):
                        row = cache[b, h, key]
                        first = row.data_ptr()
                        lines.update(range(first // 128, (first + row.numel() * row.element_size() - 1) // 128 + 1))
    return lines


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("lengths", [[1, S_MAX], [200, 33]], ids=["edges", "odd"])
def test_prefetched_lines_are_the_splits_first_tiles(point, lengths, load_candidate, monkeypatch):
    params = POINTS[point]
    region = make_region(BATCH, HEADS, KV_HEADS, S_MAX, HEAD_DIM, "bfloat16")
    assert FAMILY.check(region, params, H200) is None
    module = load_candidate(FAMILY.render(region, params))
    addresses: list[np.ndarray] = []

    def record(ptrs):  # stands in for the inline-asm prefetch the interpreter cannot run
        addresses.append(np.asarray(ptrs.handle.data).ravel().copy())
        return ptrs

    monkeypatch.setattr(module, "_prefetch_l2", record)
    monkeypatch.setattr(module, "PDL", True)
    monkeypatch.setattr(tl.extra.cuda, "gdc_wait", lambda: None)
    monkeypatch.setattr(tl.extra.cuda, "gdc_launch_dependents", lambda: None)
    q, k, v, lens = make_inputs(region, lengths, seed=3)
    k, v = _line_aligned(k), _line_aligned(v)
    (out,) = module.run(q, k, v, lens)
    check_close(out, reference(region, q, k, v, lens))
    touched = {int(a) // 128 for chunk in addresses for a in chunk}
    assert touched == _expected_lines(k, v, lens, params)


def test_paged_caches_prefetch_nothing():
    # a page table would be one more dependent load before the wait: paged kernels do not prefetch
    from test_decode_attention import paged_region

    region = paged_region(2, 8, 2, 16, 16, 4, 64, "bfloat16")
    assert "_prefetch_l2" not in FAMILY.render(region, POINTS["splits"])
