"""advice.json: written by AdviceLog, replayed by ReplayAdvisor without any server."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from coopt.errors import InputFileError
from coopt.llm_advisor import AdviceLog, FallbackAdvisor, HeuristicAdvisor, OpenAIAdvisor, ReplayAdvisor

RANKING = [
    {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
]


@pytest.fixture
def recorded(fake_llm, make_matmul_request, tmp_path):
    """advice.json of a build of two regions answered by the fake model."""
    fake_llm.ranking = RANKING
    advisor = FallbackAdvisor(OpenAIAdvisor(fake_llm.base_url, "m", timeout_s=2, max_retries=0))
    log = AdviceLog(advisor)
    requests = [make_matmul_request(1, name="fc1"), make_matmul_request(1, n=11008, name="fc2")]
    for request in requests:
        log.record(request, advisor.advise(request))
    path = tmp_path / "out" / "advice.json"
    log.write(path)
    return path, requests


def test_advice_file_format(recorded):
    path, requests = recorded
    data = json.loads(path.read_text())
    assert data["version"] == 1
    assert data["advisor"]["name"] == "openai"
    assert data["advisor"]["identity"].startswith("openai:http://127.0.0.1:")
    entry = data["entries"][requests[0].key()]
    assert entry["region"] == "fc1" and entry["family"] == "matmul_epilogue"
    assert entry["ranked"] == RANKING and entry["source"] == "openai"
    assert entry["rejected"] == [] and entry["rationale"] == "small tiles for a GEMV"
    assert not list(path.parent.glob(".advice-*"))  # atomic write left no temp file


def test_replay_reproduces_the_ranking_without_a_server(recorded, fake_llm):
    path, requests = recorded
    seen = fake_llm.count
    replay = ReplayAdvisor(path)
    for request in requests:
        advice = replay.advise(request)
        assert advice.ranked == RANKING and advice.source == "replay" and advice.warnings == []
    assert fake_llm.count == seen
    assert replay.recorded_advisor["name"] == "openai"


def test_unknown_request_falls_back_to_heuristic_with_warning(recorded, make_matmul_request):
    path, _ = recorded
    changed = make_matmul_request(4096, name="fc1")  # the model changed shape
    advice = ReplayAdvisor(path).advise(changed)
    assert advice.source == "heuristic"
    assert advice.ranked == HeuristicAdvisor().advise(changed).ranked
    assert "no advice for region 'fc1'" in advice.warnings[0]


def test_hand_edited_illegal_points_are_screened(recorded):
    path, requests = recorded
    data = json.loads(path.read_text())
    entry = data["entries"][requests[0].key()]
    entry["ranked"].insert(0, {**RANKING[0], "BLOCK_M": 128, "BLOCK_N": 256})  # not legal
    path.write_text(json.dumps(data))
    advice = ReplayAdvisor(path).advise(requests[0])
    assert advice.ranked == RANKING and len(advice.rejected) == 1
    assert "not legal now" in advice.warnings[0]


def test_only_illegal_points_fall_back(recorded):
    path, requests = recorded
    data = json.loads(path.read_text())
    data["entries"][requests[0].key()]["ranked"] = [{"BLOCK_M": 3}]
    path.write_text(json.dumps(data))
    advice = ReplayAdvisor(path).advise(requests[0])
    assert advice.source == "heuristic" and advice.ranked and len(advice.rejected) == 1


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not JSON"),
    ("[]", "malformed"),
    ('{"version": 1, "advisor": {}}', "malformed at entries"),
    ('{"version": 1, "advisor": {}, "entries": {"k": {"region": "r"}}}', "malformed at entries.k.family"),
    ('{"version": 99, "advisor": {}, "entries": {}}', "version 99"),
])
def test_malformed_file_is_an_input_file_error(tmp_path, text, message):
    path = tmp_path / "advice.json"
    path.write_text(text)
    with pytest.raises(InputFileError, match=message) as info:
        ReplayAdvisor(path)
    assert "\n" not in info.value.message and info.value.exit_code == 9


def test_missing_file_is_an_input_file_error(tmp_path):
    with pytest.raises(InputFileError, match="cannot read advice file"):
        ReplayAdvisor(tmp_path / "nope.json")


def test_replay_of_a_heuristic_build(make_matmul_request, tmp_path):
    heuristic = HeuristicAdvisor()
    log = AdviceLog(heuristic)
    request = make_matmul_request(64)
    log.record(request, heuristic.advise(request))
    log.write(tmp_path / "advice.json")
    again = ReplayAdvisor(tmp_path / "advice.json").advise(replace(request))
    assert again.ranked == heuristic.advise(request).ranked


def test_strict_replay_raises_for_an_unknown_request(recorded, make_matmul_request):
    from coopt.errors import AdvisorError
    from coopt.llm_advisor import make_advisor

    path, requests = recorded
    strict = make_advisor("replay", advice_file=path, strict=True)
    assert strict.advise(requests[0]).source == "replay"
    with pytest.raises(AdvisorError, match="no advice for region 'fc1'"):
        strict.advise(make_matmul_request(4096, name="fc1"))
