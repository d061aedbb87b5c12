"""OpenAIAdvisor against the local fake endpoint: ranking, screening, failures, fallback, cache."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from coopt.errors import AdvisorError
from coopt.llm_advisor import AdviceCache, AdvisorUnavailable, FallbackAdvisor, HeuristicAdvisor, OpenAIAdvisor


def advisor(fake_llm, tmp_path=None, **kwargs) -> OpenAIAdvisor:
    kwargs.setdefault("timeout_s", 2)
    kwargs.setdefault("max_retries", 0)
    cache = AdviceCache(tmp_path / "advice.sqlite") if tmp_path is not None else None
    return OpenAIAdvisor(fake_llm.base_url, "fake-model", cache=cache, **kwargs)


GOOD = [
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
]


def test_valid_reply_is_ranked_in_the_model_order(fake_llm, make_matmul_request):
    fake_llm.ranking = GOOD
    advice = advisor(fake_llm).advise(make_matmul_request(1))
    assert advice.ranked == GOOD
    assert advice.source == "openai"
    assert advice.rejected == [] and advice.warnings == []
    assert advice.rationale == "small tiles for a GEMV"
    assert fake_llm.count == 1


def test_request_carries_prompt_and_strict_schema(fake_llm, make_matmul_request):
    fake_llm.ranking = GOOD
    advisor(fake_llm).advise(make_matmul_request(1))
    body = fake_llm.requests[0]
    assert body["model"] == "fake-model"
    user = json.loads(body["messages"][-1]["content"])
    assert user["kernel"]["family"] == "matmul_epilogue"
    assert user["kernel"]["flops"] == 2 * 1 * 4096 * 4096
    assert user["kernel"]["bytes_moved"] > 0 and user["kernel"]["target"]["num_sms"] == 132
    assert user["space"]["BLOCK_M"] == [16, 32, 64, 128]
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    params = fmt["json_schema"]["schema"]["properties"]["ranked"]["items"]["properties"]["params"]
    assert params["properties"]["num_stages"] == {"type": "integer", "enum": [2, 3, 4]}
    assert params["additionalProperties"] is False


def test_out_of_space_entries_are_rejected_and_recorded(fake_llm, make_matmul_request):
    fake_llm.ranking = [
        {"BLOCK_M": 7, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},  # not in space
        GOOD[0],
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},  # space, not legal
        {"BLOCK_M": 16, "BLOCK_N": 64},  # missing knobs
        GOOD[0],  # duplicate
        {**GOOD[1], "SPLIT_K": 2},  # unknown knob
        GOOD[1],
    ]
    advice = advisor(fake_llm).advise(make_matmul_request(1))
    assert advice.ranked == [GOOD[0], GOOD[1]]
    reasons = [entry["reason"] for entry in advice.rejected]
    assert len(reasons) == 5
    assert "BLOCK_M=7 is not in the space" in reasons[0]
    assert "not a legal point" in reasons[1]
    assert "missing knob(s)" in reasons[2]
    assert "duplicate" in reasons[3]
    assert "unknown knob(s): SPLIT_K" in reasons[4]
    assert advice.rejected[0]["params"]["BLOCK_M"] == 7
    assert "5 point(s) outside the legal set" in advice.warnings[0]


def test_integral_floats_are_accepted_for_int_knobs(fake_llm, make_matmul_request):
    fake_llm.ranking = [{k: float(v) for k, v in GOOD[0].items()}]
    advice = advisor(fake_llm).advise(make_matmul_request(1))
    assert advice.ranked == [GOOD[0]] and all(type(v) is int for v in advice.ranked[0].values())


def test_bare_points_and_fenced_json_are_accepted(fake_llm, make_matmul_request, monkeypatch):
    import advisor_support

    fake_llm.ranking = GOOD[:1]
    advice = advisor(fake_llm).advise(make_matmul_request(1))
    assert advice.ranked == GOOD[:1]
    # a schema-less server: ```json fences around a list of bare points, one entry malformed
    reply = "```json\n" + json.dumps({"ranked": [GOOD[1], {"params": 3}], "rationale": "r"}) + "\n```"
    monkeypatch.setattr(advisor_support, "ranking_content", lambda state: reply)
    advice = advisor(fake_llm).advise(make_matmul_request(2))
    assert advice.ranked == [GOOD[1]]
    assert advice.rejected == [{"params": {"params": 3}, "reason": "entry has no 'params' object"}]


def test_only_illegal_entries_is_unavailable(fake_llm, make_matmul_request):
    fake_llm.ranking = [{"BLOCK_M": 7}]
    with pytest.raises(AdvisorUnavailable, match="no legal point in the reply"):
        advisor(fake_llm).advise(make_matmul_request(1))


@pytest.mark.parametrize("mode, message", [
    ("garbage", "reply is not JSON"),
    ("not_chat", "not a chat.completion"),
    ("http500", "HTTP 500"),
])
def test_bad_replies_raise_advisor_unavailable(fake_llm, make_matmul_request, mode, message):
    fake_llm.mode = mode
    with pytest.raises(AdvisorUnavailable, match=message) as info:
        advisor(fake_llm).advise(make_matmul_request(1))
    assert "\n" not in info.value.message and info.value.exit_code == 7


def test_garbage_falls_back_to_heuristic_with_warning(fake_llm, make_matmul_request):
    fake_llm.mode = "garbage"
    request = make_matmul_request(1)
    advice = FallbackAdvisor(advisor(fake_llm)).advise(request)
    assert advice.source == "heuristic"
    assert advice.ranked == HeuristicAdvisor().advise(request).ranked
    assert advice.warnings[0].startswith("advisor 'openai' failed (reply is not JSON")
    assert "using heuristic" in advice.warnings[0]


@pytest.mark.parametrize("mode", ["http500", "slow"])
def test_dead_endpoint_is_asked_once_per_build(fake_llm, make_matmul_request, mode):
    fake_llm.mode = mode
    fallback = FallbackAdvisor(advisor(fake_llm, timeout_s=0.5))
    start = time.monotonic()
    first = fallback.advise(make_matmul_request(1, name="a"))
    second = fallback.advise(make_matmul_request(8, name="b"))
    third = fallback.advise(make_matmul_request(512, name="c"))
    assert fake_llm.count == 1  # no retries configured, and never asked again after failing
    assert time.monotonic() - start < 2.5
    assert all(a.source == "heuristic" and a.ranked for a in (first, second, third))
    assert ("timed out" if mode == "slow" else "HTTP 500") in first.warnings[0]
    assert "remaining regions" in first.warnings[0]
    assert "not asked" in second.warnings[0] and "not asked" in third.warnings[0]


def test_client_retries_are_counted_then_endpoint_dropped(fake_llm, make_matmul_request):
    fake_llm.mode = "http500"
    fallback = FallbackAdvisor(advisor(fake_llm, max_retries=1))
    fallback.advise(make_matmul_request(1, name="a"))
    assert fake_llm.count == 2  # the openai client's own retry
    fallback.advise(make_matmul_request(1, name="b"))
    assert fake_llm.count == 2


def test_strict_raises_advisor_error(fake_llm, make_matmul_request):
    fake_llm.mode = "garbage"
    with pytest.raises(AdvisorError, match="reply is not JSON") as info:
        FallbackAdvisor(advisor(fake_llm), strict=True).advise(make_matmul_request(1))
    assert info.value.exit_code == 7


def test_unreachable_endpoint_is_unavailable(make_matmul_request):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = OpenAIAdvisor(f"http://127.0.0.1:{port}/v1", "m", timeout_s=1, max_retries=0)
    with pytest.raises(AdvisorUnavailable, match="cannot connect"):
        dead.advise(make_matmul_request(1))


def test_cache_hit_on_second_identical_request(fake_llm, make_matmul_request, tmp_path):
    fake_llm.ranking = GOOD
    first = advisor(fake_llm, tmp_path).advise(make_matmul_request(1))
    fake_llm.mode = "http500"  # a second request would now fail: the cache must answer
    second = advisor(fake_llm, tmp_path).advise(make_matmul_request(1))  # a new build, same cache file
    assert fake_llm.count == 1
    assert (first.source, second.source) == ("openai", "cache")
    assert second.ranked == first.ranked and second.rationale == first.rationale


def test_cache_is_keyed_by_model_and_request(fake_llm, make_matmul_request, tmp_path):
    fake_llm.ranking = GOOD
    advisor(fake_llm, tmp_path).advise(make_matmul_request(1))
    advisor(fake_llm, tmp_path).advise(make_matmul_request(2))  # different region
    OpenAIAdvisor(fake_llm.base_url, "other-model", timeout_s=2, max_retries=0,
                  cache=AdviceCache(tmp_path / "advice.sqlite")).advise(make_matmul_request(1))
    assert fake_llm.count == 3


def test_single_legal_point_needs_no_request(fake_llm, make_matmul_request):
    from dataclasses import replace

    request = make_matmul_request(1)
    request = replace(request, legal=request.legal[:1])
    advice = advisor(fake_llm).advise(request)
    assert advice.ranked == [request.legal[0]] and fake_llm.count == 0


def test_key_from_env_is_sent_and_placeholder_without_it(fake_llm, make_matmul_request, monkeypatch, api_key):
    fake_llm.ranking = GOOD
    advisor(fake_llm).advise(make_matmul_request(1))
    monkeypatch.delenv("OPENAI_API_KEY")
    advisor(fake_llm).advise(make_matmul_request(1))
    assert fake_llm.auth == [f"Bearer {api_key}", "Bearer not-needed"]


def test_package_imports_without_openai():
    code = (
        "import sys; sys.modules['openai'] = None\n"
        "import coopt.llm_advisor as a\n"
        "adv = a.OpenAIAdvisor('http://127.0.0.1:9/v1', 'm')\n"
        "from coopt.ir.region import RegionSummary\n"
        "r = a.AdviceRequest(RegionSummary('r', 'x', (), ()), 'x', {'B': [1, 2]}, ({'B': 1}, {'B': 2}), {})\n"
        "try:\n    adv.advise(r)\nexcept a.AdvisorUnavailable as e:\n    print('unavailable:', e.message)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "'openai' package is not installed" in out.stdout
