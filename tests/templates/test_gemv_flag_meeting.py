"""The GEMV's flag meeting (MEET="flag"): a split point's tiles merged by their last split, which
polls the others' flagged 64-bit partials, against the count meeting of the same point.

Under the interpreter the programs run one after another (the merger after its writers), so these
tests check what the meeting computes, that it leaves its slots empty for the next launch, that
the launch falls back to the count meeting past one program an SM, and where the knob is legal;
on a GPU (the same tests) the merger really waits.
"""

from __future__ import annotations

import pytest
import torch
from template_helpers import assert_gemv_points_compile, on_test_device
from test_matmul_gemv_fusions import (FAMILY, check_close, consumer_region, fused_region, gemv, make_inputs,
                                      producer_region, reference, row_cases)

from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.protocol import AdviceRequest
from coopt.targets import H200

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

# K = 301 leaves a masked K tail; N = 192 is 3 chunks of 64 (a 128-wide tile's second chunk past N)
SPLIT_POINTS = {
    "fma_split4": gemv(1, 64, 32, split=4),
    "dot_split4": gemv(16, 64, 32, split=4),
    "dot32_split2": gemv(32, 64, 64, split=2, stages=2),
    "swap_split2": {**gemv(16, 64, 64, split=2, stages=2), "SWAP_AB": True},
}


def run_both(load_candidate, region, point, inputs, stem):
    """The point's outputs with the count meeting and with the flag meeting, and the flag module."""
    count = FAMILY.render(region, {**point, "MEET": "count"})
    flag = FAMILY.render(region, {**point, "MEET": "flag"})
    assert FAMILY.check(region, {**point, "MEET": "flag"}, H200) is None
    flag_module = load_candidate(flag, f"{stem}_flag")
    inputs = on_test_device(inputs)
    return load_candidate(count, f"{stem}_count").run(*inputs), flag_module.run(*inputs), flag_module


def assert_same(first, second):
    for a, b in zip(first, second, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("m,point", row_cases(SPLIT_POINTS))
def test_the_flag_meeting_sums_as_the_count_meeting_does(m, point, load_candidate):
    region = producer_region(m, 192, 301)
    inputs = make_inputs(region, 30.0, seed=21)
    counted, flagged, module = run_both(load_candidate, region, SPLIT_POINTS[point], inputs, f"flag_{point}_{m}")
    # the same partials added in the same order: bit for bit, outputs and statistics
    assert_same(counted, flagged)
    a, b, residual, _ = inputs
    check_close(flagged[0], a.double() @ b.double().T + residual.double())
    # the merger emptied every slot it read: the next launch's flags start from zero
    (slots,) = module._FLAG_SLOTS.values()
    assert not slots.any()


def test_a_second_launch_reads_its_own_partials(load_candidate):
    # stale flags from the first launch would let the merger add the first inputs' partials
    region = consumer_region(17, 128, 512)
    point = {**gemv(16, 64, 64, split=4), "MEET": "flag"}
    module = load_candidate(FAMILY.render(region, point), "flag_twice")
    for seed in (22, 23):
        gen = torch.Generator().manual_seed(seed)
        hg = torch.randn((17, 512), generator=gen).to(torch.bfloat16)
        b = torch.randn((128, 512), generator=gen).to(torch.bfloat16)
        sq = torch.rand((512 // 64, 17), generator=gen) * 64 + 1
        (out,) = module.run(*on_test_device([hg, b, sq]))
        check_close(out, hg.double() @ b.double().T * torch.rsqrt(sq.double().sum(0) / 512 + 1e-5)[:, None])


def test_more_programs_than_sms_take_the_count_meeting(load_candidate, monkeypatch):
    region = fused_region((16,), 100, 301, "bfloat16", norm=False, has_bias=True)
    point = {**gemv(16, 32, 32, split=2), "MEET": "flag"}
    module = load_candidate(FAMILY.render(region, point), "flag_many")
    inputs = on_test_device(make_inputs(region, seed=24))
    waves = []
    monkeypatch.setattr(module, "_one_wave", lambda device, programs: waves.append(programs) or False)
    (out,) = module.run(*inputs)
    assert waves == [4 * 2]  # 4 column tiles of 32, 2 splits
    assert not module._FLAG_SLOTS  # never allocated: the count meeting ran
    check_close(out, reference(region, inputs)[0])


def test_where_the_flag_meeting_is_legal():
    plain = fused_region((16,), 4096, 4096, "bfloat16", norm=False)
    split = {**gemv(16, 64, 256, split=2), "MEET": "flag"}
    assert FAMILY.check(plain, split, H200) is None
    assert "SPLIT_K > 1" in FAMILY.check(plain, {**split, "SPLIT_K": 1}, H200)
    assert "'count' or 'flag'" in FAMILY.check(plain, {**split, "MEET": "atomic"}, H200)
    glu = fused_region((16,), 4096, 4096, "bfloat16", norm=False, glu=True)
    assert "no GLU" in FAMILY.check(glu, split, H200)
    normed = fused_region((16,), 4096, 4096, "bfloat16")  # the RMSNorm's row sums meet in the kernel
    assert "no RMSNorm summed in the kernel" in FAMILY.check(normed, split, H200)
    assert FAMILY.check(normed, {**split, "NORM_FIRST": True}, H200) is None
    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 2, "num_warps": 4, "num_stages": 3}
    assert "GEMV=True" in FAMILY.check(plain, {**tile, "MEET": "flag"}, H200)


def test_each_split_point_has_its_flag_twin_ranked_right_behind_it():
    region = producer_region(32, 4096, 4096)  # o + residual at b32, as a Llama-3-8B build has it
    space, points = FAMILY.param_space(region, H200), FAMILY.legal_points(region, H200)
    flags = [p for p in points if p.get("MEET") == "flag"]
    assert flags and all(p["GEMV"] and p["SPLIT_K"] > 1 and not p["STREAM_K"] for p in flags)
    splits = [p for p in points if p.get("GEMV") and p["SPLIT_K"] > 1 and p["MEET"] == "count"]
    assert len(flags) == len(splits)
    ranked = HeuristicAdvisor().advise(AdviceRequest(region, "matmul_epilogue", space, tuple(points), H200.facts())).ranked
    position = {tuple(sorted(p.items())): i for i, p in enumerate(ranked)}
    for point in flags:
        assert position[tuple(sorted(point.items()))] > position[tuple(sorted({**point, "MEET": "count"}.items()))]
    # a build's top points time both meetings of the best split point
    assert ranked[0]["SPLIT_K"] > 1 and ranked[1] == {**ranked[0], "MEET": "flag"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_flag_meeting_points_compile_for_hopper(tmp_path):
    # the b32 build's split points (o and down + residual, q|k|v's statistics prologue), the
    # interpreter's leniency aside: the merger's poll loop, 64-bit words, volatile loads
    flag = {"MEET": "flag"}
    cases = {
        "row_squares_rows32": (producer_region(32, 512, 4096), [
            {**gemv(32, 64, 128, split=2, stages=4), "SWAP_AB": True, **flag}, {**gemv(16, 64, 128, split=4), **flag}]),
        "stats_rows32": (consumer_region(32, 512, 4096), [{**gemv(32, 64, 128, split=2, stages=4), "SWAP_AB": True, **flag}]),
        "plain_rows1": (fused_region((1,), 512, 4096, "bfloat16", norm=False, has_bias=True),
                        [{**gemv(1, 32, 256, split=2, stages=4), **flag}]),
    }
    assert_gemv_points_compile(FAMILY, cases, make_inputs, tmp_path, H200)
