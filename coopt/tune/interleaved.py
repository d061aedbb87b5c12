"""Latency of several variants of one computation, timed in alternating rounds.

A GPU's clock follows its power and temperature: a variant timed after two minutes of
max-autotune, or after another GEMM-bound variant, runs at a lower clock than one timed first.
Timing each variant once, one after the other, then charges that drift to whichever came last
(bench runs measured eager 4% faster than three variants running the same cuBLAS kernels).
Alternating short rounds spreads the drift over all variants; the median of the rounds is the
figure reported.
"""

from __future__ import annotations

import statistics
from typing import Callable


def time_interleaved(variants: dict[str, Callable[[], object]], *, rounds: int = 5, warmup_ms: int = 25,
                     rep_ms: int = 60) -> dict[str, float]:
    """{name: median ms over `rounds` rounds}; each round times every variant once with
    triton.testing.do_bench (median of its reps, L2 flushed between reps)."""
    from triton.testing import do_bench

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return {name: statistics.median(values) for name, values in samples.items()}
