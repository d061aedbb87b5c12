"""The API key comes from the environment and is never written anywhere we write."""

from __future__ import annotations

import logging

import pytest
from advisor_support import FAKE_KEY

from coopt.llm_advisor import AdviceCache, AdviceLog, AdvisorUnavailable, FallbackAdvisor, OpenAIAdvisor

GOOD = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}


def build(fake_llm, tmp_path, requests):
    """A miniature build: advise every request, log it, write advice.json."""
    cache = AdviceCache(tmp_path / "cache" / "advice.sqlite")
    advisor = FallbackAdvisor(OpenAIAdvisor(fake_llm.base_url, "m", timeout_s=2, max_retries=0, cache=cache))
    log = AdviceLog(advisor)
    answers = []
    for request in requests:
        advice = advisor.advise(request)
        log.record(request, advice)
        answers.append(advice)
    log.write(tmp_path / "out" / "advice.json")
    return answers


def written_bytes(root) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def test_key_is_sent_but_never_written(fake_llm, make_matmul_request, tmp_path, api_key, caplog):
    # A hostile server echoes the key in its rationale and in a rejected entry.
    fake_llm.ranking = [GOOD, {"BLOCK_M": FAKE_KEY}]
    fake_llm.rationale = f"thanks for {FAKE_KEY}"
    with caplog.at_level(logging.DEBUG):
        answers = build(fake_llm, tmp_path, [make_matmul_request(1, name="a")])
    assert fake_llm.auth == [f"Bearer {FAKE_KEY}"]
    assert answers[0].source == "openai" and answers[0].ranked == [GOOD]
    assert "***" in answers[0].rationale
    blob = written_bytes(tmp_path)
    assert blob and FAKE_KEY.encode() not in blob
    assert FAKE_KEY not in repr(answers) and FAKE_KEY not in caplog.text


def test_key_echoed_in_an_error_stays_out_of_messages(fake_llm, make_matmul_request, tmp_path, api_key):
    fake_llm.mode = "echo_key"
    with pytest.raises(AdvisorUnavailable) as info:
        OpenAIAdvisor(fake_llm.base_url, "m", timeout_s=2, max_retries=0).advise(make_matmul_request(1))
    assert "HTTP 401" in info.value.message and FAKE_KEY not in info.value.message
    answers = build(fake_llm, tmp_path, [make_matmul_request(1, name="a"), make_matmul_request(2, name="b")])
    warnings = " ".join(w for a in answers for w in a.warnings)
    assert "HTTP 401" in warnings and FAKE_KEY not in warnings
    assert FAKE_KEY.encode() not in written_bytes(tmp_path)


def test_advisor_object_holds_no_key(api_key):
    advisor = OpenAIAdvisor("http://user:pw@127.0.0.1:1/v1?token=abc", "m")
    assert FAKE_KEY not in repr(vars(advisor)) and FAKE_KEY not in advisor.identity
    assert advisor.identity == "openai:http://127.0.0.1:1/v1|m|prompt-v1"  # no user info, no query
    assert "pw" not in repr(advisor)


def test_unauthorised_without_key_says_which_variable(fake_llm, make_matmul_request, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    fake_llm.mode = "echo_key"
    with pytest.raises(AdvisorUnavailable, match=r"HTTP 401 \(\$OPENAI_API_KEY is not set\)"):
        OpenAIAdvisor(fake_llm.base_url, "m", timeout_s=2, max_retries=0).advise(make_matmul_request(1))
