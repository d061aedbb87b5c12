"""The tiny Llama's batched decode step through the default pipeline (fuse-norm-statistics in it): every
RMSNorm whose input is the previous GEMV's output (o or down projection + residual) takes that
GEMV's row statistics (h * g and chunk sums of h^2) instead of normalizing the rows itself; every
region is verified on a GEMV kernel and the built step reproduces eager (a batch of 3, two steps).

Without a GPU the kernels run in Triton's interpreter (about a minute here).
"""

from __future__ import annotations

import pytest

import coopt
from coopt.frontend.model_file import load_model_file
from coopt.passes.registry import DEFAULT_PIPELINE
from llama_helpers import MODEL_PATH, assert_steps_match_eager, llama_env

WITH_STATS = DEFAULT_PIPELINE  # fuse-norm-statistics in it since session 15


@pytest.fixture(scope="module")
def stats_build(tmp_path_factory):
    with llama_env(BATCH=3):  # M = 3 rows: at least min_rows, and the GEMV applies
        loaded = load_model_file(MODEL_PATH)
        out = tmp_path_factory.mktemp("llama_norm_stats") / "out"
        result = coopt.Pipeline(WITH_STATS, top_k=2).build(loaded.model, loaded.example_inputs, out, model_path=loaded.path)
        eager = load_model_file(MODEL_PATH)  # same seeds: the weights and cache history of the build
    return result, out, eager


def test_norms_after_a_gemv_take_its_statistics(stats_build):
    result, _, eager = stats_build
    layers = eager.model.args.n_layers
    counters = result.counters
    # every norm: the MLP norms, the attention norms (layer 0's from the embedding's rows) and
    # the final norm before lm_head
    assert counters["fuse.norm_statistics"] == 2 * layers + 1
    assert "fuse.norm_statistics.skipped.producer" not in counters
    summaries = [r.summary for r in result.regions]
    kinds = [(s.attrs.get("prologue") or {}).get("kind") for s in summaries]
    assert kinds.count("rms_norm_stats") == 2 * layers + 1 and kinds.count("rms_norm") == 0
    assert sum(1 for s in summaries if s.attrs.get("row_squares")) == 2 * layers + 1
    gathers = [r for r in result.regions if r.summary.family == "embedding_rows"]
    assert len(gathers) == 1
    chosen = next(c for c in gathers[0].candidates if c.label == gathers[0].selected)
    assert chosen.verified and chosen.family == "embedding_rows", gathers[0].reason
    assert result.unfused_ops == {}  # the gather is a region's now
    for region in result.regions:
        attrs = region.summary.attrs
        if region.summary.family == "matmul_epilogue" and (attrs.get("row_squares") or attrs.get("prologue") or attrs.get("glu")):
            chosen = next(c for c in region.candidates if c.label == region.selected)
            assert chosen.verified and chosen.params["GEMV"] and not chosen.params.get("NORM_FIRST"), region.summary.name
    assert result.e2e["ok"]


def test_built_step_with_statistics_matches_eager(stats_build):
    _, out, eager = stats_build
    assert_steps_match_eager(coopt.load(out), eager)
