"""The bandwidth every bench's floors and percentages are taken over.

On an H200 that is the 4.2 TB/s issue 3's targets were set with (a device-to-device copy, bytes
read plus written), so a shape or case compares across sessions. On any other GPU it is this
run's own copy: an H100 copies ~3.0 TB/s, and 4.2 there put every floor 1.4x too low and every
percentage 1.4x too high (session 36 printed both).
"""

from __future__ import annotations

import functools

H200_COPY_BYTES_PER_S = 4.2e12


def measure_copy_bandwidth() -> float:
    """Bytes read plus written a second by a 1 GiB device-to-device copy (do_bench's median)."""
    import torch
    import triton

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**30 / (ms * 1e-3)


def floor_bandwidth(gpu_name: str, measured: float) -> tuple[float, str]:
    """(bytes/s the floors use, what it is): the H200's reference there, else `measured`."""
    if "H200" in gpu_name:
        return (H200_COPY_BYTES_PER_S,
                f"the H200's reference {H200_COPY_BYTES_PER_S / 1e12:.1f} TB/s (this run's copy: {measured / 1e12:.2f})")
    return measured, f"this run's measured copy, {measured / 1e12:.2f} TB/s (not an H200)"


@functools.cache
def reference_bandwidth() -> float:
    """floor_bandwidth for this process's GPU, the copy measured once."""
    import torch

    return floor_bandwidth(torch.cuda.get_device_name(), measure_copy_bandwidth())[0]
