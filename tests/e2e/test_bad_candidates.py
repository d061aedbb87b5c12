"""A template candidate that crashes the process or hangs must fail alone: the build goes on,
records why, and selects something verified."""

import json
import torch
from built_calls import beside_eager

import coopt
from coopt.templates import registry
from coopt.templates.base import TemplateFamily

BEHAVIOURS = {
    "crash": "import os\n    os._exit(3)",
    "hang": "import time\n    time.sleep(3600)",
    "wrong": "return (inputs[0] * 0 + 1,)",
}


class EvilFamily(TemplateFamily):
    """Offers three 'elementwise' candidates: one crashes, one hangs, one is wrong."""

    name = "evil"

    def matches(self, region):
        return region.family == "elementwise"

    def param_space(self, region, target):
        return {"behaviour": list(BEHAVIOURS)}

    def render(self, region, params):
        return "def run(*inputs):\n    " + BEHAVIOURS[params["behaviour"]] + "\n"


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2.0


def test_crashing_hanging_and_wrong_candidates_fail_alone(tmp_path, monkeypatch):
    real = registry.template_families
    monkeypatch.setattr(registry, "template_families", lambda: {**real(), "evil": EvilFamily()})
    out = tmp_path / "out"
    result = coopt.Pipeline(top_k=3, candidate_timeout_s=20).build(Model(), (torch.randn(4, 8),), out)
    (region,) = result.regions
    verdicts = {c.params.get("behaviour"): c for c in region.candidates if c.family == "evil"}
    assert not any(c.verified for c in verdicts.values())
    assert "crashed" in verdicts["crash"].verify["failure"]
    assert "timed out" in verdicts["hang"].verify["failure"]
    assert "max abs err" in verdicts["wrong"].verify["failure"]
    # the wrong candidate left a runnable repro; the genuine template still won
    assert verdicts["wrong"].verify["repro"]
    selected = next(c for c in region.candidates if c.label == region.selected)
    assert selected.verified and selected.family in ("elementwise", "reference")
    results = json.loads((out / "verify" / "results.json").read_text())
    assert len(results[region.summary.name]) == len(region.candidates) - 1
    built = coopt.load(out)
    x = torch.randn(4, 8)
    torch.testing.assert_close(beside_eager(built)(x), torch.relu(x) * 2.0)


def test_diverse_top_k_prefers_distinct_tiles():
    from coopt.candidates import diverse_top_k

    ranked = [
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 4},
        {"BLOCK_M": 128, "BLOCK_N": 256, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_N": 128, "num_stages": 3},
    ]
    assert [r for r, _ in diverse_top_k(ranked, 3)] == [0, 2, 3]
    assert [r for r, _ in diverse_top_k(ranked[:2], 2)] == [0, 1]  # fills up when tiles run out
