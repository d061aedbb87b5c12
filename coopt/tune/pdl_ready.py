"""Which regions a step launched with PDL may re-select: each region's fastest PDL-ready kernel
where it is not what the region selected alone.

A region's kernel is selected alone, by its own time; PDL pays between kernels. The CUDA GEMVs
(templates/gemv_cuda.py) gain under PDL only at one block an SM with an 8-warp GLU (session 31,
bench/gemv_cuda_pdl_chain.py: o -> gate|up -> down 96.8 µs launched with PDL against 97.4 for the
fastest kernels alone, and 15-50 µs lost where a grid had two blocks an SM or gate|up 16 warps),
which are seldom each region's fastest alone. So the launch step (tune/launch.py) times, beside
each PDL option, the same option with those regions switched to their fastest PDL-ready kernels,
and the step decides. A switch costs the region its own time, so two sets are offered: the
regions whose ready kernel is at most SWAP_BUDGET_MS (what PDL gained a GEMV in that chain)
slower than their selection, and every region that has one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from coopt.candidates import REFERENCE, CandidateEntry, RegionBuild

SWAP_BUDGET_MS = 0.001
# the switch sets the launch step times, by label suffix: regions whose ready kernel is within the
# budget, and every region that has one (session 31's winning chain had gate|up's 8-warp kernel,
# slower alone by more than the budget: only the whole step can say whether such a chain pays)
SWITCH_SETS = {"+ready": SWAP_BUDGET_MS, "+allready": None}


def ready_swaps(regions: list[RegionBuild], budget_ms: float | None = SWAP_BUDGET_MS,
                families: dict | None = None) -> dict[str, CandidateEntry]:
    """{region: the candidate to switch it to} for every region whose fastest verified, timed
    PDL-ready candidate is not its selection and at most `budget_ms` slower than it (None: any)."""
    from coopt.templates.registry import template_families

    families = template_families() if families is None else families
    swaps = {}
    for region in regions:
        selected = region.selected_entry()
        ready = [c for c in region.candidates
                 if c.family != REFERENCE and c.verified and c.latency_ms is not None and c.family in families
                 and families[c.family].pdl_ready(region.summary, c.params)]
        # a region on its reference stays there: the end-to-end check may have put it back for cause
        if region.selected == REFERENCE or not ready or selected in ready or selected.latency_ms is None:
            continue
        best = min(ready, key=lambda c: c.latency_ms)
        if budget_ms is None or best.latency_ms <= selected.latency_ms + budget_ms:
            swaps[region.summary.name] = best
    return swaps


def ready_switches(regions: list[RegionBuild], families: dict | None = None) -> dict[str, dict[str, CandidateEntry]]:
    """{label suffix: swaps} for each of SWITCH_SETS that switches something and differs from
    the sets before it (a set equal to another would time the same step twice)."""
    sets: dict[str, dict[str, CandidateEntry]] = {}
    for suffix, budget in SWITCH_SETS.items():
        swaps = ready_swaps(regions, budget, families)
        if swaps and all(swaps != other for other in sets.values()):
            sets[suffix] = swaps
    return sets


def swap_runs(swaps: dict[str, CandidateEntry], out: Path) -> dict[str, tuple[str, Callable]]:
    """{region: (label, run)}: each switch's kernel loaded from the build's files."""
    from coopt.runtime.kernel_loader import load_module_from_file

    return {name: (entry.label, load_module_from_file(out / entry.module).run) for name, entry in swaps.items()}


def apply_reselection(regions: list[RegionBuild], swaps: dict[str, CandidateEntry], step_ms: dict, label: str) -> None:
    """Record the switches the launch step kept in each region's selection and reason (report.md)."""
    for region in regions:
        entry = swaps.get(region.summary.name)
        if entry is None:
            continue
        before = region.selected_entry()
        region.reason = (f"re-selected for PDL: {entry.label} ({entry.latency_ms:.4g} ms alone, against "
                         f"{before.label}'s {before.latency_ms:.4g}); the step launched so measured "
                         f"{step_ms[label]:.4f} ms, the fastest option (was: {region.reason})")
        region.selected = entry.label
