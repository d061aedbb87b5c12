"""bench/gemv_cuda_pdl_chain.py without a GPU: its sets parse, a malformed one is refused with a
clear message, and every default point is one the CUDA GEMV family accepts for its region (a
rejected point would be skipped on the device, its question unanswered)."""

from __future__ import annotations

import pytest
from gemm import make_region
from gemv_cuda_pdl_chain import DEFAULT_SETS, SHAPES, parse_sets

from coopt.targets import H200
from coopt.templates import base as template_base
from coopt.templates.gemv_cuda import GemvCudaFamily


def test_sets_parse_into_three_points_each():
    sets = parse_sets("16:1:6:2:1/16:2:4:1:1/16:1:6:1:0")
    assert sets == [[{"num_warps": 16, "ROWS": 1, "num_stages": 6, "BLOCKS": 2, "STAGGER": 1},
                     {"num_warps": 16, "ROWS": 2, "num_stages": 4, "BLOCKS": 1, "STAGGER": 1},
                     {"num_warps": 16, "ROWS": 1, "num_stages": 6, "BLOCKS": 1, "STAGGER": 0}]]
    for bad in ("16:1:6:2:1/16:2:4:1:1", "16:1:6:2/16:2:4:1:1/16:1:6:1:0"):
        with pytest.raises(ValueError, match="three WARPS:ROWS:STAGES:BLOCKS:STAGGER"):
            parse_sets(bad)


def test_every_default_point_is_legal_for_its_region(monkeypatch):
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: True)
    family = GemvCudaFamily()
    for points in parse_sets(DEFAULT_SETS):
        for shape, point in zip(SHAPES, points):
            assert family.check(make_region(*shape), point, H200) is None, (shape, point)
