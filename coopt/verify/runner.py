"""`verify_candidate`: Hypothesis-driven differential fuzzing of one candidate module.

The search: Hypothesis draws `Example`s (dims, seed, magnitude; strategies.py) with a fixed
`hypothesis.seed(seed)`, so a build with the same seed tries the same examples. The first
failing example is shrunk (toward the minimum dims, seed 0, magnitude 1) within the profile's
shrink budget. When the search passes, the anchor examples (the region's example dims, each
dim alone at its minimum, all dims at their capped maximum) are checked too; a failing anchor
is reported as it is (Hypothesis cannot shrink from an example it did not draw). Every
failure is one line naming the example, and with `repro_dir` a runnable repro script is
written (repro.py).

Candidate exceptions are verdicts, not verifier crashes. A candidate that kills the process or
hangs needs the worker subprocess of isolated.py.
"""

from __future__ import annotations

from pathlib import Path

import hypothesis
import torch
from hypothesis import given
from hypothesis.reporting import with_reporter

from coopt.ir.region import RegionSummary
from coopt.verify.check import ExampleOutcome, check_example, load_module, one_line
from coopt.verify.end_to_end import verify_end_to_end  # noqa: F401  (re-exported)
from coopt.verify.profiles import Profile, hypothesis_settings, resolve_profile
from coopt.verify.repro import write_repro
from coopt.verify.result import VerifyResult
from coopt.verify.strategies import MAGNITUDES, Example, anchor_examples, examples


def verify_candidate(
    region: RegionSummary,
    reference_path: str | Path,
    candidate_path: str | Path,
    *,
    profile: str | Profile | None = None,
    seed: int = 0,
    device: str | None = None,
    repro_dir: str | Path | None = None,
    label: str = "c0",
) -> VerifyResult:
    """Fuzz `candidate_path` against `reference_path` on inputs drawn for `region`.

    `profile` is "ci" (default, or $COOPT_VERIFY_PROFILE) or "thorough"; `device` defaults to
    "cuda" when available, else "cpu" (Triton's interpreter).

        >>> result = verify_candidate(region, "kernels/r0__reference.py", "kernels/r0__c1.py",
        ...                           repro_dir="out/verify/repro", label="c1")  # doctest: +SKIP
        >>> result.ok, result.failure  # doctest: +SKIP
        (False, 'output 0: max abs err 1.2 ... [dims n=3, seed 0, magnitude 1]')
    """
    profile = resolve_profile(profile)
    device = device or default_device()
    reference = load_module(reference_path)
    if isinstance(reference, str):
        return VerifyResult.failed(f"reference {reference}")
    candidate = load_module(candidate_path)
    if isinstance(candidate, str):
        return VerifyResult.failed(f"candidate {candidate}")

    search = _Search(region, reference, candidate, device,
                     budget=profile.max_examples + profile.shrink_budget)
    failing = _run_hypothesis(search, region, profile, seed)
    if failing is None:
        failing = _check_anchors(search, region, profile, seed)
    if failing is None:
        return VerifyResult(True, search.runs, search.max_abs, search.max_rel)

    outcome = search.memo[failing]
    failure = f"{outcome.failure} [{failing.describe()}]"
    if search.device_lost:
        failure += " (CUDA context lost: no further examples run)"
    repro = None
    if repro_dir is not None:
        try:
            repro = str(write_repro(region, reference_path, candidate_path, failing,
                                    repro_dir=repro_dir, label=label, failure=failure))
        except OSError as error:
            failure += f" (repro not written: {one_line(error)})"
    return VerifyResult(False, search.runs, search.max_abs, search.max_rel, failure, repro,
                        failing.to_json())


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class _Mismatch(AssertionError):
    """Raised inside the Hypothesis test for a failing example (one origin, so one bug)."""

    def __init__(self, example: Example):
        super().__init__(example.describe())
        self.example = example


class _Search:
    """Runs examples, remembers their outcomes and enforces the run budget.

    Past the budget, examples not yet run count as passing: Hypothesis then cannot shrink
    further and replays the smallest failure found so far, whose outcome is remembered. The
    same happens once a candidate has broken the CUDA context (an illegal memory access is
    sticky: every later launch, the reference's included, would fail and mislead the shrinker).
    """

    def __init__(self, region, reference, candidate, device, budget: int):
        self.region, self.reference, self.candidate = region, reference, candidate
        self.device, self.budget = device, budget
        self.memo: dict[Example, ExampleOutcome] = {}
        self.runs = 0
        self.max_abs = self.max_rel = 0.0
        self.device_lost = False

    def outcome(self, example: Example, *, force: bool = False) -> ExampleOutcome | None:
        if example in self.memo:
            return self.memo[example]
        if self.device_lost or (self.runs >= self.budget and not force):
            return None
        self.runs += 1
        outcome = check_example(self.region, self.reference, self.candidate, example,
                                self.device)
        self.memo[example] = outcome
        if not outcome.ok and _cuda_context_lost(self.device):
            self.device_lost = True
        # NaN (no measurement: an exception) never replaces a measured error.
        self.max_abs = outcome.max_abs_err if outcome.max_abs_err > self.max_abs else self.max_abs
        self.max_rel = outcome.max_rel_err if outcome.max_rel_err > self.max_rel else self.max_rel
        return outcome

    def __call__(self, example: Example) -> None:
        outcome = self.outcome(example)
        if outcome is not None and not outcome.ok:
            raise _Mismatch(example)

    def smallest_failure(self) -> Example | None:
        failures = [e for e, o in self.memo.items() if not o.ok]
        if not failures:
            return None
        return min(failures, key=lambda e: (sum(v for _, v in e.dims), e.seed,
                                            MAGNITUDES.index(e.magnitude)))


def _run_hypothesis(search: _Search, region, profile: Profile, seed: int) -> Example | None:
    @hypothesis_settings(profile)
    @hypothesis.seed(seed)
    @given(examples(region, profile))
    def probe(example: Example) -> None:
        search(example)

    try:
        with with_reporter(lambda _message: None):  # keep stdout clean (worker protocol)
            probe()
    except _Mismatch as mismatch:
        return mismatch.example
    except Exception:
        # Hypothesis could not settle on one failure (e.g. Flaky): report the smallest we saw.
        if search.smallest_failure() is None:
            raise
        return search.smallest_failure()
    return None


def _check_anchors(search: _Search, region, profile: Profile, seed: int) -> Example | None:
    for anchor in anchor_examples(region, profile, seed):
        outcome = search.outcome(anchor, force=True)
        if outcome is not None and not outcome.ok:
            return anchor
    return None


def _cuda_context_lost(device) -> bool:
    if torch.device(device).type != "cuda":
        return False
    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001 - any error here means the context is unusable
        return True
