"""Verification profiles: how many examples, how large the shapes.

"ci"        CPU machines, where candidates run in Triton's interpreter (slow: keep every
            symbolic dim <= 48 and every tensor <= 2**18 elements, a dozen examples).
"thorough"  the GPU machine: the regions' real dim ranges and many examples.

Each profile is also registered with Hypothesis as "coopt-<name>" (Hypothesis ships its own
"ci" profile, which other test suites rely on; ours must not replace it). The profile used is
the `profile` argument when given, else the environment variable COOPT_VERIFY_PROFILE, else "ci".

    >>> resolve_profile("thorough").dim_cap is None
    True
    >>> hypothesis_settings(resolve_profile("ci")).max_examples
    12
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, Verbosity, settings

ENV_VAR = "COOPT_VERIFY_PROFILE"


@dataclass(frozen=True)
class Profile:
    name: str
    max_examples: int  # generated examples (Hypothesis' generate phase)
    shrink_budget: int  # extra candidate runs allowed while shrinking one failure
    dim_cap: int | None  # every symbolic dim is drawn from [min, min(max, dim_cap)]
    max_elements: int | None  # symbolic dims are halved until every tensor fits

    def to_json(self) -> dict:
        return dict(self.__dict__)


PROFILES: dict[str, Profile] = {
    "ci": Profile("ci", max_examples=12, shrink_budget=60, dim_cap=48, max_elements=1 << 18),
    "thorough": Profile("thorough", max_examples=200, shrink_budget=400, dim_cap=None,
                        max_elements=1 << 26),
}

_COMMON = dict(
    deadline=None,  # verification never times anything
    database=None,  # builds must not depend on a local example database
    derandomize=False,  # reproducibility comes from hypothesis.seed(<build seed>) instead
    phases=(Phase.explicit, Phase.generate, Phase.shrink),  # no db reuse, no explain
    report_multiple_bugs=False,  # one failure, the shrunk one, is what the repro needs
    print_blob=False,
    verbosity=Verbosity.quiet,
    suppress_health_check=list(HealthCheck),  # slow candidates are expected, not a smell
)

for _profile in PROFILES.values():
    settings.register_profile(f"coopt-{_profile.name}", max_examples=_profile.max_examples,
                              **_COMMON)


def resolve_profile(profile: str | Profile | dict | None = None) -> Profile:
    """The profile named by the argument, else by $COOPT_VERIFY_PROFILE, else "ci"."""
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, dict):  # as sent over the worker protocol
        return Profile(**profile)
    name = profile or os.environ.get(ENV_VAR) or "ci"
    if name not in PROFILES:
        raise ValueError(f"unknown verify profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]


def hypothesis_settings(profile: Profile) -> settings:
    """Hypothesis settings for a profile (custom Profile objects get the common settings)."""
    registered = f"coopt-{profile.name}"
    if PROFILES.get(profile.name) == profile:
        return settings.get_profile(registered)
    return settings(max_examples=profile.max_examples, **_COMMON)
