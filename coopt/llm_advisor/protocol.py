"""The advisor contract: what the compiler asks (`AdviceRequest`) and what comes back (`Advice`).

The compiler decides what is legal; an advisor only ranks legal points. A request therefore
carries the full list of legal points, and every point of an answer must be one of them
(`coopt.llm_advisor.screen` enforces this for every advisor, built-in or plugin).

Example:

    >>> from coopt.ir.region import RegionSummary, TensorSpec
    >>> region = RegionSummary("r0", "elementwise", (TensorSpec((1024,), "float32"),),
    ...                        (TensorSpec((1024,), "float32"),))
    >>> request = AdviceRequest(region, "elementwise", {"BLOCK": [512, 1024]},
    ...                         ({"BLOCK": 512}, {"BLOCK": 1024}), {"num_sms": 132})
    >>> len(request.key())
    64
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from coopt.errors import AdvisorError
from coopt.ir.region import RegionSummary


class AdvisorUnavailable(AdvisorError):
    """The advisor could not answer (endpoint down, timeout, unusable reply).

    `FallbackAdvisor` turns this into a warning and the heuristic's answer unless the build is
    strict (`--no-advisor-fallback`), in which case it ends the build with exit code 7.
    """


def canonical_json(value) -> str:
    """Compact, key-sorted JSON: equal data gives equal text (hash keys, point identity)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def point_key(params: dict) -> str:
    """Identity of one parameter point. JSON keeps 64, 64.0 and true apart, as the template does."""
    return canonical_json(params)


@dataclass(frozen=True)
class AdviceRequest:
    """One question to an advisor: rank the legal parameter points of `family` for `region`.

    `space` is the family's bounded space (knob -> allowed values); `legal` is every point of it
    that the family's `check` accepts, in the family's deterministic order, and the only
    acceptable answers. `target` is `Target.facts()`. `top_k` is how many candidates the
    pipeline will instantiate: advisors may rank more, the pipeline reads the first `top_k`.
    """

    region: RegionSummary
    family: str
    space: dict[str, list]
    legal: tuple[dict, ...]
    target: dict
    top_k: int = 4

    def to_json(self) -> dict:
        return {
            "region": self.region.to_json(),
            "family": self.family,
            "space": {knob: list(values) for knob, values in self.space.items()},
            "legal": [dict(point) for point in self.legal],
            "target": dict(self.target),
            "top_k": self.top_k,
        }

    def key(self) -> str:
        """Stable sha256 (hex) of the canonical JSON of the whole request.

        Anything that could change the right answer (region, space, legality, target, top_k)
        changes the key, so caches and advice.json never answer a different question.
        """
        return hashlib.sha256(canonical_json(self.to_json()).encode()).hexdigest()

    def __hash__(self) -> int:  # the generated hash would fail on the dict fields
        return hash(self.key())


@dataclass
class Advice:
    """An advisor's answer: legal points, best first.

    `source` says who answered: "heuristic", "openai", "cache", "replay" or a plugin's name.
    `rejected` lists proposals that were discarded ({"params": ..., "reason": one line}),
    `warnings` lines for the build report, `rationale` the advisor's own short explanation.
    """

    ranked: list[dict]
    source: str
    rejected: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rationale: str | None = None

    def to_json(self) -> dict:
        return {
            "ranked": [dict(point) for point in self.ranked],
            "source": self.source,
            "rejected": [dict(entry) for entry in self.rejected],
            "warnings": list(self.warnings),
            "rationale": self.rationale,
        }

    @staticmethod
    def from_json(data: dict) -> "Advice":
        return Advice(
            ranked=[dict(point) for point in data["ranked"]],
            source=str(data["source"]),
            rejected=[dict(entry) for entry in data.get("rejected", [])],
            warnings=[str(line) for line in data.get("warnings", [])],
            rationale=data.get("rationale"),
        )


@runtime_checkable
class Advisor(Protocol):
    """Anything with a `name` and `advise(request) -> Advice` is an advisor.

    Plugins register advisor classes under `advisors` in the `coopt.plugins` entry point; they
    are constructed with no arguments. An advisor that cannot answer raises
    `AdvisorUnavailable`. It may also define `identity: str` (what makes its answers differ,
    without secrets) for caches and advice.json; `name` is used when it does not.

        class AlwaysFirst:
            name = "always-first"
            def advise(self, request):
                return Advice(ranked=list(request.legal), source=self.name)
    """

    name: str

    def advise(self, request: AdviceRequest) -> Advice: ...


def advisor_identity(advisor) -> str:
    """The advisor's `identity` when it has one, else its `name`."""
    return str(getattr(advisor, "identity", None) or advisor.name)
