"""`coopt build --paged-kv P`: a bad page size or a model without a KV cache is a one-line
configuration error (exit 5); `coopt passes` lists paged-kv with its knobs."""

import json

from typer.testing import CliRunner

from coopt.cli.main import app


def build(path, *options):
    return CliRunner().invoke(app, ["build", str(path), "-o", str(path.parent / "out"), "-q", *options])


def test_a_page_size_outside_the_choices_exits_5(tmp_path, plain_model_file):
    result = build(plain_model_file, "--paged-kv", "24")
    assert result.exit_code == 5, result.output
    (line,) = [l for l in result.output.splitlines() if l.strip()]
    assert line == "coopt: error: paged-kv: knob page-size=24 must be one of 16, 32, 64, 128, 256"
    assert not (tmp_path / "out").exists()


def test_paged_kv_on_a_model_without_a_cache_exits_5(tmp_path, plain_model_file):
    result = build(plain_model_file, "--paged-kv", "16")
    assert result.exit_code == 5, result.output
    (line,) = [l for l in result.output.splitlines() if l.strip()]
    assert line.startswith("coopt: error: paged-kv: the model has no KV cache to page")


def test_a_bad_knob_in_the_pipeline_string_exits_5(plain_model_file):
    result = build(plain_model_file, "-p", "raise-patterns,paged-kv{num-pages=-3}")
    assert result.exit_code == 5 and "paged-kv: knob num-pages=-3 must be an int >= 1" in result.output


def test_passes_lists_paged_kv_outside_the_default_pipeline():
    result = CliRunner().invoke(app, ["passes", "--json"])
    listing = json.loads(result.output)
    knobs = {k["name"]: k["default"] for k in listing["passes"]["paged-kv"]["knobs"]}
    assert knobs == {"page-size": "16", "num-pages": "0", "max-sequences": "0"} and not listing["passes"]["paged-kv"]["lossy"]
    assert "paged-kv" not in listing["default_pipeline"]


def test_a_pool_too_small_for_the_example_call_exits_5_before_verification(tmp_path, monkeypatch):
    from pathlib import Path

    model = Path(__file__).resolve().parents[2] / "examples" / "llama" / "model.py"
    for name, value in {"RAGGED": 1, "BATCH": 3, "MAX_SEQ": 64, "POS": 40, "PREFILL": 0}.items():
        monkeypatch.setenv(f"COOPT_LLAMA_{name}", str(value))
    result = CliRunner().invoke(app, ["build", str(model), "-o", str(tmp_path / "out"), "-q", "-p",
                                      "inplace-state-writes,raise-patterns,paged-kv{page-size=32 num-pages=5}"])
    assert result.exit_code == 5, result.output
    assert "paged-kv: num-pages=5 is too few to check the build against the original" in result.output
    assert not (tmp_path / "out").exists()
