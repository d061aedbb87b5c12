"""`coopt passes` and `coopt opt` (IR in, IR out: the text form of pass tests)."""

import json
from pathlib import Path

from typer.testing import CliRunner

from coopt.cli.main import app

IR = Path(__file__).parent / "ir"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_passes_lists_every_pass_with_knobs():
    result = invoke("passes", "--json")
    data = json.loads(result.stdout)
    assert {"raise-patterns", "fuse-elementwise", "fuse-linear-epilogue", "fuse-norm-residual", "fuse-attention"} <= set(data["passes"])
    knobs = {k["name"]: k for k in data["passes"]["fuse-elementwise"]["knobs"]}
    assert knobs["max-ops"]["default"] == "8" and knobs["max-ops"]["type"] == "int"


def check(text: str, expected: list[str], absent: list[str] = ()) -> None:
    """filecheck-style: the expected fragments appear in this order; absent ones do not appear."""
    position = 0
    for fragment in expected:
        found = text.find(fragment, position)
        assert found >= 0, f"missing (in order) {fragment!r} in:\n{text}"
        position = found + len(fragment)
    for fragment in absent:
        assert fragment not in text, f"unexpected {fragment!r} in:\n{text}"


def test_opt_raises_and_fuses_a_linear_relu():
    out = invoke("opt", IR / "linear_relu.mlir", "-p", "raise-patterns,fuse-linear-epilogue")
    assert out.exit_code == 0, out.output
    check(out.stdout, ['"coopt.kernel"', 'family = "matmul_epilogue"', '"coopt.linear"', 'fn = "relu"', '"coopt.yield"'], absent=['"coopt.aten"'])


def test_opt_raise_only_leaves_no_kernels():
    out = invoke("opt", IR / "linear_relu.mlir", "-p", "raise-patterns")
    check(out.stdout, ['"coopt.linear"', '"coopt.ew"'], absent=['"coopt.kernel"'])


def test_opt_state_write_survives_every_pass():
    """A cache write has a memory effect: no pass or cleanup may drop it."""
    out = invoke("opt", IR / "state_write.mlir", "-p", "raise-patterns,fuse-elementwise")
    check(out.stdout, ['"coopt.kernel"', '"coopt.state_write"'])
