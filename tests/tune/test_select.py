"""Selection rules: pure, no subprocesses."""

from __future__ import annotations

import pytest

from coopt.tune.measurement import Measurement
from coopt.tune.select import UNMEASURED_PREFIX, select_candidate


def cand(label, family="elementwise", verified=True, rank=0):
    return {"label": label, "family": family, "verified": verified, "rank": rank}


REF = cand("ref", family="reference", rank=0)


def ms(value):
    return Measurement(median_ms=value, p20_ms=value * 0.95, p80_ms=value * 1.05)


def failed(why="worker crashed (SIGSEGV)"):
    return Measurement.failed(why)


def test_fastest_verified_wins_with_readable_reason():
    candidates = [REF, cand("c0", rank=1), cand("c1", rank=0), cand("c2", rank=2)]
    timings = {"ref": ms(0.052), "c0": ms(0.041), "c1": ms(0.045), "c2": ms(0.060)}
    label, reason = select_candidate(candidates, timings)
    assert label == "c0"
    assert reason == "fastest of 3 verified: 0.041 ms vs reference 0.052 ms (1.27x)"


def test_unverified_never_selected_even_if_fastest():
    candidates = [REF, cand("bad", verified=False), cand("ok")]
    label, _ = select_candidate(candidates, {"ref": ms(1.0), "bad": ms(0.1), "ok": ms(0.5)})
    assert label == "ok"


def test_reference_kept_when_faster():
    label, reason = select_candidate([REF, cand("c0")], {"ref": ms(0.030), "c0": ms(0.041)})
    assert label == "ref"
    assert reason.startswith("reference kept: 0.03 ms vs fastest of 1 verified c0 0.041 ms")


def test_tie_keeps_reference():
    label, reason = select_candidate([REF, cand("c0")], {"ref": ms(0.041), "c0": ms(0.041)})
    assert label == "ref"
    assert "ties" in reason


def test_min_speedup_margin_keeps_reference():
    label, reason = select_candidate([REF, cand("c0")], {"ref": ms(1.0), "c0": ms(0.98)}, min_speedup=1.05)
    assert label == "ref"
    assert "only 1.02x faster" in reason


def test_failed_timing_excluded():
    candidates = [REF, cand("fast_but_crashed", rank=0), cand("slow", rank=1)]
    timings = {"ref": ms(1.0), "fast_but_crashed": failed(), "slow": ms(0.5)}
    label, reason = select_candidate(candidates, timings)
    assert label == "slow"
    assert reason.endswith("; 1 verified not timed")


def test_missing_measurement_excluded():
    label, _ = select_candidate([REF, cand("a"), cand("b")], {"ref": ms(1.0), "b": ms(0.9)})
    assert label == "b"


def test_all_candidates_failed_keeps_reference():
    candidates = [REF, cand("c0"), cand("c1")]
    timings = {"ref": ms(1.0), "c0": failed("timed out after 60 s"), "c1": failed()}
    label, reason = select_candidate(candidates, timings)
    assert label == "ref"
    assert reason == "reference: none of 2 verified candidates could be timed (c0: timed out after 60 s)"


def test_everything_failed_keeps_reference():
    timings = {"ref": failed(), "c0": failed()}
    assert select_candidate([REF, cand("c0")], timings)[0] == "ref"


def test_reference_timing_failed_verified_candidate_wins():
    label, reason = select_candidate([REF, cand("c0")], {"ref": failed("worker exited with code 1"), "c0": ms(0.5)})
    assert label == "c0"
    assert "reference not timed: worker exited with code 1" in reason


def test_equal_times_break_ties_by_advisor_rank():
    candidates = [REF, cand("b", rank=1), cand("a", rank=2)]
    label, _ = select_candidate(candidates, {"ref": ms(1.0), "a": ms(0.5), "b": ms(0.5)})
    assert label == "b"


@pytest.mark.parametrize("measurements", [{}, None])
def test_unmeasured_uses_best_advisor_rank_among_verified(measurements):
    candidates = [REF, cand("c0", rank=0, verified=False), cand("c1", rank=2), cand("c2", rank=1)]
    label, reason = select_candidate(candidates, measurements)
    assert label == "c2"
    assert reason.startswith(UNMEASURED_PREFIX)
    assert reason == "unmeasured (no GPU): advisor rank 1, best of 2 verified"


def test_unmeasured_missing_rank_sorts_last():
    candidates = [REF, {"label": "norank", "family": "elementwise", "verified": True}, cand("c1", rank=5)]
    assert select_candidate(candidates, {})[0] == "c1"


def test_nothing_verified_reference_with_reason():
    label, reason = select_candidate([REF, cand("c0", verified=False), cand("c1", verified=False)], {})
    assert label == "ref"
    assert reason == "reference: none of 2 candidates passed verification"


def test_only_reference():
    label, reason = select_candidate([REF], {"ref": ms(1.0)})
    assert (label, reason) == ("ref", "reference: no template candidate for this region")


def test_reference_eligible_without_verified_flag():
    ref = {"label": "ref", "family": "reference"}
    assert select_candidate([ref, cand("c0", verified=False)], {})[0] == "ref"


def test_no_reference_is_an_error():
    with pytest.raises(ValueError, match="no reference"):
        select_candidate([cand("c0")], {})


@pytest.mark.parametrize(
    "value, text", [(0.0412, "0.0412"), (0.5, "0.5"), (12.345, "12.3"), (1234.5, "1234"), (0.00012, "1.20e-04")]
)
def test_ms_formatting_in_reasons(value, text):
    label, reason = select_candidate([REF, cand("c0")], {"ref": ms(value * 2), "c0": ms(value)})
    assert f": {text} ms vs" in reason


def test_unmeasured_shared_rank_across_families_keeps_build_order():
    # ranks are per family: two rank-0 candidates; the earlier one in selection.json wins
    candidates = [REF, cand("c0", family="row_reduction", rank=0), cand("c1", family="elementwise", rank=0)]
    assert select_candidate(candidates, {})[0] == "c0"
    assert select_candidate(list(reversed(candidates)), {})[0] == "c1"
