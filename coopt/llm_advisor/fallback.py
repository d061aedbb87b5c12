"""Keep the build going when the chosen advisor cannot answer.

`FallbackAdvisor` asks the primary advisor, screens its answer against the legal set (so a
plugin cannot smuggle in an illegal point), and on failure answers with the fallback
(heuristic) and a warning. After the first failure the primary is not asked again in this
build: a dead endpoint with a 30 s timeout would otherwise cost 30 s per region.
"""

from __future__ import annotations

from coopt.errors import AdvisorError
from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.protocol import Advice, AdviceRequest, Advisor, AdvisorUnavailable, advisor_identity
from coopt.llm_advisor.screen import enforce_legal


class FallbackAdvisor:
    """Primary advisor with a fallback; `strict=True` re-raises instead (exit code 7).

        >>> class Down:
        ...     name = "openai"
        ...     def advise(self, request):
        ...         raise AdvisorUnavailable("connection refused")
        >>> from coopt.ir.region import RegionSummary
        >>> request = AdviceRequest(RegionSummary("r0", "x", (), ()), "x", {}, ({},), {})
        >>> FallbackAdvisor(Down()).advise(request).warnings[0]
        "advisor 'openai' failed (connection refused); using heuristic for this and the remaining regions of the build"
    """

    def __init__(self, primary: Advisor, fallback: Advisor | None = None, strict: bool = False):
        self.primary = primary
        self.fallback = fallback if fallback is not None else HeuristicAdvisor()
        self.strict = strict
        self.name = primary.name
        self.failure: str | None = None  # the first failure's reason; set means "stop asking"

    @property
    def identity(self) -> str:
        return f"{advisor_identity(self.primary)} (fallback: {advisor_identity(self.fallback)})"

    def advise(self, request: AdviceRequest) -> Advice:
        if self.failure is None:
            try:
                advice = enforce_legal(request, self.primary.advise(request))
                if advice.ranked or not request.legal:
                    return advice
                raise AdvisorUnavailable("no legal point in its answer")
            except AdvisorError as exc:
                if self.strict:
                    raise AdvisorUnavailable(f"advisor '{self.primary.name}' failed: {exc.message}") from exc
                self.failure = exc.message
                warning = (
                    f"advisor '{self.primary.name}' failed ({exc.message}); using {self.fallback.name} "
                    "for this and the remaining regions of the build"
                )
        else:
            warning = (
                f"advisor '{self.primary.name}' not asked (it failed earlier in this build: {self.failure}); "
                f"using {self.fallback.name}"
            )
        advice = self.fallback.advise(request)
        advice.warnings.insert(0, warning)
        return advice
