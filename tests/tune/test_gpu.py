"""A real Triton kernel timed by the worker: on the GPU when there is one, in the interpreter here."""

from __future__ import annotations

import pytest
import torch
from tune_helpers import ADD, add_region, write_module

from coopt.tune import measure

TRITON_ADD = """
    import torch
    import triton
    import triton.language as tl


    @triton.jit
    def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.load(a_ptr + offsets, mask=mask)
        b = tl.load(b_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, a + b, mask=mask)


    def run(a, b):
        out = torch.empty_like(a)
        n = a.numel()
        _add_kernel[(triton.cdiv(n, 1024),)](a, b, out, n, BLOCK=1024)
        return (out,)
"""


def test_triton_candidate_in_worker_on_cpu(tmp_path):
    # Without a GPU the worker imports the module in Triton's interpreter (kernel_loader).
    module = write_module(tmp_path, "triton_add", TRITON_ADD)
    timing = measure.measure_candidates(
        add_region(), {"t": module}, {"B": 2}, timeout_s=60, warmup_ms=1, rep_ms=2, allow_cpu=True
    )["t"]
    assert timing.ok, timing.error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_times_triton_kernel_on_gpu(tmp_path):
    triton_add = write_module(tmp_path, "triton_add", TRITON_ADD)
    reference = write_module(tmp_path, "reference", ADD)
    dims = {"B": 1 << 16}  # 3 x 16 MiB: large enough to fill the chip, bandwidth-bound
    timings = measure.measure_candidates(add_region(), {"triton": triton_add, "reference": reference}, dims)
    for label, timing in timings.items():
        assert timing.ok, f"{label}: {timing.error}"
        assert 0 < timing.p20_ms <= timing.median_ms <= timing.p80_ms
        assert timing.device and timing.device != "cpu"
        # below any HBM ceiling we know of: a faster number means the timing is wrong
        assert 0 < timing.achieved_gbps < 10_000
