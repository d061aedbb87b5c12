"""bench/run.py's table: plain calls against eager / compile / max-autotune, graph replays
(coopt-graph) against reduce-overhead, dashes where a variant did not run."""

from __future__ import annotations

from run import table


def test_ratios_compare_plain_with_plain_and_graphs_with_graphs():
    rows = [{"example": "mlp", "ms": {"eager": 2.0, "compile": 1.0, "max-autotune": 0.9, "coopt": 0.8,
                                       "reduce-overhead": 0.7, "coopt-graph": 0.5}, "setup_s": {"coopt": 40.2}},
            {"example": "block", "ms": {"eager": 1.0, "coopt": 1.0}, "setup_s": {"coopt": 3}}]
    head, _, mlp, block = table(rows).splitlines()
    assert head.count("|") == mlp.count("|") == block.count("|")
    assert mlp.endswith("| 2.50x | 1.25x | 1.12x | 1.40x | 40 |")
    assert block.endswith("| 1.00x | — | — | — | 3 |")
