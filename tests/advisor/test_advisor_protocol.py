"""AdviceRequest.key and Advice JSON: stable, order-independent, sensitive to every field."""

from __future__ import annotations

from dataclasses import replace

from coopt.llm_advisor import Advice
from coopt.llm_advisor.screen import screen_proposals


def test_key_is_stable_and_sensitive(make_matmul_request):
    request = make_matmul_request(1)
    assert request.key() == make_matmul_request(1).key()
    assert len(request.key()) == 64
    reordered = replace(request, space=dict(reversed(list(request.space.items()))),
                        legal=tuple(dict(reversed(list(p.items()))) for p in request.legal))
    assert reordered.key() == request.key()  # dict insertion order does not matter
    for changed in (
        make_matmul_request(2),
        make_matmul_request(1, name="fc2"),
        replace(request, legal=request.legal[1:]),
        replace(request, top_k=8),
        replace(request, target={**request.target, "num_sms": 78}),
        replace(request, family="other"),
    ):
        assert changed.key() != request.key()


def test_advice_json_round_trip():
    advice = Advice([{"B": 1}], "openai", [{"params": {"B": 3}, "reason": "r"}], ["w"], "why")
    assert Advice.from_json(advice.to_json()) == advice


def test_screen_keeps_types_apart(make_matmul_request):
    request = replace(make_matmul_request(1), space={"FLAG": [1, True]}, legal=({"FLAG": 1},))
    ranked, rejected = screen_proposals(request, [{"FLAG": True}, {"FLAG": 1}, "junk"])
    assert ranked == [{"FLAG": 1}]
    assert "not a legal point" in rejected[0]["reason"] and "not a parameter object" in rejected[1]["reason"]


def test_schema_types_follow_the_knob_values(make_matmul_request):
    from coopt.llm_advisor.prompt import response_format

    space = {"PACK_GQA": [False, True], "MODE": ["a", "b"], "MIXED": [1, "x"], "SCALE": [0.5, 1.0]}
    schema = response_format(replace(make_matmul_request(1), space=space))["json_schema"]["schema"]
    knobs = schema["properties"]["ranked"]["items"]["properties"]["params"]["properties"]
    assert {k: v["type"] for k, v in knobs.items()} == {
        "MIXED": ["integer", "string"], "MODE": "string", "PACK_GQA": "boolean", "SCALE": "number"}
