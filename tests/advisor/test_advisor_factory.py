"""make_advisor / known_advisors: names, configuration errors, plugin advisors."""

from __future__ import annotations

import pytest

from coopt import plugins
from coopt.errors import AdvisorError, ConfigError
from coopt.llm_advisor import (
    Advice,
    Advisor,
    AdvisorUnavailable,
    FallbackAdvisor,
    HeuristicAdvisor,
    OpenAIAdvisor,
    ReplayAdvisor,
    known_advisors,
    make_advisor,
)


class FirstLegal:
    name = "first-legal"

    def advise(self, request):
        return Advice(ranked=[request.legal[-1], {"BLOCK_M": 999}], source=self.name)


class Broken:
    name = "broken"

    def advise(self, request):
        raise AdvisorUnavailable("plugin backend down")


@pytest.fixture
def with_plugins(monkeypatch):
    monkeypatch.setattr(plugins, "plugin_advisors", lambda: {"first-legal": FirstLegal, "broken": Broken})
    monkeypatch.setattr(plugins, "check_builtin_clash", lambda kind, names: None)


def test_known_advisors_lists_builtins_then_plugins(with_plugins):
    assert known_advisors() == ["heuristic", "openai", "replay", "broken", "first-legal"]


def test_builtins(tmp_path, fake_llm):
    assert isinstance(make_advisor("heuristic"), HeuristicAdvisor)
    openai_advisor = make_advisor("openai", base_url=fake_llm.base_url, model="m", cache_dir=tmp_path, strict=True)
    assert isinstance(openai_advisor, FallbackAdvisor) and openai_advisor.strict
    assert isinstance(openai_advisor.primary, OpenAIAdvisor)
    assert openai_advisor.primary.cache.path == tmp_path / "advice.sqlite"
    (tmp_path / "advice.json").write_text('{"version": 1, "advisor": {}, "entries": {}}')
    assert isinstance(make_advisor("replay", advice_file=tmp_path / "advice.json"), ReplayAdvisor)
    assert all(isinstance(a, Advisor) for a in (make_advisor("heuristic"), openai_advisor))


@pytest.mark.parametrize("spec, kwargs, message", [
    ("openai", {}, "needs a model name"),
    ("replay", {}, "needs an advice file"),
    ("gpt-oracle", {}, "unknown advisor 'gpt-oracle'; known advisors: heuristic, openai, replay"),
])
def test_configuration_errors(spec, kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        make_advisor(spec, **kwargs)
    assert info.value.exit_code == 5


def test_openai_base_url_from_env(monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:1234/v1")
    assert make_advisor("openai", model="m").primary.base_url == "http://127.0.0.1:1234/v1"


def test_plugin_answers_are_screened(with_plugins, make_matmul_request):
    request = make_matmul_request(1)
    advice = make_advisor("first-legal").advise(request)
    assert advice.source == "first-legal" and advice.ranked == [request.legal[-1]]
    assert advice.rejected[0]["params"] == {"BLOCK_M": 999}


def test_failing_plugin_falls_back_or_raises(with_plugins, make_matmul_request):
    request = make_matmul_request(1)
    advice = make_advisor("broken").advise(request)
    assert advice.source == "heuristic" and "advisor 'broken' failed (plugin backend down)" in advice.warnings[0]
    with pytest.raises(AdvisorError):
        make_advisor("broken", strict=True).advise(request)
