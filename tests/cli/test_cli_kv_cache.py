"""`coopt build --kv-cache`: fp8 on a model without a KV cache is a one-line configuration error
(exit 5) naming the problem, never a silent no-op; an unknown choice is one too."""

from typer.testing import CliRunner

from coopt.cli.main import app




def build(path, *options):
    return CliRunner().invoke(app, ["build", str(path), "-o", str(path.parent / "out"), "-q", *options])


def test_fp8_kv_cache_on_a_model_without_a_cache_exits_5(tmp_path, plain_model_file):
    result = build(plain_model_file, "--kv-cache", "fp8")
    assert result.exit_code == 5, result.output
    (line,) = [l for l in result.output.splitlines() if l.strip()]
    assert line.startswith("coopt: error: fp8-kv-cache: the model has no KV cache")
    assert not (tmp_path / "out").exists()


def test_unknown_kv_cache_choice_exits_5(plain_model_file):
    result = build(plain_model_file, "--kv-cache", "int4")
    assert result.exit_code == 5 and "unknown --kv-cache 'int4'" in result.output
