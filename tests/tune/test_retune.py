"""`coopt tune out/` on a hand-written build directory, timed on CPU (allow_cpu)."""

from __future__ import annotations

import json
import stat

import pytest
from tune_helpers import ADD, add_region, write_module

from coopt.errors import ConfigError, InputFileError
from coopt.tune import measure
from coopt.tune.retune import tune_build_dir

FAST = dict(warmup_ms=2, rep_ms=5, allow_cpu=True, timeout_s=30)

SLEEPS = """
    import time

    def run(a, b):
        time.sleep({seconds})
        return (a + b,)
"""

CRASHES_IF_IMPORTED = """
    import os
    os._exit(9)
"""


def entry(label, module, family="elementwise", verified=True, rank=0, latency=None):
    return {"label": label, "module": module, "family": family, "params": {}, "verified": verified,
            "verify": {}, "latency_ms": latency, "rank": rank}


@pytest.fixture
def build_dir(tmp_path):
    """Region r0: reference (2 ms), verified fast c0 and slow c1 (5 ms), unverified c2.
    Region r1: reference and one unverified candidate."""
    kernels = tmp_path / "kernels"
    write_module(kernels, "r0__reference", SLEEPS.format(seconds=0.002))
    write_module(kernels, "r0__c0", ADD)
    write_module(kernels, "r0__c1", SLEEPS.format(seconds=0.005))
    write_module(kernels, "r0__c2", CRASHES_IF_IMPORTED)
    write_module(kernels, "r1__reference", ADD)
    selection = {
        "regions": {
            "r0": {
                "family": "elementwise",
                "summary": add_region("r0").to_json(),
                "selected": "r0.c1",  # what an unmeasured build picked by advisor rank
                "candidates": [
                    entry("r0.reference", "kernels/r0__reference.py", family="reference"),
                    entry("r0.c0", "kernels/r0__c0.py", rank=1),
                    entry("r0.c1", "kernels/r0__c1.py", rank=0),
                    entry("r0.c2", "kernels/r0__c2.py", verified=False, rank=2, latency=0.001),
                ],
            },
            "r1": {
                "family": "elementwise",
                "summary": add_region("r1").to_json(),
                "selected": "r1.reference",
                "candidates": [
                    entry("r1.reference", "kernels/r1__reference.py", family="reference"),
                    entry("r1.c0", "kernels/does_not_exist.py", verified=False),
                ],
            },
        },
        "measured": False,
    }
    (tmp_path / "selection.json").write_text(json.dumps(selection, indent=2))
    (tmp_path / "selection.json").chmod(0o644)
    return tmp_path


def test_retune_measures_reselects_and_rewrites(build_dir):
    summary = tune_build_dir(build_dir, **FAST)

    assert summary["r0"]["old_selected"] == "r0.c1"
    assert summary["r0"]["selected"] == "r0.c0"
    assert summary["r0"]["reason"].startswith("fastest of 2 verified: ")
    assert summary["r1"] == {"old_selected": "r1.reference", "selected": "r1.reference",
                             "reason": "reference: none of 1 candidates passed verification"}

    selection = json.loads((build_dir / "selection.json").read_text())
    assert selection["measured"] is True
    r0 = selection["regions"]["r0"]
    assert r0["selected"] == "r0.c0" and r0["reason"] == summary["r0"]["reason"]
    by_label = {c["label"]: c for c in r0["candidates"]}
    assert by_label["r0.c0"]["latency_ms"] < by_label["r0.reference"]["latency_ms"] < by_label["r0.c1"]["latency_ms"]
    assert by_label["r0.c0"]["timing"]["device"] == "cpu"
    assert by_label["r0.c0"]["timing"]["achieved_gbps"] > 0
    # the unverified candidate was not run (it would have crashed) and its stale latency is gone
    assert by_label["r0.c2"]["latency_ms"] is None and "timing" not in by_label["r0.c2"]
    assert selection["regions"]["r1"]["candidates"][0]["latency_ms"] > 0

    # atomic rewrite: no temp files left behind, permissions kept
    assert sorted(p.name for p in build_dir.iterdir()) == ["kernels", "selection.json"]
    assert stat.S_IMODE((build_dir / "selection.json").stat().st_mode) == 0o644


def test_no_gpu_is_a_clear_error(build_dir, monkeypatch):
    monkeypatch.setattr(measure, "gpu_available", lambda: False)
    before = (build_dir / "selection.json").read_text()
    with pytest.raises(ConfigError, match="coopt tune needs a CUDA GPU; none found"):
        tune_build_dir(build_dir)
    assert (build_dir / "selection.json").read_text() == before


def _rewrite(build_dir, change):
    path = build_dir / "selection.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda d: (d / "selection.json").unlink(), "no selection.json"),
        (lambda d: (d / "selection.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "selection.json").write_text("[]"), "no 'regions' object"),
        (lambda d: _rewrite(d, lambda s: s["regions"]["r0"].pop("summary")), "region r0: no 'summary'"),
        (lambda d: _rewrite(d, lambda s: s["regions"]["r0"]["candidates"].pop(0)), "no reference candidate"),
        (lambda d: (d / "kernels" / "r0__c0.py").unlink(), "candidate r0.c0: module file"),
    ],
)
def test_not_a_build_dir(build_dir, spoil, message):
    spoil(build_dir)
    with pytest.raises(InputFileError, match="is not a coopt build directory") as info:
        tune_build_dir(build_dir, **FAST)
    assert message in info.value.message
    assert info.value.exit_code == 9


def test_empty_dir_is_not_a_build_dir(tmp_path):
    with pytest.raises(InputFileError, match="no selection.json"):
        tune_build_dir(tmp_path)


def test_a_changed_selection_drops_the_launch_choice_measured_for_the_old_one(build_dir):
    """The build measured PDL with r0.c1 selected (perhaps switched to for PDL): once tune selects
    r0.c0, the step launches without PDL and the note says why (the report shows it:
    tests/passes/test_launch_pdl.py)."""
    path = build_dir / "selection.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pdl": ["gemv_cuda"]}))
    tune_build_dir(build_dir, **FAST)
    selection = json.loads(path.read_text())
    assert selection["pdl"] == []
    assert selection["launch_note"].startswith("launched without PDL: the build measured PDL for gemv_cuda")
    assert "changed 1 regions' (r0)" in selection["launch_note"]


def test_an_unchanged_selection_keeps_the_launch_choice(build_dir):
    path = build_dir / "selection.json"
    data = json.loads(path.read_text())
    data["regions"]["r0"]["selected"] = "r0.c0"  # what the measurement will pick again
    path.write_text(json.dumps({**data, "pdl": ["gemv"]}))
    tune_build_dir(build_dir, **FAST)
    selection = json.loads(path.read_text())
    assert selection["pdl"] == ["gemv"] and "launch_note" not in selection
