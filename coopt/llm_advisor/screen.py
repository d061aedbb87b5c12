"""Screening: the one place that keeps every advisor's answer inside the legal set.

An advisor (a model, a replay file someone edited, a plugin) may propose anything. Each
proposal is kept only when it is exactly one of `request.legal`; the rest are recorded in
`Advice.rejected` with a one-line reason, so the report can say what the advisor got wrong.

    >>> from coopt.ir.region import RegionSummary
    >>> region = RegionSummary("r0", "elementwise", (), ())
    >>> request = AdviceRequest(region, "elementwise", {"BLOCK": [512, 1024]},
    ...                         ({"BLOCK": 1024},), {})
    >>> ranked, rejected = screen_proposals(request, [{"BLOCK": 512}, {"BLOCK": 1024}])
    >>> ranked, rejected[0]["reason"]
    ([{'BLOCK': 1024}], 'violates the family constraints (in the space but not a legal point)')
"""

from __future__ import annotations

from coopt.llm_advisor.protocol import Advice, AdviceRequest, point_key


def _match_value(value, allowed: list):
    """The allowed value equal to `value`, or a sentinel.

    Exact type match first (so `True` never passes for `1`); an integral float is accepted for
    an int knob because JSON producers (some LLM servers) write 64 as 64.0.
    """
    for candidate in allowed:
        if type(candidate) is type(value) and candidate == value:
            return candidate
    if isinstance(value, float) and value.is_integer():
        for candidate in allowed:
            if type(candidate) is int and candidate == int(value):
                return candidate
    return _NO_MATCH


_NO_MATCH = object()


def _normalise(request: AdviceRequest, proposal) -> tuple[dict | None, str | None]:
    """(the point with the space's own values, None) or (None, why it is not in the space)."""
    if not isinstance(proposal, dict):
        return None, f"not a parameter object: {type(proposal).__name__}"
    unknown = sorted(set(proposal) - set(request.space))
    if unknown:
        return None, f"unknown knob(s): {', '.join(map(str, unknown))}"
    missing = sorted(set(request.space) - set(proposal))
    if missing:
        return None, f"missing knob(s): {', '.join(missing)}"
    point = {}
    for knob, allowed in request.space.items():
        value = _match_value(proposal[knob], list(allowed))
        if value is _NO_MATCH:
            return None, f"{knob}={proposal[knob]!r} is not in the space (allowed: {list(allowed)})"
        point[knob] = value
    return point, None


def screen_proposals(request: AdviceRequest, proposals: list) -> tuple[list[dict], list[dict]]:
    """Split proposals into (ranked legal points, rejected entries), keeping proposal order."""
    legal_by_key = {point_key(point): point for point in request.legal}
    ranked: list[dict] = []
    seen: set[str] = set()
    rejected: list[dict] = []
    for proposal in proposals:
        point, reason = _normalise(request, proposal)
        if point is not None:
            key = point_key(point)
            if key not in legal_by_key:
                reason = "violates the family constraints (in the space but not a legal point)"
            elif key in seen:
                reason = "duplicate of an earlier entry"
            else:
                seen.add(key)
                ranked.append(dict(legal_by_key[key]))
                continue
        rejected.append({"params": proposal, "reason": reason})
    return ranked, rejected


def enforce_legal(request: AdviceRequest, advice: Advice) -> Advice:
    """`advice` with every ranked point screened; discarded ones join `advice.rejected`."""
    ranked, rejected = screen_proposals(request, list(advice.ranked))
    return Advice(
        ranked=ranked,
        source=advice.source,
        rejected=[*advice.rejected, *rejected],
        warnings=list(advice.warnings),
        rationale=advice.rationale,
    )
