"""The main job end to end on the three examples: build, load, compare with the original.

On CPU the kernels run in Triton's interpreter, so every template path these models use is
exercised here; on a GPU (pytest -m gpu on the device) the same tests launch real kernels.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from built_calls import DEVICE, beside_eager, verified_kernel

import coopt
from coopt.emit.state_file import stored_state
from coopt.passes.fuse_parallel_linears import concat_parts
from coopt.frontend.model_file import load_model_file

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Each example built once (top-2 candidates per family to keep CI time down)."""
    done = {}

    def build(name: str):
        if name not in done:
            out = tmp_path_factory.mktemp(name) / "out"
            result = coopt.build(EXAMPLES / f"{name}.py", out, target="h100", top_k=2)
            done[name] = (out, result)
        return done[name]

    return build


@pytest.mark.parametrize("name", ["mlp", "minigpt_block", "llama_layer"])
def test_example_builds_verified_and_matches_the_original(builds, name):
    out, result = builds(name)
    for path in ["manifest.json", "program.py", "weights.pt", "zeros.json", "selection.json", "advice.json", "report.md", "verify/results.json", "ir/00-import.mlir"]:
        assert (out / path).is_file(), path
    assert result.measured == torch.cuda.is_available()  # without a GPU: advisor's pick, unmeasured
    selection = json.loads((out / "selection.json").read_text())
    for region, entry in selection["regions"].items():
        chosen = next(c for c in entry["candidates"] if c["label"] == entry["selected"])
        assert chosen["verified"], f"{region} selected an unverified candidate"
    # a generated kernel verified; without a GPU (selection by advisor rank) one is selected, on a
    # GPU the faster of kernel and reference is (the H100 kept ATen for every region of mlp)
    assert any(verified_kernel(r) for r in result.regions), "no generated kernel verified"
    if not torch.cuda.is_available():
        assert any(r.selected != "reference" for r in result.regions), "no generated kernel survived"
    assert result.e2e["ok"]
    # the loaded module reproduces the original model (same weights, fresh inputs)
    loaded = load_model_file(EXAMPLES / f"{name}.py")
    loaded.model.load_state_dict(_original_state(out, loaded.model), strict=False)
    built = coopt.load(out)
    fresh = [torch.randn_like(x) for x in loaded.example_inputs]
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(built)(*fresh), loaded.model(*fresh), rtol=1e-4, atol=1e-4)


def _original_state(out: Path, model) -> dict:
    """The original model's tensors as the build stored them (merged weights split back)."""
    weights = stored_state(out / "weights.pt", "cpu")
    own = model.state_dict()
    state = {}
    for name, tensor in weights.items():
        parts = concat_parts(name) or [name]
        sizes = [own[p].shape[0] for p in parts] if len(parts) > 1 else [tensor.shape[0]]
        state.update({p: t for p, t in zip(parts, tensor.split(sizes)) if p in own})
    return state


EXPECTED_PATTERNS = {
    "mlp": {"fuse.matmul_epilogue": 2},
    "minigpt_block": {"raise.attention.explicit.causal": 1, "fuse.row_reduction.layer_norm+residual": 1, "fuse.attention": 1},
    # 2 x 16 tokens = 32 rows: both norms are GEMV prologues (fuse-decode-gemv), the residual add
    # before the second one an epilogue of the o-projection, which also gives that norm its rows'
    # statistics (fuse-norm-statistics; the first norm's input is the layer's input)
    "llama_layer": {"raise.rms_norm.explicit": 2, "raise.swiglu": 1, "fuse.attention.gqa": 1, "fuse.decode_gemv.norm_prologue": 2,
                    "fuse.norm_statistics": 1, "fuse.decode_gemv.glu.silu": 1, "raise.rope": 2, "fuse.rope": 2, "fuse.parallel_linears": 2},
}


@pytest.mark.parametrize("name", EXPECTED_PATTERNS)
def test_example_patterns_are_recognised(builds, name):
    _, result = builds(name)
    for counter, expected in EXPECTED_PATTERNS[name].items():
        assert result.counters.get(counter, 0) == expected, (counter, result.counters)


def test_report_says_what_was_fused_and_what_was_not_measured(builds):
    out, _ = builds("llama_layer")
    report = (out / "report.md").read_text()
    assert "## What was fused" in report and "attention.gqa: 1" in report
    assert ("measured on the GPU" if torch.cuda.is_available() else "unmeasured (no GPU)") in report
    assert "## End to end" in report and "pass" in report


def test_replayed_advice_reproduces_the_build(builds, tmp_path):
    out, first = builds("mlp")
    again = coopt.build(EXAMPLES / "mlp.py", tmp_path / "again", advice_file=out / "advice.json", top_k=2)
    assert [r.selected for r in again.regions] == [r.selected for r in first.regions]
    for kernel in (out / "kernels").iterdir():
        assert (tmp_path / "again" / "kernels" / kernel.name).read_text() == kernel.read_text()
    advice = json.loads((tmp_path / "again" / "advice.json").read_text())
    assert {e["source"] for e in advice["entries"].values()} == {"replay"}


def test_built_model_loads_without_the_compiler(builds):
    """out/ needs torch + triton only: block xdsl, jinja2 and hypothesis and load it."""
    out, _ = builds("mlp")
    script = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("xdsl", "jinja2", "hypothesis"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import torch, coopt
        model = coopt.load({str(out)!r})
        print(tuple(model(torch.randn(8, 64, device={str(DEVICE)!r})).shape))
        assert not any(m.split(".")[0] in ("xdsl", "jinja2", "hypothesis") for m in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(8, 64)"


def test_built_model_rejects_wrong_inputs(builds):
    out, _ = builds("mlp")
    model = coopt.load(out)
    with pytest.raises(TypeError, match="dtype"):
        model(torch.randn(8, 64, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="shape"):
        model(torch.randn(8, 65, device=DEVICE))


def test_tune_remeasures_and_the_report_follows(builds, tmp_path):
    """`coopt tune` rewrites selection.json and the report renders again from the files.
    (Timed on the CPU here through the tuner's test path; on the GPU `coopt tune` does this.)"""
    import shutil

    from coopt.emit.report import write_report
    from coopt.tune.retune import tune_build_dir

    out, _ = builds("mlp")
    copy = tmp_path / "tuned"
    shutil.copytree(out, copy)
    assert torch.cuda.is_available() or "unmeasured (no GPU)" in (copy / "report.md").read_text()
    summary = tune_build_dir(copy, allow_cpu=True, timeout_s=120, warmup_ms=1, rep_ms=5)
    write_report(copy)
    report = (copy / "report.md").read_text()
    assert "latency: measured on the GPU" in report
    selection = json.loads((copy / "selection.json").read_text())
    assert selection["measured"] is True
    for name, entry in selection["regions"].items():
        assert entry["selected"] == summary[name]["selected"]
        reference = next(c for c in entry["candidates"] if c["label"] == "reference")
        assert reference["latency_ms"] is not None and f"{reference['latency_ms']:.4f} ms" in report
    assert beside_eager(coopt.load(copy))(torch.randn(8, 64)).shape == (8, 64)
