"""The launch choice (coopt/tune/launch.py): a built program launches the kinds of kernel listed in
selection.json "pdl" with PDL and the others without, COOPT_PDL overriding it; choose_pdl keeps
an option only where the replayed step measured faster by more than MIN_GAIN. Without a GPU no
kernel can launch with PDL, so the tests stand in for the device's capability and its timer."""

from __future__ import annotations

import json

import pytest
import torch
from test_fuse_decode_gemv import DecoderBlock

import coopt
from coopt.emit.report import write_report
from coopt.runtime.loader import load
from coopt.tune import launch
from coopt.tune.launch import MIN_GAIN, choose_pdl, kernel_modules, set_pdl


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    """A two-block decoder at 3 rows: its projections are GEMV kernels (PDL kind "gemv"), its
    residual-free norm a row kernel of another kind."""
    out = tmp_path_factory.mktemp("launch") / "out"
    coopt.Pipeline(top_k=1).build(DecoderBlock(width=64, ffn=96).eval(), (torch.randn(3, 1, 64),), out)
    return out


@pytest.fixture
def capable(monkeypatch):
    """Every loaded kernel module behaves as on an sm_90 GPU (PDL possible); restored after."""
    def patch(built):
        for space in kernel_modules(built):
            monkeypatch.setitem(space, "_pdl_capable", lambda: True)
        return built
    yield patch


def pdl_by_kind(built) -> dict[str, set[bool]]:
    kinds: dict[str, set[bool]] = {}
    for space in kernel_modules(built):
        kinds.setdefault(space["PDL_KIND"], set()).add(space["PDL"])
    return kinds


def test_the_build_records_no_pdl_without_a_gpu(built_dir):
    selection = json.loads((built_dir / "selection.json").read_text())
    assert selection["pdl"] == []  # nothing measured: launched as before
    assert "launch" not in json.loads((built_dir / "build.json").read_text())


def test_set_pdl_switches_the_named_kinds_only(built_dir, capable, monkeypatch):
    monkeypatch.delenv("COOPT_PDL", raising=False)
    built = capable(load(built_dir, device="cpu"))
    kinds = pdl_by_kind(built)
    # GEMVs and, without a GPU, the norm's row kernel (on the H200 the build measured the
    # reference faster for this tiny norm, session 16: GEMVs alone there)
    assert "gemv" in kinds and (len(kinds) > 1 or torch.cuda.is_available()), kinds
    gemvs = sum(space["PDL_KIND"] == "gemv" for space in kernel_modules(built))
    assert set_pdl(built, ["gemv"]) == gemvs
    assert {kind: on for kind, on in pdl_by_kind(built).items()} == {kind: {kind == "gemv"} for kind in kinds}
    assert set_pdl(built, []) == 0 and pdl_by_kind(built) == {kind: {False} for kind in kinds}


def test_program_applies_selection_pdl_unless_coopt_pdl_is_set(built_dir, capable, monkeypatch, tmp_path):
    monkeypatch.delenv("COOPT_PDL", raising=False)
    built = capable(load(built_dir, device="cpu"))  # modules are cached: the patch stays for the reloads below
    selection = built_dir / "selection.json"
    original = selection.read_text()
    try:
        selection.write_text(json.dumps({**json.loads(original), "pdl": ["gemv"]}))
        reloaded = load(built_dir, device="cpu")
        assert pdl_by_kind(reloaded)["gemv"] == {True} and all(
            on == {False} for kind, on in pdl_by_kind(reloaded).items() if kind != "gemv")
        monkeypatch.setenv("COOPT_PDL", "0")  # an explicit setting wins over the build's choice
        set_pdl(reloaded, [])
        assert pdl_by_kind(load(built_dir, device="cpu"))["gemv"] == {False}
    finally:
        selection.write_text(original)


@pytest.mark.parametrize("gemv_ms, chosen", [(1.70, ["gemv"]), (1.80 * (1 - MIN_GAIN / 2), []), (1.85, [])])
def test_choose_pdl_keeps_an_option_only_when_it_wins_by_the_margin(built_dir, capable, gemv_ms, chosen):
    built = capable(load(built_dir, device="cpu"))
    captured = []  # the PDL state of the GEMVs when each option's graph was captured

    def graph():
        captured.append(pdl_by_kind(built)["gemv"])
        return lambda *inputs: None

    timer = lambda steps: {"none": 1.80, "gemv": gemv_ms}  # noqa: E731 - the GPU's medians
    launch_choice = choose_pdl(built, (torch.randn(3, 1, 64),), timer=timer, graph=graph, refine=False)
    assert captured == [{False}, {True}]  # each option captured with its own launch attributes
    assert launch_choice["pdl"] == chosen and launch_choice["step_ms"] == {"none": 1.80, "gemv": gemv_ms}
    assert pdl_by_kind(built)["gemv"] == {bool(chosen)}  # the model is left launching the choice


def test_choose_pdl_skips_options_naming_kinds_the_step_does_not_have(built_dir, capable):
    """The decoder has GEMVs and no decode attention: ("gemv", "decode_attention") would time the
    GEMV option twice; an unknown kind alone would time the step without PDL twice."""
    built = capable(load(built_dir, device="cpu"))
    timed = []
    choice = choose_pdl(built, (), options=(("no_such_kind",), ("gemv", "decode_attention"), ("gemv",)),
                        graph=lambda: (lambda *a: None), refine=False,
                        timer=lambda steps: timed.append(sorted(steps)) or {k: 1.0 for k in steps})
    assert timed == [["gemv", "none"]] and choice["pdl"] == []
    assert ("gemv", "decode_attention") in launch.PDL_OPTIONS  # the default options name it


def test_a_step_without_any_options_kinds_is_not_timed(built_dir, capable):
    built = capable(load(built_dir, device="cpu"))
    set_pdl(built, ["gemv"])
    timed = []
    assert choose_pdl(built, (), options=(("decode_attention",),), graph=lambda: (lambda *a: None),
                      timer=lambda steps: timed.append(steps)) is None
    assert timed == [] and pdl_by_kind(built)["gemv"] == {False}  # left launching without PDL


def test_the_report_states_the_launch_choice(built_dir, tmp_path):
    record = json.loads((built_dir / "build.json").read_text())
    try:
        record["launch"] = {"pdl": ["gemv"], "step_ms": {"none": 1.7802, "gemv": 1.7655}}
        (built_dir / "build.json").write_text(json.dumps(record))
        write_report(built_dir)
        report = (built_dir / "report.md").read_text()
        assert "- launch: PDL for gemv kernels, measured (the replayed step 1.7655 ms; without PDL 1.7802)" in report
    finally:
        del record["launch"]
        (built_dir / "build.json").write_text(json.dumps(record))
        write_report(built_dir)


def test_a_graph_replayed_builds_latency_line_says_what_a_replay_costs(built_dir):
    """The build-time latency is timed around Python calls; a graph-replayed step pays none of
    that, so the line says so and gives the replayed step's time under the chosen launch."""
    record = json.loads((built_dir / "build.json").read_text())
    e2e = {**record["end_to_end"], "eager_ms": 16.4358, "built_ms": 15.1155, "speedup": 16.4358 / 15.1155}
    try:
        (built_dir / "build.json").write_text(json.dumps({**record, "cuda_graphs": True, "end_to_end": e2e,
                                                          "launch": {"pdl": [], "label": "none", "step_ms": {
                                                              "none": 5.5358, "gemv": 5.5787}}}))
        write_report(built_dir)
        assert ("- latency at build time: eager 16.4358 ms, built 15.1155 ms → 1.09x (each call launched from "
                "Python; a CUDA graph replays the built step without that cost: 5.5358 ms)\n"
                ) in (built_dir / "report.md").read_text()
    finally:
        (built_dir / "build.json").write_text(json.dumps(record))
        write_report(built_dir)


@pytest.mark.parametrize("graphs", [True, False])
def test_a_build_slower_than_eager_from_python_says_why(built_dir, graphs):
    """Launched from Python a graph-replayed build pays a launch per kernel: the report names that
    and the replay, not 'input checks or spread', which is the reason left for a build without graphs."""
    record = json.loads((built_dir / "build.json").read_text())
    e2e = {**record["end_to_end"], "eager_ms": 26.2126, "built_ms": 28.2605, "speedup": 26.2126 / 28.2605}
    try:
        (built_dir / "build.json").write_text(json.dumps({**record, "cuda_graphs": graphs, "end_to_end": e2e}))
        write_report(built_dir)
        report = (built_dir / "report.md").read_text()
        assert ("launched from Python the built model was slower than eager" in report) is graphs
        assert ("the program's own overhead (input checks, pytree)" in report) is not graphs
    finally:
        (built_dir / "build.json").write_text(json.dumps(record))
        write_report(built_dir)


def test_the_report_states_a_launch_choice_that_coopt_tune_dropped(built_dir):
    record, selection = (json.loads((built_dir / name).read_text()) for name in ("build.json", "selection.json"))
    note = "launched without PDL: the build measured PDL for gemv with its own selection, ..."
    try:
        (built_dir / "build.json").write_text(json.dumps({**record, "launch": {"pdl": ["gemv"], "step_ms": {
            "none": 1.7802, "gemv": 1.7655}}}))
        (built_dir / "selection.json").write_text(json.dumps({**selection, "launch_note": note}))
        write_report(built_dir)
        report = (built_dir / "report.md").read_text()
        assert f"- launch: {note}\n" in report and "PDL for gemv kernels" not in report
    finally:
        (built_dir / "build.json").write_text(json.dumps(record))
        (built_dir / "selection.json").write_text(json.dumps(selection))
        write_report(built_dir)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="needs an sm_90+ GPU")
def test_a_graph_replayed_build_measures_and_records_its_launch(tmp_path):
    out = tmp_path / "out"
    coopt.Pipeline(top_k=1, cuda_graphs=True).build(DecoderBlock(width=64, ffn=96).eval(), (torch.randn(3, 1, 64),), out)
    launch_record = json.loads((out / "build.json").read_text())["launch"]
    times = launch_record["step_ms"]
    assert set(times) == {"none", "gemv"}
    expected = ["gemv"] if times["gemv"] < times["none"] * (1 - MIN_GAIN) else []
    selection = json.loads((out / "selection.json").read_text())
    assert launch_record["pdl"] == expected == selection["pdl"]
    # then module by module: what the refinement kept is what the program applies
    assert launch_record["pdl_regions"] == selection["pdl_regions"]
    assert launch_record["refined"]["chosen"] == "base" or selection["pdl_regions"]
    assert "- launch: " in (out / "report.md").read_text()


def fake_kernel(kind: str):
    """A generated module's run() and its PDL switch, as kernel_modules finds them (no GPU needed)."""
    space = {"PDL": False, "PDL_KIND": kind}
    exec("def use_pdl(on):\n    global PDL\n    PDL = bool(on)\n    return PDL\n\n\ndef run(*inputs):\n    return None\n",
         space)
    return space["run"]


def test_the_default_options_time_the_cuda_gemvs_alone_and_with_the_triton_ones():
    """A step with CUDA GEMVs (templates/gemv_cuda.py, built for PDL) beside Triton ones: both
    gemv_cuda options are timed, and the one that wins is what the step launches with."""
    from types import SimpleNamespace

    built = SimpleNamespace(_kernels={"r0": fake_kernel("gemv"), "r1": fake_kernel("gemv_cuda")})
    timed = []

    def timer(steps):
        timed.append(sorted(steps))
        return {label: 0.9 if label == "gemv_cuda" else 1.0 for label in steps}

    choice = choose_pdl(built, (), graph=lambda: (lambda *a: None), timer=timer, refine=False)
    assert timed == [["gemv", "gemv_cuda", "gemv_cuda,gemv", "none"]]  # no decode attention: not its option
    assert choice["pdl"] == ["gemv_cuda"]
    assert {space["PDL_KIND"]: space["PDL"] for space in kernel_modules(built)} == {"gemv": False, "gemv_cuda": True}


def test_a_pdl_option_is_timed_again_with_the_pdl_ready_kernels_switched_in():
    """tune/pdl_ready.py's switches are timed under each option that launches them with PDL; the
    winner is what the step launches, and the regions it switched are returned."""
    from types import SimpleNamespace

    selected = {"q": fake_kernel("gemv_cuda"), "o": fake_kernel("gemv")}
    ready = fake_kernel("gemv_cuda")
    built = SimpleNamespace(_kernels=dict(selected))
    captured = {}

    def graph():  # which kernel the region "o" ran, and whether with PDL, per captured option
        run = built._kernels["o"]
        captured[len(captured)] = (run is ready, run.__globals__["PDL"])
        return lambda *a: None

    def timer(steps):
        return {label: 0.95 if label == "gemv_cuda+ready" else 1.0 for label in steps}

    choice = choose_pdl(built, (), graph=graph, timer=timer, switches={"+ready": {"o": ("c4", ready)}}, refine=False)
    # switched, the step has no Triton GEMV left: gemv_cuda,gemv would time gemv_cuda+ready again
    assert sorted(choice["step_ms"]) == ["gemv", "gemv_cuda", "gemv_cuda+ready", "gemv_cuda,gemv", "none"]
    assert sum(switched for switched, _ in captured.values()) == 1
    assert all(on for switched, on in captured.values() if switched)  # captured launching it with PDL
    assert choice["pdl"] == ["gemv_cuda"] and choice["label"] == "gemv_cuda+ready"
    assert choice["reselected"] == {"o": "c4"}
    assert built._kernels == {"q": selected["q"], "o": ready} and ready.__globals__["PDL"]


@pytest.mark.parametrize("switched_ms", [0.99 * (1 - MIN_GAIN / 2), 1.01])
def test_a_switched_selection_must_beat_the_best_without_switches_by_the_margin(switched_ms):
    from types import SimpleNamespace

    selected = {"q": fake_kernel("gemv_cuda"), "o": fake_kernel("gemv_cuda")}
    built = SimpleNamespace(_kernels=dict(selected))
    times = {"none": 1.0, "gemv_cuda": 0.99, "gemv_cuda+ready": switched_ms}
    choice = choose_pdl(built, (), options=(("gemv_cuda",),), graph=lambda: (lambda *a: None), refine=False,
                        timer=lambda steps: {label: times[label] for label in steps},
                        switches={"+ready": {"o": ("c4", fake_kernel("gemv_cuda"))}})
    assert choice["label"] == "gemv_cuda" and choice["reselected"] == {}
    assert built._kernels == selected  # the selection alone is restored


def test_the_report_states_a_launch_with_switched_kernels(built_dir):
    from coopt.emit.report import _launch_line

    line = _launch_line({"pdl": ["gemv_cuda"], "label": "gemv_cuda+ready", "reselected": {"o": "c4", "q": "c2"},
                         "step_ms": {"none": 1.2, "gemv_cuda": 1.19, "gemv_cuda+ready": 1.18}})
    assert line == ("- launch: PDL for gemv_cuda with PDL-ready kernels re-selected (within 1 µs) (2 regions switched: "
                    "see their reasons), measured (the replayed step 1.1800 ms; without PDL 1.2000, PDL for gemv_cuda "
                    "1.1900)")


def test_each_switch_set_is_timed_and_the_winning_sets_regions_are_switched():
    """Two sets (tune/pdl_ready.py: within the budget, every ready kernel): each timed under the
    option naming its kinds; the faster set's switches are what the step keeps."""
    from types import SimpleNamespace

    selected = {"q": fake_kernel("gemv_cuda"), "up": fake_kernel("gemv_cuda")}
    ready_q, ready_up = fake_kernel("gemv_cuda"), fake_kernel("gemv_cuda")
    built = SimpleNamespace(_kernels=dict(selected))
    times = {"none": 1.0, "gemv_cuda": 1.0, "gemv_cuda+ready": 0.99, "gemv_cuda+allready": 0.97}
    choice = choose_pdl(built, (), options=(("gemv_cuda",),), graph=lambda: (lambda *a: None), refine=False,
                        timer=lambda steps: {label: times[label] for label in steps},
                        switches={"+ready": {"q": ("c5", ready_q)},
                                  "+allready": {"q": ("c5", ready_q), "up": ("c6", ready_up)}})
    assert sorted(choice["step_ms"]) == sorted(times)
    assert choice["label"] == "gemv_cuda+allready" and choice["reselected"] == {"q": "c5", "up": "c6"}
    assert built._kernels == {"q": ready_q, "up": ready_up}


def three_gemvs():
    """A step of three GEMV modules; "o" has a twin ("o2", another layer) sharing its module."""
    from types import SimpleNamespace

    q, o, up = fake_kernel("gemv"), fake_kernel("gemv"), fake_kernel("gemv")
    return SimpleNamespace(_kernels={"q": q, "o": o, "o2": o, "up": up})


def pdl_of(built) -> dict[str, bool]:
    return {region: run.__globals__["PDL"] for region, run in built._kernels.items()}


def timer_of(kinds_ms: dict, modules_ms: dict, together_ms: dict | None = None):
    """A stand-in GPU timer answering choose_pdl's call (labels "none", ...), refine_modules' call
    ("base" and one label a module) and its "together" call from the dicts given; records the calls."""
    calls = []

    def timer(steps):
        calls.append(sorted(steps))
        table = kinds_ms if "none" in steps else modules_ms if "base" in steps else together_ms
        return {label: table[label] for label in steps}
    timer.calls = calls
    return timer


def test_refinement_switches_off_the_module_that_loses_under_pdl():
    """Session 52 in small: PDL for the GEMVs wins, but one module (o, with its twin) loses by more
    than REFINE_GAIN: it is launched without PDL, its twin with it, the others keep PDL."""
    from coopt.tune.launch import REFINE_GAIN

    built = three_gemvs()
    timer = timer_of({"none": 1.0, "gemv": 0.98},
                     {"base": 0.98, "-q": 0.99, "-o": 0.98 * (1 - 2 * REFINE_GAIN), "-up": 0.98 * (1 - REFINE_GAIN / 2)})
    choice = choose_pdl(built, (), options=(("gemv",),), graph=lambda: (lambda *a: None), timer=timer)
    assert timer.calls == [["gemv", "none"], ["-o", "-q", "-up", "base"]]  # one module once: o's twin shares it
    assert choice["pdl"] == ["gemv"] and choice["pdl_regions"] == {"o": False, "o2": False}
    assert choice["refined"]["chosen"] == "-o"
    assert pdl_of(built) == {"q": True, "o": False, "o2": False, "up": True}


@pytest.mark.parametrize("together, kept", [(0.960, {"o": False, "o2": False, "up": False}), (0.975, {"o": False, "o2": False})])
def test_several_winning_switches_are_timed_together_against_the_best_alone(together, kept):
    built = three_gemvs()
    timer = timer_of({"none": 1.0, "gemv": 0.98}, {"base": 0.98, "-q": 0.99, "-o": 0.970, "-up": 0.972},
                     {"together": together, "best alone": 0.970})
    choice = choose_pdl(built, (), options=(("gemv",),), graph=lambda: (lambda *a: None), timer=timer)
    assert timer.calls[-1] == ["best alone", "together"]
    assert choice["pdl_regions"] == kept
    assert pdl_of(built) == {"q": True, **{region: region not in kept for region in ("o", "o2", "up")}}


def test_refinement_from_no_pdl_launches_the_module_that_gains_with_it():
    """Where PDL for the whole kind loses (the H200's b32 step, session 47), a module that gains
    alone is still launched with it."""
    built = three_gemvs()
    timer = timer_of({"none": 1.0, "gemv": 1.003}, {"base": 1.0, "+q": 0.99, "+o": 1.004, "+up": 0.9995})
    choice = choose_pdl(built, (), options=(("gemv",),), graph=lambda: (lambda *a: None), timer=timer)
    assert choice["pdl"] == [] and choice["pdl_regions"] == {"q": True}
    assert pdl_of(built) == {"q": True, "o": False, "o2": False, "up": False}


def test_each_refinement_capture_launches_its_own_switch():
    built = three_gemvs()
    captured = []

    def graph():
        captured.append(pdl_of(built))
        return lambda *a: None

    timer = timer_of({"none": 1.0, "gemv": 0.98}, {"base": 0.98, "-q": 0.98, "-o": 0.98, "-up": 0.98})
    choice = choose_pdl(built, (), options=(("gemv",),), graph=graph, timer=timer)
    assert captured[2:] == [  # (after the options' none and gemv)
        {"q": True, "o": True, "o2": True, "up": True},
        {"q": False, "o": True, "o2": True, "up": True},
        {"q": True, "o": False, "o2": False, "up": True},
        {"q": True, "o": True, "o2": True, "up": False}]
    assert choice["pdl_regions"] == {} and pdl_of(built) == {"q": True, "o": True, "o2": True, "up": True}


def test_program_applies_pdl_regions_over_the_kinds(built_dir, capable, monkeypatch):
    monkeypatch.delenv("COOPT_PDL", raising=False)
    built = capable(load(built_dir, device="cpu"))
    gemv_space = next(space for space in kernel_modules(built) if space["PDL_KIND"] == "gemv")
    off = [region for region, run in built._kernels.items() if run.__globals__ is gemv_space]
    selection = built_dir / "selection.json"
    original = selection.read_text()
    try:
        selection.write_text(json.dumps({**json.loads(original), "pdl": ["gemv"],
                                         "pdl_regions": {region: False for region in off}}))
        reloaded = load(built_dir, device="cpu")
        launched = {region: run.__globals__["PDL"] for region, run in reloaded._kernels.items()
                    if run.__globals__.get("PDL_KIND") == "gemv"}
        assert {region for region, on in launched.items() if not on} == set(off)
        assert any(launched.values()) or len(launched) == len(off)  # the kind's other modules keep PDL
    finally:
        selection.write_text(original)


def test_a_retune_that_changes_a_selection_drops_the_regions_launch_too():
    from coopt.tune.retune import _drop_stale_launch

    selection = {"pdl": [], "pdl_regions": {"r1": True, "r5": True}}
    _drop_stale_launch(selection, {"r1": {"old_selected": "c0", "selected": "c1"}})
    assert selection["pdl_regions"] == {} and "PDL for 2 regions" in selection["launch_note"]


def test_the_report_states_the_modules_switched():
    from coopt.emit.report import _launch_line, _replayed_ms

    launch = {"pdl": ["gemv"], "label": "gemv", "step_ms": {"none": 1.2, "gemv": 1.19},
              "pdl_regions": {"r3": False, "r8": False},
              "refined": {"chosen": "-r3", "step_ms": {"base": 1.19, "-r3": 1.185, "-r1": 1.192}}}
    assert _launch_line(launch).endswith(
        "; then, module by module, without PDL for 2 regions (r3, r8): the replayed step 1.1850 ms (unswitched 1.1900)")
    assert _replayed_ms(launch) == 1.185
