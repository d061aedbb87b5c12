"""bench/region_times.py: per-region bytes from a build report, profiler ranges around each
region call, and the bandwidth table (bench/profile_step.py --regions)."""

from __future__ import annotations

import pytest
import torch
from region_times import region_bytes, region_table, time_regions

REPORT = """# coopt build report: model

### r0_matmul_epilogue (matmul_epilogue)

inputs: 1x1x4096 bfloat16, 6144x4096 bfloat16 → outputs: 1x1x6144 bfloat16; 50.356 MB moved, 50.3 MFLOP at the example shapes

### r1_kv_write (kv_write)

inputs: 1x8x4096x128 bfloat16 → outputs: 1x8x4096x128 bfloat16; 33.554 MB moved, 0.1 MFLOP at the example shapes

### r2_decode_attention (decode_attention)

inputs: 1x32x1x128 bfloat16, 1x8x4096x128 bfloat16, 1x8x4096x128 bfloat16 → outputs: 1x32x1x128 bfloat16; 16.794 MB moved, 33.6 MFLOP at the example shapes

### r8_matmul_epilogue (matmul_epilogue)

identical to r0_matmul_epilogue (same computation and shapes): its candidates, checks and timings serve here; **selected: c1**
"""


def test_region_bytes_reads_the_report(tmp_path):
    path = tmp_path / "report.md"
    path.write_text(REPORT)
    moved = region_bytes(path)
    assert moved == {"r0_matmul_epilogue": ("matmul_epilogue", 50.356), "r1_kv_write": ("kv_write", 33.554),
                     "r2_decode_attention": ("decode_attention", 16.794),
                     "r8_matmul_epilogue": ("matmul_epilogue", 50.356)}


def test_region_table_bandwidth():
    moved = {"r0_matmul_epilogue": ("matmul_epilogue", 50.0), "r1_kv_write": ("kv_write", 33.0),
             "r2_decode_attention": ("decode_attention", 16.0)}
    rows = region_table({"r0_matmul_epilogue": 12.5, "r1_kv_write": 1.0, "r2_decode_attention": 10.0}, moved,
                        valid_share=0.5)
    assert [r["region"] for r in rows] == ["r0_matmul_epilogue", "r2_decode_attention", "r1_kv_write"]
    by = {r["region"]: r for r in rows}
    assert by["r0_matmul_epilogue"]["tb_per_s"] == pytest.approx(4.0)  # 50 MB in 12.5 µs
    assert by["r2_decode_attention"]["mb"] == 8.0 and by["r2_decode_attention"]["tb_per_s"] == pytest.approx(0.8)
    assert by["r1_kv_write"]["tb_per_s"] is None  # in place: the report counts the whole cache


class FakeBuild:
    """A program that calls its regions through _kernels, as a generated program.py does."""

    def __init__(self):
        self._kernels = {"r0": lambda x: (x + 1,), "r1": lambda x: (x * 2,)}

    def __call__(self, x):
        (y,) = self._kernels["r0"](x)
        (z,) = self._kernels["r1"](y)
        return z


def test_time_regions_ranges_every_region_and_restores_the_kernels():
    build = FakeBuild()
    before = dict(build._kernels)
    times = time_regions(build, (torch.ones(4),), steps=3)
    assert set(times) == {"r0", "r1"} and all(t >= 0 for t in times.values())
    assert build._kernels == before
