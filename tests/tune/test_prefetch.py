"""The GEMVs' L2 prefetch of the next weight as a step-level choice (coopt/tune/prefetch.py): each
prefetching region's plan follows its next GEMV's selected point; a budget is kept only where the
replayed step measured faster by more than MIN_GAIN; the built program applies selection.json
"prefetch" (COOPT_TAIL_PREFETCH overriding the bytes); the report states the choice. Without a
GPU nothing can prefetch, so the tests stand in for the modules' switch and the timer."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from coopt.candidates import CandidateEntry, RegionBuild
from coopt.ir.region import RegionSummary, TensorSpec
from coopt.tune.launch import MIN_GAIN
from coopt.tune.prefetch import BUDGETS, DEFAULT_PLAN, choose_prefetch, prefetch_plans

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))


def gemv_region(name: str, weight: str, *, prefetches: str | None = None, params: dict | None = None,
                selected: str = "t0") -> RegionBuild:
    """A matmul_epilogue region on weight `weight` ([64, 64]); with `prefetches` it takes that
    weight last (tail prefetch); its candidate t0 a template GEMV at `params`."""
    spec = TensorSpec((64, 64), "bfloat16")
    inputs, names, attrs = [TensorSpec((3, 64), "bfloat16"), spec], ["", weight], {"b_layout": "nk"}
    if prefetches:
        inputs.append(spec)
        names.append(prefetches)
        attrs["tail_prefetch"] = {"input": 2, "layout": "nk"}
    summary = RegionSummary(name, "matmul_epilogue", tuple(inputs), (TensorSpec((3, 64), "bfloat16"),), attrs,
                            input_names=tuple(names))
    point = {"GEMV": True, "SPLIT_K": 1, "BLOCK_K": 128, **(params or {})}
    candidates = [CandidateEntry("reference", "reference", "reference.py"),
                  CandidateEntry("t0", "matmul_epilogue", "t0.py", params=point, verified=True)]
    return RegionBuild(summary, candidates, selected=selected)


def test_each_plan_follows_the_next_gemvs_selected_point():
    regions = [gemv_region("o", "wo", prefetches="wgu"),
               gemv_region("gate_up", "wgu", prefetches="wd", params={"BLOCK_K": 64}),
               gemv_region("down", "wd", prefetches="wq", params={"SPLIT_K": 2, "BLOCK_K": 256}),
               gemv_region("qkv", "wq", selected="reference"),
               gemv_region("lone", "wl", prefetches="wq", selected="reference")]
    plans = prefetch_plans(regions)
    assert plans == {"o": {"split_k": 1, "block_k": 64},  # gate|up's point
                     "gate_up": {"split_k": 2, "block_k": 256},  # down's
                     "down": DEFAULT_PLAN}  # q|k|v runs its reference: the plan's default
    assert "lone" not in plans  # a region that runs its reference prefetches nothing


def fake_prefetching(calls: list, capable: bool = True):
    """A generated module's run() and use_tail_prefetch as tune/prefetch.py finds them."""
    space = {"calls": calls, "capable": capable}
    exec("def use_tail_prefetch(budget, split_k=1, block_k=128):\n"
         "    calls.append((budget, split_k, block_k))\n    return capable and budget > 0\n\n\n"
         "def run(*inputs):\n    return None\n", space)
    return space["run"]


@pytest.mark.parametrize("gain,chosen", [(0.0, "none"), (MIN_GAIN / 2, "none"), (2 * MIN_GAIN, "16 MB")])
def test_a_budget_is_kept_only_when_the_step_wins_by_the_margin(gain, chosen):
    calls = []
    built = SimpleNamespace(_kernels={"o": fake_prefetching(calls), "qkv": fake_prefetching([])})
    plans = {"o": {"split_k": 2, "block_k": 256}}
    timed = []

    def timer(steps):
        timed.append(sorted(steps))
        return {label: 1.0 - (gain if label == "16 MB" else 0.0) for label in steps}

    choice = choose_prefetch(built, (), plans, graph=lambda: (lambda *a: None), timer=timer)
    assert timed == [sorted(["none", *(f"{b >> 20} MB" for b in BUDGETS)])]
    assert choice["label"] == chosen and choice["bytes"] == (16 << 20 if chosen != "none" else 0)
    assert calls[-1] == (choice["bytes"], 2, 256)  # what the step now launches with, at the plan
    assert choice["plans"] == plans


def test_nothing_is_timed_where_no_kernel_can_prefetch():
    calls = []
    built = SimpleNamespace(_kernels={"o": fake_prefetching(calls, capable=False)})
    assert choose_prefetch(built, (), {"o": dict(DEFAULT_PLAN)}, graph=lambda: (lambda *a: None),
                           timer=lambda steps: pytest.fail("timed")) is None
    assert calls[-1][0] == 0


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    """fuse-norm-statistics' two-layer decoder at 3 rows, built with prefetch-next-weight."""
    from test_fuse_norm_statistics import TwoLayerDecoder, step

    import coopt
    from coopt.passes.registry import DEFAULT_PIPELINE

    out = tmp_path_factory.mktemp("prefetch") / "out"
    coopt.Pipeline(DEFAULT_PIPELINE + ",prefetch-next-weight", top_k=1).build(TwoLayerDecoder().eval(), (step(3),), out)
    return out


def test_the_program_applies_selection_prefetch(built_dir):
    from coopt.runtime.loader import load

    selection_path = built_dir / "selection.json"
    original = selection_path.read_text()
    data = json.loads(original)
    assert data["prefetch"] == {}  # no GPU: nothing timed, nothing prefetches
    linked = [name for name, entry in data["regions"].items() if entry["summary"]["attrs"].get("tail_prefetch")]
    assert len(linked) == 6
    try:
        data["prefetch"] = {"bytes": 8 << 20, "plans": {name: {"split_k": 2, "block_k": 32} for name in linked}}
        selection_path.write_text(json.dumps(data))
        built = load(built_dir)
        for name in linked:  # each plan applied; the bytes stay 0 without a Hopper GPU
            assert built._kernels[name].__globals__["PREFETCH"] == {"bytes": 0, "split_k": 2, "block_k": 32}
        x = torch.randn(3, 1, 64)
        with torch.no_grad():
            assert built(x).shape == (3, 1, 32)
    finally:
        selection_path.write_text(original)


def test_the_report_states_the_prefetch_choice(built_dir):
    from coopt.emit.report import write_report

    path = built_dir / "build.json"
    original = path.read_text()
    record = json.loads(original)
    try:
        record["launch"] = {"pdl": ["gemv"], "step_ms": {"none": 1.53, "gemv": 1.52}, "label": "gemv",
                            "prefetch": {"bytes": 16 << 20, "label": "16 MB", "plans": {"r1": {}, "r2": {}},
                                         "step_ms": {"none": 1.52, "8 MB": 1.515, "16 MB": 1.51}}}
        record["cuda_graphs"] = True
        path.write_text(json.dumps(record))
        write_report(built_dir)
        report = (built_dir / "report.md").read_text()
        assert ("- prefetch: 16 MB of the next weight a GEMV launch pulled into L2 (2 GEMVs), measured "
                "(the replayed step 1.5100 ms; none 1.5200, 8 MB 1.5150)") in report
    finally:
        path.write_text(original)
        write_report(built_dir)
