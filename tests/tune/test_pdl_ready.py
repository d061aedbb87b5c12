"""tune/pdl_ready.py: which regions the launch step may switch to a PDL-ready kernel (verified,
timed, within SWAP_BUDGET_MS of the region's selection, not already selected), and how a kept
switch is recorded. Families stand in as a dict: only their pdl_ready answer matters here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tune_helpers import add_region

from coopt.candidates import REFERENCE, CandidateEntry, RegionBuild
from coopt.tune.pdl_ready import SWAP_BUDGET_MS, apply_reselection, ready_swaps, ready_switches

# a family whose points with READY=1 are PDL-ready
FAMILIES = {"fam": SimpleNamespace(pdl_ready=lambda region, params: params.get("READY") == 1)}


def build(name: str, selected: str, *entries: tuple[str, int, bool, float | None]) -> RegionBuild:
    """A region whose candidates are (label, READY, verified, latency_ms), beside its reference."""
    candidates = [CandidateEntry(REFERENCE, REFERENCE, "kernels/ref.py", verified=True, latency_ms=0.05)]
    candidates += [CandidateEntry(label, "fam", f"kernels/{name}_{label}.py", {"READY": ready}, verified=ok,
                                  latency_ms=ms) for label, ready, ok, ms in entries]
    return RegionBuild(SimpleNamespace(name=name), candidates, selected=selected, reason="fastest")


def test_each_region_gets_its_fastest_ready_kernel_within_the_budget():
    near = build("near", "c0", ("c0", 0, True, 0.0100), ("c1", 1, True, 0.0100 + SWAP_BUDGET_MS / 2),
                 ("c2", 1, True, 0.0100 + SWAP_BUDGET_MS * 0.9))
    far = build("far", "c0", ("c0", 0, True, 0.0100), ("c1", 1, True, 0.0100 + SWAP_BUDGET_MS * 1.5))
    unverified = build("unverified", "c0", ("c0", 0, True, 0.0100), ("c1", 1, False, 0.0090))
    untimed = build("untimed", "c0", ("c0", 0, True, 0.0100), ("c1", 1, True, None))
    already = build("already", "c1", ("c0", 0, True, 0.0095), ("c1", 1, True, 0.0100))
    regions = [near, far, unverified, untimed, already]
    swaps = ready_swaps(regions, families=FAMILIES)
    assert {name: entry.label for name, entry in swaps.items()} == {"near": "c1"}
    # without a budget the far one switches too; the two sets differ, so both are offered
    sets = ready_switches(regions, families=FAMILIES)
    assert {suffix: sorted(swaps) for suffix, swaps in sets.items()} == {"+ready": ["near"], "+allready": ["far", "near"]}


def test_a_set_equal_to_another_is_not_offered_twice():
    near = build("near", "c0", ("c0", 0, True, 0.0100), ("c1", 1, True, 0.0100))
    assert list(ready_switches([near], families=FAMILIES)) == ["+ready"]


def test_a_kept_switch_is_recorded_in_the_regions_selection_and_reason():
    region = build("o", "c0", ("c0", 0, True, 0.0100), ("c1", 1, True, 0.0104))
    other = build("q", "c0", ("c0", 0, True, 0.0100))
    apply_reselection([region, other], {"o": region.candidates[2]}, {"gemv_cuda+ready": 1.2345}, "gemv_cuda+ready")
    assert region.selected == "c1" and other.selected == "c0" and other.reason == "fastest"
    assert region.reason.startswith("re-selected for PDL: c1 (0.0104 ms alone, against c0's 0.01)")
    assert "1.2345 ms" in region.reason and region.reason.endswith("(was: fastest)")


@pytest.mark.parametrize("selected", [REFERENCE, "c0"])
def test_a_region_without_ready_kernels_is_left_alone(selected):
    region = build("r", selected, ("c0", 0, True, 0.0100))
    assert ready_swaps([region], families=FAMILIES) == {} and ready_switches([region], families=FAMILIES) == {}


@pytest.mark.parametrize("passes", [True, False])
def test_a_switched_selection_is_checked_end_to_end_and_undone_where_it_fails(tmp_path, passes):
    """compile._check_reselection: the mix the launch step switched is checked whole; a failure
    puts every region back on its own selection, launched without PDL, with a warning."""
    import json

    from coopt.compile import _check_reselection

    region = build("o", "c0", ("c0", 0, True, 0.0100), ("c1", 1, True, 0.0104))
    region.summary = add_region("o")
    launch = {"pdl": ["gemv_cuda"], "label": "gemv_cuda+ready", "reselected": {"o": "c1"}, "step_ms": {}}
    alone = {"o": ("c0", "fastest")}
    apply_reselection([region], {"o": region.candidates[2]}, {"gemv_cuda+ready": 1.0}, "gemv_cuda+ready")

    def end_to_end(warnings):
        warnings.append("checked")
        return {"ok": passes}, None

    warnings = []
    e2e, accuracy, after = _check_reselection(end_to_end, ({"ok": True, "first": True}, None), launch, alone,
                                              [region], tmp_path, True, warnings)
    written = json.loads((tmp_path / "selection.json").read_text())
    if passes:
        assert e2e == {"ok": True} and after == launch and region.selected == "c1"
        assert written["pdl"] == ["gemv_cuda"] and warnings == ["checked"]
    else:
        assert e2e == {"ok": True, "first": True} and region.selected == "c0" and region.reason == "fastest"
        assert after["pdl"] == [] and after["label"] == "none" and after["reselected"] == {} and "reverted" in after
        assert written["pdl"] == [] and written["regions"]["o"]["selected"] == "c0"
        assert len(warnings) == 1 and "failed the end-to-end check" in warnings[0]


def test_a_region_the_end_to_end_check_put_on_its_reference_stays_there():
    """Bisection may fall back one twin alone (end_to_end._fall_back): its ready kernel, however
    fast, is not switched in, or the kernel that broke the model's agreement would come back."""
    leader = build("r0", "c0", ("c0", 0, True, 0.0100), ("c1", 1, True, 0.0100))
    fallen = RegionBuild(SimpleNamespace(name="r1"), leader.candidates, selected=REFERENCE, reason="fell back")
    assert {suffix: sorted(swaps) for suffix, swaps in ready_switches([leader, fallen], families=FAMILIES).items()} \
        == {"+ready": ["r0"]}
