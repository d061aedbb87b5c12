"""The tiny Llama's decode step through fuse-decode-gemv (the default without fuse-norm-statistics:
the in-loop norm form, the default's at batch 1, at 3 rows): both RMSNorms of every layer and the
final one become GEMV prologues, SwiGLU the gate|up GEMV's epilogue, the residual adds the o and
down GEMVs' epilogues; every fused region is verified against its reference and selected, and
the built step reproduces eager (a batch of 3, two steps: the second reads what the first wrote).

Without a GPU the kernels run in Triton's interpreter (about a minute here).
"""

from __future__ import annotations

import pytest

import coopt
from coopt.frontend.model_file import load_model_file
from coopt.passes.registry import ROW_NORMS_PIPELINE
from llama_helpers import MODEL_PATH, assert_steps_match_eager


@pytest.fixture(scope="module")
def decode_build(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("COOPT_LLAMA_BATCH", "3")  # M = 3 rows: the multiply-and-sum GEMV still applies
        loaded = load_model_file(MODEL_PATH)
        out = tmp_path_factory.mktemp("llama_gemv") / "out"
        result = coopt.Pipeline(ROW_NORMS_PIPELINE, top_k=2).build(loaded.model, loaded.example_inputs, out, model_path=loaded.path)
        eager = load_model_file(MODEL_PATH)  # same seeds: the weights and cache history of the build
    return result, out, eager


def test_norms_and_swiglu_fuse_into_the_decode_gemvs(decode_build):
    result, _, eager = decode_build
    layers = eager.model.args.n_layers
    counters = result.counters
    assert counters["fuse.decode_gemv.norm_prologue"] == 2 * layers + 1  # + the final norm before lm_head
    assert counters["fuse.decode_gemv.glu.silu"] == layers
    families = [r.summary.family for r in result.regions]
    assert "row_reduction" not in families and "elementwise" not in families
    # per layer q|k|v (norm), o (+ residual), gate|up (norm + SwiGLU), down (+ residual); lm_head (norm)
    assert families.count("matmul_epilogue") == 4 * layers + 1
    gate_up = [r for r in result.regions if r.summary.attrs.get("glu")]
    assert len(gate_up) == layers and all(r.summary.attrs["prologue"]["kind"] == "rms_norm" for r in gate_up)
    fused = [r for r in result.regions if r.summary.attrs.get("prologue") or r.summary.attrs.get("glu")]
    for region in fused:
        chosen = next(c for c in region.candidates if c.label == region.selected)
        assert chosen.family == "matmul_epilogue" and chosen.verified and chosen.params["GEMV"], region.summary.name
    assert result.e2e["ok"]


def test_built_decode_step_matches_eager(decode_build):
    _, out, eager = decode_build
    assert_steps_match_eager(coopt.load(out), eager)
