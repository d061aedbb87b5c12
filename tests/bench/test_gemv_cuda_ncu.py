"""bench/gemv_cuda_ncu.py without a GPU: a case names bench/gemm.py's region and a gemv_cuda
point (K 14336 for down's residual form), a malformed case is refused, and every default case is
a point the family accepts (ncu would otherwise profile nothing for it)."""

from __future__ import annotations

import pytest
from gemm import make_region
from gemv_cuda_ncu import DEFAULT_CASES, parse_case

from coopt.targets import H200
from coopt.templates import base as template_base
from coopt.templates.gemv_cuda import GemvCudaFamily


def test_a_case_is_a_region_and_a_point():
    assert parse_case("14336:norm_swiglu:16:2:6:1:0") == (
        (1, 14336, 4096, "norm_swiglu"), {"num_warps": 16, "ROWS": 2, "num_stages": 6, "BLOCKS": 1, "STAGGER": 0})
    assert parse_case("4096:residual:16:1:6:2:1")[0] == (1, 4096, 14336, "residual")
    with pytest.raises(ValueError, match="N:EPILOGUE:WARPS:ROWS:STAGES:BLOCKS:STAGGER"):
        parse_case("14336:norm_swiglu:16:2:6")


def test_every_default_case_is_legal(monkeypatch):
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: True)
    for text in DEFAULT_CASES.split(","):
        shape, point = parse_case(text)
        assert GemvCudaFamily().check(make_region(*shape), point, H200) is None, text
