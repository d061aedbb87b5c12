"""time_interleaved alternates the variants round by round and reports each one's median, so a
clock that slows down during the run is charged to every variant alike."""

from __future__ import annotations

import pytest
import triton.testing

from coopt.tune.interleaved import time_interleaved


def test_rounds_alternate_and_medians_absorb_a_drifting_clock(monkeypatch):
    calls = []
    clock = {"slowdown": 1.0}

    def fake_do_bench(fn, warmup, rep, return_mode):
        name = fn()
        calls.append(name)
        clock["slowdown"] *= 1.01  # the GPU gets slower with every measurement
        return {"a": 1.0, "b": 1.0, "c": 2.0}[name] * clock["slowdown"]

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    result = time_interleaved({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, rounds=5)
    assert calls == ["a", "b", "c"] * 5
    # timed one after the other, b would read ~5% slower than a; interleaved, 1% (one slot later)
    assert result["b"] / result["a"] == pytest.approx(1.01, rel=1e-6)
    assert result["c"] / result["a"] == pytest.approx(2 * 1.01**2, rel=1e-6)


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="rounds"):
        time_interleaved({"a": lambda: None}, rounds=0)
