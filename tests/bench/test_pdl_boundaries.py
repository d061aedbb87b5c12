"""bench/pdl_boundaries.py without a GPU: two launch tables of one step (PDL off, on) compared
place by place in a layer."""

from __future__ import annotations

import pytest
from pdl_boundaries import boundaries, markdown, positions


def test_a_launch_is_placed_after_its_layers_attention():
    names = ["embed", "gemv", "attention", "gemv", "gemv", "attention", "gemv", "gemv"]
    assert positions(names) == ["before attention 0", "before attention 1", "attention +0", "attention +1",
                                "attention +2", "attention +0", "after the last attention +1",
                                "after the last attention +2"]
    assert positions(["a", "b"]) == ["launch 0", "launch 1"]  # no attention: each launch its own place


def launch(name, gap, us):
    return {"name": name, "gap_us": gap, "us": us}


def test_pdl_is_judged_by_gap_plus_duration_averaged_over_the_layers():
    # two layers: under PDL o starts earlier (a negative gap) but ends later; the GEMV after it gains
    off = [launch("attention", 0.3, 48.0), launch("o", 0.6, 14.7), launch("up", 0.4, 80.0),
           launch("attention", 0.3, 48.0), launch("o", 0.8, 14.7), launch("up", 0.4, 80.0)]
    on = [launch("attention", 0.0, 48.0), launch("o", -0.2, 16.3), launch("up", -3.0, 81.0),
          launch("attention", 0.0, 48.0), launch("o", -0.2, 16.3), launch("up", -3.0, 81.0)]
    table = {row["place"]: row for row in boundaries(off, on)}
    assert table["attention +0"]["count"] == 2 and table["attention +0"]["gain_us"] == pytest.approx(0.3)
    # the second layer is the last one's: its o and up are rows of their own
    assert table["attention +1"]["count"] == 1 and table["attention +1"]["gain_us"] == pytest.approx(-0.8)
    assert table["after the last attention +2"]["gain_us"] == pytest.approx(2.4)
    assert "| attention +1 (o) | 1 | 0.60 + 14.70 = 15.30 | -0.20 + 16.30 = 16.10 | -0.80 |" in markdown(boundaries(off, on))


def test_tables_of_two_different_builds_are_refused():
    with pytest.raises(ValueError, match="different kernels"):
        boundaries([launch("a", 0, 1)], [launch("b", 0, 1)])
