"""Per region: the reference plus the advisor's top-k legal template points, as module files."""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from coopt.codegen.torch_lines import reference_module_source
from coopt.ir.dialect import KernelOp
from coopt.ir.region import RegionSummary
from coopt.targets import Target

REFERENCE = "reference"


@dataclass
class CandidateEntry:
    """One row of selection.json (docs/contracts.md)."""

    label: str
    family: str
    module: str  # path relative to out/
    params: dict = field(default_factory=dict)
    rank: int = 0  # advisor rank within its family (0 = best); the reference has rank 0
    verified: bool = False
    verify: dict = field(default_factory=dict)
    latency_ms: float | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RegionBuild:
    summary: RegionSummary
    candidates: list[CandidateEntry]
    selected: str = REFERENCE
    reason: str = ""
    advice_sources: list[str] = field(default_factory=list)
    inductor_ms: float | None = None  # the same ops through torch.compile: the bar to clear
    same_as: str | None = None  # an identical earlier region whose candidates this one shares

    def twin(self, summary: RegionSummary) -> "RegionBuild":
        """A region identical to this one (another layer of the same model): it shares the
        candidate files, verification and timing; its selection is copied by `follow`."""
        return RegionBuild(summary, self.candidates, same_as=self.summary.name)

    def selected_entry(self) -> CandidateEntry | None:
        """The selected candidate's entry (None where no candidate has the selected label)."""
        return next((c for c in self.candidates if c.label == self.selected), None)

    def follow(self, leader: "RegionBuild") -> None:
        self.selected, self.reason, self.inductor_ms = leader.selected, leader.reason, leader.inductor_ms

    def to_json(self) -> dict:
        return {
            "family": self.summary.family,
            "summary": self.summary.to_json(),
            "selected": self.selected,
            "reason": self.reason,
            "inductor_ms": self.inductor_ms,
            "same_as": self.same_as,
            "candidates": [c.to_json() for c in self.candidates],
        }


def region_signature(summary: RegionSummary) -> str:
    """Regions with equal signatures compute the same function on the same shapes (a family's
    attrs define its computation), so one set of candidates, checks and timings serves all."""
    data = summary.to_json()
    data.pop("name")
    data.pop("input_names")
    return json.dumps(data, sort_keys=True)


# knobs that only tune how a kernel runs; every other knob changes what kernel it is
_LAUNCH_KNOBS = {"num_warps", "num_stages", "GROUP_M"}


def _tile(params: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in params.items() if k not in _LAUNCH_KNOBS))


def diverse_top_k(ranked: list[dict], k: int) -> list[tuple[int, dict]]:
    """The best k points, preferring distinct kernels (tile shapes, TMA/persistent variants,
    splits): an advisor's next-best points often differ only in num_stages, and measuring three
    of those teaches little. Returns
    (advisor rank, params) pairs in rank order."""
    chosen: list[tuple[int, dict]] = []
    tiles: set = set()
    for rank, params in enumerate(ranked):
        if len(chosen) < k and _tile(params) not in tiles:
            chosen.append((rank, params))
            tiles.add(_tile(params))
    for rank, params in enumerate(ranked):  # too few distinct tiles: fill up in rank order
        if len(chosen) < k and all(rank != r for r, _ in chosen):
            chosen.append((rank, params))
    return sorted(chosen, key=lambda pair: pair[0])


def with_pdl_ready(chosen: list[tuple[int, dict]], ranked: Iterable[dict], ready) -> list[tuple[int, dict]]:
    """`chosen` and, where none of it is `ready` (a family's PDL-ready test), the best-ranked
    point that is: the launch step can re-select it only if the build measured it."""
    if any(ready(params) for _, params in chosen):
        return chosen
    extra = next(((rank, params) for rank, params in enumerate(ranked) if ready(params)), None)
    return chosen if extra is None else sorted([*chosen, extra], key=lambda pair: pair[0])


def make_candidates(kernel: KernelOp, summary: RegionSummary, target: Target, advisor, advice_log, out: Path, top_k: int) -> RegionBuild:
    from coopt.llm_advisor.protocol import AdviceRequest
    from coopt.templates.registry import families_for

    kernels_dir = out / "kernels"
    kernels_dir.mkdir(parents=True, exist_ok=True)
    ref_file = f"{summary.name}__reference.py"
    (kernels_dir / ref_file).write_text(reference_module_source(kernel))
    # the reference is the original computation: verified by construction, never fuzzed away
    entries = [CandidateEntry(REFERENCE, REFERENCE, f"kernels/{ref_file}", verified=True)]
    build = RegionBuild(summary, entries)
    for family in families_for(summary):
        legal = family.legal_points(summary, target)
        if not legal:
            continue
        request = AdviceRequest(summary, family.name, family.param_space(summary, target), tuple(legal), target.facts(), top_k)
        advice = advisor.advise(request)
        advice_log.record(request, advice)
        build.advice_sources.append(advice.source)
        ready = functools.partial(family.pdl_ready, summary)
        # an advisor may rank a few points only: the legal ones it left out follow, for a ready one
        ranked_keys = {json.dumps(p, sort_keys=True) for p in advice.ranked}
        every = itertools.chain(advice.ranked, (p for p in legal if json.dumps(p, sort_keys=True) not in ranked_keys))
        for rank, params in with_pdl_ready(diverse_top_k(advice.ranked, top_k), every, ready):
            label = f"c{len(entries) - 1}"
            filename = f"{summary.name}__{label}.py"
            (kernels_dir / filename).write_text(family.render(summary, params))
            entries.append(CandidateEntry(label, family.name, f"kernels/{filename}", dict(params), rank))
    return build
