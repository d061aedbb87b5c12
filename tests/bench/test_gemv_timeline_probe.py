"""bench/gemv_timeline_probe.py on the CPU: the patch puts its three stamps where it says on every
point it times (and fails loudly when the template moves), and the summary's phases come out of
known stamps."""

from __future__ import annotations

import gemv_timeline_probe as probe
import pytest

from coopt.targets import H200
from coopt.templates.matmul_epilogue import MatmulEpilogueFamily


def run_signature(source: str) -> str:
    return next(line for line in source.splitlines() if line.startswith("def run("))


def rendered(name: str) -> str:
    region, params = probe.shapes()[name]
    family = MatmulEpilogueFamily()
    assert family.check(region, params, H200) is None
    return family.render(region, params)


@pytest.mark.parametrize("name", sorted(probe.shapes()))
def test_the_stamps_go_after_the_wait_the_loop_and_the_last_store(name):
    source = probe.instrument(rendered(name))
    kernel = source[source.index("def _gemv_kernel("):source.index("\n\n\n", source.index("def _gemv_kernel("))]
    lines = kernel.splitlines()
    at = [i for i, line in enumerate(lines) if "_stamp(stamps_ptr, pid," in line]
    assert [lines[i].split("pid, ")[1][0] for i in at] == ["0", "1", "2"]
    wait = next(i for i, line in enumerate(lines) if "gdc_wait()" in line)
    loop = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for k in tl.range("))
    assert wait < at[0] < loop < at[1] and at[2] == len(lines) - 1
    assert lines[at[2]].startswith("    _stamp") and "tl.debug_barrier()" in lines[at[2] - 1]
    assert " partial, arrivals, _STAMPS,\n" in source  # the launch passes the stamps


@pytest.mark.parametrize("name", sorted(probe.shapes()))
def test_the_first_slab_stamp_waits_for_a_load_of_the_first_slab_before_the_loop(name):
    source = probe.instrument(rendered(name), first_slab=True)
    lines = source[source.index("def _gemv_kernel("):].splitlines()
    first = next(i for i, line in enumerate(lines) if "_stamp(stamps_ptr, pid, 4," in line)
    loop = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for k in tl.range("))
    assert first < loop and "tl.load(b_ptrs)" in lines[first]
    assert "pid, 4," not in probe.instrument(rendered(name))


def test_the_build_forms_are_the_builds_regions():
    """The "+" forms carry what a b32 build's GEMV regions carry (their launch arguments differ
    from the plain ones'), at the same points and weights."""
    every = probe.shapes()
    for name in ("qkv", "o", "gate_up", "down"):
        plain, fused = every[name][0], every[name + "+"][0]
        assert every[name][1] == every[name + "+"][1]
        assert plain.inputs[1] == fused.inputs[1] or fused.attrs.get("glu")
    assert every["qkv+"][0].attrs["prologue"]["kind"] == "rms_norm_stats" and every["gate_up+"][0].attrs["glu"]
    assert every["o+"][0].attrs["row_squares"]["chunk"] == probe.CHUNK == 64
    assert every["gate_up+"][0].inputs[1].shape == every["gate_up"][0].inputs[1].shape  # [gate; up]: the same bytes
    assert probe.programs(*every["gate_up+"]) == probe.programs(*every["gate_up"]) // 2 == 112


@pytest.mark.parametrize("name", ["o+", "down+"])
def test_the_template_loads_the_residual_and_g_after_the_wait_and_before_the_loop(name):
    """What session 47's probe measured (o+ 12.22 against 12.36 µs, down+ 32.83 against 33.42 on
    the H200), now the template's form: the epilogue's residual and g are read once, between the
    PDL wait and the K loop, and the epilogue takes them as values."""
    source = rendered(name)
    kernel = source[source.index("def _gemv_kernel("):]
    lines = kernel.splitlines()
    loads = [i for i, line in enumerate(lines) if "early_in0 = tl.load(" in line or "early_rs_g = tl.load(" in line]
    loop = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for k in tl.range("))
    wait = next(i for i, line in enumerate(lines) if "gdc_wait()" in line)
    assert len(loads) == 2 and wait < min(loads) and max(loads) < loop
    epilogue = source[source.index("def _epilogue("):source.index("def _gemv_kernel(")]
    assert "tl.load(in0_ptr" not in epilogue and "tl.load(rs_g_ptr" not in epilogue
    assert "in0 = early_in0.to(tl.float32)" in epilogue and "rs_g = early_rs_g.to(tl.float32)" in epilogue
    assert kernel.count("(total, early_in0, early_rs_g, ") + kernel.count("(acc, early_in0, early_rs_g, ") \
        == kernel.count("_epilogue(") >= 1


def test_stream_k_programs_keep_loading_them_in_the_epilogue():
    """A stream-K program may finish several tiles: its epilogue's inputs are the tile's, read there."""
    region, params = probe.shapes()["o+"]
    source = MatmulEpilogueFamily().render(region, {**params, "SPLIT_K": 1, "STREAM_K": 1})
    epilogue = source[source.index("def _epilogue("):source.index("def _gemv_kernel(")]
    assert "early_" not in source and "tl.load(in0_ptr" in epilogue and "tl.load(rs_g_ptr" in epilogue


def test_a_moved_template_is_refused_not_half_patched():
    with pytest.raises(AssertionError, match="the template changed"):
        probe.instrument(rendered("o").replace("acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]", "acc = acc.T"))


def test_the_phases_come_from_the_stamps():
    # two launches of three programs: [start, loop end, end, sm, first slab] in ns (the second
    # launch's first slabs stamped)
    first = [[1000, 5000, 6000, 0, 0], [1500, 6000, 6500, 1, 0], [1200, 9000, 9400, 0, 0]]
    second = [[10000, 14000, 15000, 2, 11000], [10100, 14200, 15200, 3, 11300], [10300, 14100, 15100, 4, 12300]]
    summary = probe.summarize([first, second], weight_bytes=4_200_000, bandwidth=4.2e12)
    a, b = summary["launches"]
    assert a["span_us"] == pytest.approx(8.4) and a["ramp_us"] == pytest.approx(0.5)
    assert (a["loop_min_us"], a["loop_median_us"], a["loop_max_us"]) == pytest.approx((4.0, 4.5, 7.8))
    assert a["tail_us"] == pytest.approx(3.0) and a["epilogue_us"] == pytest.approx(0.4)
    assert (a["sms"], a["most_programs_an_sm"]) == (2, 2) and a["bytes_us"] == pytest.approx(1.0)
    assert "gap_us" not in a and b["gap_us"] == pytest.approx(0.6)
    assert "first_slab_median_us" not in a
    assert (b["first_slab_median_us"], b["first_slab_max_us"]) == pytest.approx((1.2, 2.0))


def test_every_alternative_is_a_legal_point_and_o_and_down_get_some_without_a_meeting():
    family = MatmulEpilogueFamily()
    for name in probe.ALTERNATIVES:
        pairs = probe.alternatives(name)
        assert pairs and all(family.check(region, params, H200) is None for region, params in pairs), name
        # the probe calls each alternative with the build's inputs: the same launch arguments
        build_run = run_signature(family.render(*probe.shapes()[name]))
        assert all(run_signature(family.render(region, params)) == build_run for region, params in pairs), name
    for name in ("o+", "down+"):
        unsplit = [(r, p) for r, p in probe.alternatives(name) if p["SPLIT_K"] == 1]
        assert any(probe.programs(r, p) == 128 for r, p in unsplit)  # 32-column tiles: every SM busy, no meeting
        assert all(r.attrs["row_squares"]["chunk"] <= p["BLOCK_N"] for r, p in unsplit)
    assert max(probe.programs(*pair) for pair in probe.alternatives("qkv+")) > probe.programs(*probe.shapes()["qkv+"])
