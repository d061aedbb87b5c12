"""Each region of a built step timed on its own and set against the bytes it moves: the
per-kernel achieved bandwidth a decode step's closing notes must give (bench/profile_step.py
--regions).

A build's program calls its regions through `built._kernels[name](...)`; `time_regions` wraps
each in a profiler range `region:<name>` and runs the step (plain calls, not the CUDA graph, so
the ranges exist) under torch.profiler: a region's time is the device time of the kernels
launched inside its range, per step. `region_bytes` reads what the build's report says each
region moves at the example shapes; a cache counts whole there, so `region_table` scales the
attention regions by the valid share of the cache and leaves the in-place cache writes (one row
written, the whole cache counted) without a bandwidth.
"""

from __future__ import annotations

import re
from pathlib import Path

_HEADING = re.compile(r"^### (\S+) \((\w+)\)$")
_MOVED = re.compile(r"; ([0-9.]+) MB moved")
_IDENTICAL = re.compile(r"^identical to (\S+) ")
# regions that read a KV cache (bytes scale with the valid share) / write one in place
_CACHE_READERS = ("decode_attention",)
_IN_PLACE = ("kv_write",)


def region_bytes(report: Path) -> dict[str, tuple[str, float]]:
    """{region: (family, MB moved at the example shapes)} from a build's report.md; a region
    "identical to" another takes that one's figure."""
    regions: dict[str, tuple[str, float]] = {}
    same: dict[str, str] = {}
    current = None
    for line in Path(report).read_text().splitlines():
        heading = _HEADING.match(line)
        if heading:
            current = heading.group(1)
            regions[current] = (heading.group(2), 0.0)
            continue
        if current is None:
            continue
        moved, twin = _MOVED.search(line), _IDENTICAL.match(line)
        if moved and line.startswith("inputs:"):
            regions[current] = (regions[current][0], float(moved.group(1)))
        elif twin:
            same[current] = twin.group(1)
    for region, twin in same.items():
        if twin in regions:
            regions[region] = (regions[region][0], regions[twin][1])
    return regions


def time_regions(built, inputs, *, steps: int = 20) -> dict[str, float]:
    """{region: device µs per step} of `built(*inputs)` called `steps` times under the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    original = dict(built._kernels)

    def wrapped(name, run):
        def call(*args):
            with record_function(f"region:{name}"):
                return run(*args)
        return call

    built._kernels.update({name: wrapped(name, run) for name, run in original.items()})
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        with torch.no_grad():
            built(*inputs)  # warm: compiled kernels, workspaces
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    built(*inputs)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
    finally:
        built._kernels.update(original)
    times = {}
    for event in prof.key_averages():
        if event.key.startswith("region:"):
            device = getattr(event, "device_time_total", None)
            if device is None:
                device = getattr(event, "cuda_time_total", 0.0)
            times[event.key.removeprefix("region:")] = device / steps
    return times


def region_table(times: dict[str, float], moved: dict[str, tuple[str, float]], *, valid_share: float = 1.0) -> list[dict]:
    """Rows {region, family, us, mb, tb_per_s}, slowest first. MB: the report's figure, times
    `valid_share` for regions reading a KV cache; in-place cache writes get no bandwidth."""
    rows = []
    for region, us in sorted(times.items(), key=lambda kv: -kv[1]):
        family, mb = moved.get(region, ("?", 0.0))
        if family in _CACHE_READERS:
            mb *= valid_share
        rate = None if family in _IN_PLACE or us <= 0 or mb <= 0 else mb * 1e6 / (us * 1e-6) / 1e12
        rows.append({"region": region, "family": family, "us": us, "mb": mb, "tb_per_s": rate})
    return rows
