"""The advisor layer: rank the legal options the compiler offers; never invent new ones.

    >>> from coopt.llm_advisor import make_advisor
    >>> advisor = make_advisor("heuristic")          # offline, deterministic default

`AdviceRequest` / `Advice` / `Advisor` are the contract (protocol.py); `HeuristicAdvisor` the
default; `OpenAIAdvisor` asks an OpenAI-compatible endpoint (the `openai` package is imported
only when it is first used); `AdviceCache` keeps answers across builds; `FallbackAdvisor`
turns failures into warnings; `AdviceLog` / `ReplayAdvisor` write and replay advice.json.
"""

from coopt.llm_advisor.cache import AdviceCache, default_cache_path
from coopt.llm_advisor.factory import known_advisors, make_advisor
from coopt.llm_advisor.fallback import FallbackAdvisor
from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.openai_advisor import OpenAIAdvisor
from coopt.llm_advisor.protocol import Advice, AdviceRequest, Advisor, AdvisorUnavailable
from coopt.llm_advisor.replay import AdviceLog, ReplayAdvisor

__all__ = [
    "Advice",
    "AdviceCache",
    "AdviceLog",
    "AdviceRequest",
    "Advisor",
    "AdvisorUnavailable",
    "FallbackAdvisor",
    "HeuristicAdvisor",
    "OpenAIAdvisor",
    "ReplayAdvisor",
    "default_cache_path",
    "known_advisors",
    "make_advisor",
]
