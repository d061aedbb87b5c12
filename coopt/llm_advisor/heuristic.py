"""The default advisor: offline, deterministic, no network.

It scores every legal point with the family's rule (`heuristic_rules.RULES`) and returns the
whole legal list sorted by cost; ties, and families without a rule, keep the family's legal
order. The same request always gives the same answer, on any machine.
"""

from __future__ import annotations

from coopt.llm_advisor.heuristic_rules import RULES
from coopt.llm_advisor.protocol import Advice, AdviceRequest


class HeuristicAdvisor:
    """Rank legal points by simple performance reasoning about the region's shapes.

        >>> from coopt.ir.region import RegionSummary, TensorSpec
        >>> out = TensorSpec((1 << 20,), "float32")
        >>> region = RegionSummary("r0", "elementwise", (out,), (out,))
        >>> legal = tuple({"BLOCK": b, "num_warps": w} for b in (256, 1024) for w in (1, 4))
        >>> request = AdviceRequest(region, "elementwise", {}, legal, {"num_sms": 132})
        >>> HeuristicAdvisor().advise(request).ranked[0]
        {'BLOCK': 1024, 'num_warps': 4}
    """

    name = "heuristic"
    identity = "heuristic:v1"

    def advise(self, request: AdviceRequest) -> Advice:
        legal = [dict(point) for point in request.legal]
        rule = RULES.get(request.family)
        if rule is None:
            rationale = f"no rule for family '{request.family}': legal order"
            return Advice(ranked=legal, source=self.name, rationale=rationale)
        cost, rationale = rule(request)
        # Round so that float noise can never reorder ties between machines.
        order = sorted(range(len(legal)), key=lambda i: (round(cost(legal[i]), 9), i))
        return Advice(ranked=[legal[i] for i in order], source=self.name, rationale=rationale)
