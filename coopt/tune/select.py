"""Pick one candidate per region from verification results and (when there are any) timings.

Rules, in order:
  * only verified candidates compete; the reference (family "reference") is always eligible;
  * with measurements, the fastest verified candidate wins if it beats the reference; the
    reference is kept when it is at least as fast (a tie keeps it: fewer moving parts); a
    candidate whose timing failed or is missing is excluded;
  * without measurements (no GPU), the advisor's best-ranked verified candidate wins;
  * with nothing verified, the reference.
The reason string is shown in out/report.md, so it is written for a person.
"""

from __future__ import annotations

import math

from coopt.tune.measurement import Measurement

REFERENCE_FAMILY = "reference"
UNMEASURED_PREFIX = "unmeasured (no GPU): advisor rank"


def select_candidate(
    candidates: list[dict], measurements: dict[str, Measurement] | None, *, min_speedup: float = 1.0
) -> tuple[str, str]:
    """(label, reason) for one region's selection.json candidate entries.

    `measurements` maps label -> Measurement; empty or None means nothing was timed. A candidate
    must be more than `min_speedup` times faster than the reference to replace it.

    >>> cands = [{"label": "ref", "family": "reference", "verified": True, "rank": 0},
    ...          {"label": "c0", "family": "elementwise", "verified": True, "rank": 0}]
    >>> select_candidate(cands, {})
    ('c0', 'unmeasured (no GPU): advisor rank 0, best of 1 verified')
    >>> select_candidate(cands, {"ref": Measurement(0.052, 0.05, 0.06), "c0": Measurement(0.041, 0.04, 0.05)})
    ('c0', 'fastest of 1 verified: 0.041 ms vs reference 0.052 ms (1.27x)')
    """
    reference = next((c for c in candidates if c.get("family") == REFERENCE_FAMILY), None)
    if reference is None:
        raise ValueError("no reference candidate (family 'reference') among the candidates")
    templates = [c for c in candidates if c.get("family") != REFERENCE_FAMILY]
    verified = [c for c in templates if c.get("verified")]

    if not verified:
        if not templates:
            return reference["label"], "reference: no template candidate for this region"
        return reference["label"], f"reference: none of {len(templates)} candidates passed verification"

    if not measurements:
        best = min(verified, key=lambda c: _advisor_order(candidates, c))
        return best["label"], f"{UNMEASURED_PREFIX} {_rank_text(best)}, best of {len(verified)} verified"

    timed = [(measurements[c["label"]], c) for c in verified if _timed_ok(measurements, c["label"])]
    not_timed = len(verified) - len(timed)
    ref_timing = measurements.get(reference["label"])

    if not timed:
        why = _first_error(measurements, verified)
        return reference["label"], (
            f"reference: none of {len(verified)} verified candidates could be timed" + (f" ({why})" if why else "")
        )

    best_timing, best = min(timed, key=lambda pair: (pair[0].median_ms, _advisor_order(candidates, pair[1])))
    best_ms = best_timing.median_ms
    failed_note = f"; {not_timed} verified not timed" if not_timed else ""

    if ref_timing is None or not ref_timing.ok:
        # Verification already proved the candidate correct; a reference that cannot be timed
        # gives no reason to keep it.
        ref_why = ref_timing.error if ref_timing is not None else "not measured"
        return best["label"], (
            f"fastest of {len(timed)} verified: {_ms(best_ms)} ms (reference not timed: {ref_why})" + failed_note
        )

    ref_ms = ref_timing.median_ms
    speedup = ref_ms / best_ms if best_ms > 0 else math.inf
    if speedup > min_speedup:
        return best["label"], (
            f"fastest of {len(timed)} verified: {_ms(best_ms)} ms vs reference {_ms(ref_ms)} ms ({speedup:.2f}x)"
            + failed_note
        )
    if best_ms == ref_ms:
        return reference["label"], f"reference kept: ties the fastest verified candidate {best['label']} ({_ms(ref_ms)} ms)"
    if best_ms < ref_ms:
        return reference["label"], (
            f"reference kept: fastest verified candidate {best['label']} is only {speedup:.2f}x faster "
            f"({_ms(best_ms)} ms vs {_ms(ref_ms)} ms; needs more than {min_speedup:g}x)"
        )
    return reference["label"], (
        f"reference kept: {_ms(ref_ms)} ms vs fastest of {len(timed)} verified {best['label']} {_ms(best_ms)} ms"
    )


def _advisor_order(candidates: list[dict], candidate: dict) -> tuple:
    # Missing ranks sort last. Ranks are per family, so several candidates can share rank 0; the
    # position in selection.json (the build's order) breaks ties deterministically.
    rank = candidate.get("rank")
    return (rank if isinstance(rank, int) else math.inf, candidates.index(candidate))


def _rank_text(candidate: dict) -> str:
    rank = candidate.get("rank")
    return str(rank) if isinstance(rank, int) else "unknown"


def _timed_ok(measurements: dict[str, Measurement], label: str) -> bool:
    timing = measurements.get(label)
    return timing is not None and timing.ok


def _first_error(measurements: dict[str, Measurement], candidates: list[dict]) -> str:
    for candidate in candidates:
        timing = measurements.get(candidate["label"])
        if timing is not None and timing.error:
            return f"{candidate['label']}: {timing.error}"
    return ""


def _ms(value: float) -> str:
    """Milliseconds with three significant digits, never in exponent form."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}" if value >= 1e-3 else f"{value:.2e}"
