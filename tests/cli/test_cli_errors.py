"""Bad input at the command line: one clear line on stderr, a documented exit code, no traceback,
and no output directory (or staging leftovers) after a failure."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coopt.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
TINY = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
    def forward(self, x):
        return torch.relu(self.fc(x))
def get_init_inputs():
    return []
def get_inputs():
    return [torch.randn(2, 8)]
"""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def model_file(tmp_path, text=TINY, name="model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def assert_one_line_error(result, code: int, *fragments):
    assert result.exit_code == code, result.output
    lines = [l for l in result.stderr.splitlines() if l.startswith("coopt: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def no_leftovers(tmp_path, out: Path):
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".building-" in p.name]


@pytest.mark.parametrize(
    "text, code, fragment",
    [
        (None, 3, "not found"),
        ("def broken(:\n", 3, "syntax error"),
        ("import torch\n", 3, "no class `Model`"),
        (TINY.replace("return [torch.randn(2, 8)]", "raise OSError('disk gone')"), 3, "get_inputs() failed: OSError: disk gone"),
        (TINY.replace("return torch.relu(self.fc(x))", "return x * 2 if x.sum() > 0 else x"), 4, "dynamic_shapes()"),
    ],
)
def test_model_problems(tmp_path, text, code, fragment):
    path = model_file(tmp_path, text) if text is not None else tmp_path / "missing.py"
    out = tmp_path / "out"
    assert_one_line_error(invoke("build", path, "-o", out, "-q"), code, fragment)
    no_leftovers(tmp_path, out)


def test_unknown_target_lists_the_known_ones(tmp_path):
    result = invoke("build", model_file(tmp_path), "-o", tmp_path / "out", "--target", "a100")
    assert_one_line_error(result, 5, "unknown target 'a100'", "h100", "h200")


@pytest.mark.parametrize("pipeline, fragment", [("raise-patterns,nope", "unknown pass 'nope'"), ("fuse-elementwise{wat=1}", "unknown knob 'wat'")])
def test_bad_pipeline(tmp_path, pipeline, fragment):
    assert_one_line_error(invoke("build", model_file(tmp_path), "-o", tmp_path / "out", "-p", pipeline), 5, fragment)


def test_non_empty_out_is_refused_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert_one_line_error(invoke("build", model_file(tmp_path), "-o", out), 6, "--force")
    assert (out / "keep.txt").read_text() == "precious"


def test_opt_rejects_unparseable_ir(tmp_path):
    bad = tmp_path / "bad.mlir"
    bad.write_text("builtin.module { this is not ir }")
    assert_one_line_error(invoke("opt", bad, "-p", "raise-patterns"), 9, "cannot parse")


def test_tune_rejects_a_directory_that_is_not_a_build(tmp_path):
    assert_one_line_error(invoke("tune", tmp_path), 9)


def test_unreachable_advisor_falls_back_with_a_warning_or_fails_when_strict(tmp_path):
    args = ["build", model_file(tmp_path), "-q", "--advisor", "openai", "--advisor-model", "m",
            "--advisor-url", "http://127.0.0.1:9/v1", "--top-k", "1"]
    strict = invoke(*args, "-o", tmp_path / "strict", "--no-advisor-fallback")
    assert_one_line_error(strict, 7, "advisor")
    no_leftovers(tmp_path, tmp_path / "strict")
    relaxed = invoke(*args, "-o", tmp_path / "relaxed")
    assert relaxed.exit_code == 0, relaxed.output
    assert "coopt: warning: advisor 'openai' failed" in relaxed.stderr
    assert "using heuristic" in (tmp_path / "relaxed" / "report.md").read_text()


def test_console_script_exit_code_and_json(tmp_path):
    """The installed `coopt` script itself (not just the typer app) reports errors as JSON."""
    result = subprocess.run(
        [sys.executable, "-m", "coopt.cli.main", "build", str(tmp_path / "nope.py"), "-o", str(tmp_path / "o"), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 3
    assert json.loads(result.stdout) == {"ok": False, "error": f"model file '{tmp_path / 'nope.py'}' not found", "exit_code": 3}


def test_too_little_disk_space_is_refused_before_the_build(tmp_path, monkeypatch):
    """The weights would not fit: one line, exit 6, nothing left behind, and the refusal comes
    before the build's work (capture is never reached)."""
    import shutil

    import coopt.compile

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    monkeypatch.setattr(coopt.compile, "capture", lambda *a, **k: pytest.fail("the build started"))
    out = tmp_path / "out"
    result = invoke("build", model_file(tmp_path), "-o", out)
    assert_one_line_error(result, 6, "not enough disk space for the model's weights", "needed")
    no_leftovers(tmp_path, out)


def test_the_gpu_running_out_of_memory_is_exit_11_with_torch_s_first_sentences(tmp_path, monkeypatch):
    """torch's message runs to a paragraph of allocator advice; the user gets what was asked and
    what was free, one line, exit 11, and no output directory."""
    import torch

    import coopt.api

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1002.00 MiB. GPU 0 has a total capacity of "
                                     "79.18 GiB of which 230.12 MiB is free. Including non-PyTorch memory, this process "
                                     "has 78.95 GiB memory in use. If reserved but unallocated memory is large try ...")

    monkeypatch.setattr(coopt.api, "compile_model", out_of_memory)
    out = tmp_path / "out"
    result = invoke("build", model_file(tmp_path), "-o", out, "-q")
    assert_one_line_error(result, 11, "GPU ran out of memory", "Tried to allocate 1002.00 MiB", "230.12 MiB is free")
    assert "Including non-PyTorch memory" not in result.stderr
    no_leftovers(tmp_path, out)


def test_a_check_that_cannot_fit_is_refused_before_the_capture(tmp_path, monkeypatch):
    """compile_model asks ensure_room_for_the_check first: exit 11, capture never reached."""
    import coopt.compile
    from coopt.errors import DeviceMemoryError

    def no_room(model):
        raise DeviceMemoryError("the GPU cannot hold the build's end-to-end check: (test)")

    monkeypatch.setattr(coopt.compile, "ensure_room_for_the_check", no_room)
    monkeypatch.setattr(coopt.compile, "capture", lambda *a, **k: pytest.fail("the build started"))
    out = tmp_path / "out"
    assert_one_line_error(invoke("build", model_file(tmp_path), "-o", out, "-q"), 11, "cannot hold the build's end-to-end check")
    no_leftovers(tmp_path, out)


def test_coopt_tune_out_of_gpu_memory_is_exit_11_too(tmp_path, monkeypatch):
    import torch

    import coopt.api
    import coopt.tune.retune
    from coopt.errors import DeviceMemoryError

    def out_of_memory(out, timeout_s):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. Including non-PyTorch memory ...")

    monkeypatch.setattr(coopt.tune.retune, "tune_build_dir", out_of_memory)
    with pytest.raises(DeviceMemoryError, match=r"during coopt tune \(CUDA out of memory\. Tried to allocate 2\.00 GiB\.\)") as raised:
        coopt.api.tune(tmp_path)
    assert raised.value.exit_code == 11
