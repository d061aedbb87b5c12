"""Advisors by name: what `--advisor NAME` resolves to.

Built-in names are "heuristic", "openai" and "replay"; plugins add more through the
`coopt.plugins` entry point (`advisors = {name: class}`, constructed with no arguments).
Every advisor except the heuristic is wrapped in `FallbackAdvisor`, so an unusable answer
becomes the heuristic's answer and a warning unless `strict`.
"""

from __future__ import annotations

import os
from pathlib import Path

from coopt import plugins
from coopt.errors import ConfigError
from coopt.llm_advisor.cache import AdviceCache
from coopt.llm_advisor.fallback import FallbackAdvisor
from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.openai_advisor import OpenAIAdvisor
from coopt.llm_advisor.protocol import Advisor
from coopt.llm_advisor.replay import ReplayAdvisor

BUILTIN_ADVISORS = ("heuristic", "openai", "replay")


def known_advisors() -> list[str]:
    """Built-in advisor names, then plugin advisor names (sorted)."""
    plugins.check_builtin_clash("advisors", BUILTIN_ADVISORS)
    return [*BUILTIN_ADVISORS, *sorted(plugins.plugin_advisors())]


def make_advisor(
    spec: str,
    *,
    base_url: str | None = None,
    model: str | None = None,
    advice_file: str | os.PathLike | None = None,
    strict: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> Advisor:
    """The advisor named `spec`, ready to use.

        >>> make_advisor("heuristic").name
        'heuristic'
        >>> make_advisor("openai", base_url="http://127.0.0.1:8000/v1", model="m").identity
        'openai:http://127.0.0.1:8000/v1|m|prompt-v1 (fallback: heuristic:v1)'

    "openai" needs `model`; `base_url` defaults to $OPENAI_BASE_URL, else OpenAI's own API.
    Its answers are cached in `cache_dir/advice.sqlite` (default: $COOPT_CACHE_DIR or
    ~/.cache/coopt). "replay" needs `advice_file`; with `strict` a region the file does not
    answer ends the build instead of using the heuristic. Unknown names raise ConfigError.
    """
    if spec == "heuristic":
        return HeuristicAdvisor()
    if spec == "openai":
        if not model:
            raise ConfigError("advisor 'openai' needs a model name (--advisor-model)")
        url = base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        cache = AdviceCache(Path(cache_dir) / "advice.sqlite" if cache_dir is not None else None)
        return FallbackAdvisor(OpenAIAdvisor(url, model, cache=cache), strict=strict)
    if spec == "replay":
        if advice_file is None:
            raise ConfigError("advisor 'replay' needs an advice file (--advice out/advice.json)")
        return ReplayAdvisor(advice_file, strict=strict)
    found = plugins.plugin_advisors()
    if spec in found and spec not in BUILTIN_ADVISORS:
        return FallbackAdvisor(found[spec](), strict=strict)
    raise ConfigError(f"unknown advisor '{spec}'; known advisors: {', '.join(known_advisors())}")
