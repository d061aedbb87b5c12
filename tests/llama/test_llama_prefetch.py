"""The tiny Llama's batched decode step with prefetch-next-weight after the default pipeline: o,
gate|up and down take the weight of the GEMV launched right after them (the last down lm_head's),
q|k|v (followed by the attention) and lm_head (by nothing) do not; every such region is verified
on a GEMV kernel and the built step reproduces eager (without a GPU the prefetch itself is off:
the interpreter runs no PTX; on the GPU its outputs are bit for bit the same, tests/templates/
test_matmul_tail_prefetch.py)."""

from __future__ import annotations

import pytest

import coopt
from coopt.frontend.model_file import load_model_file
from coopt.passes.registry import DEFAULT_PIPELINE
from llama_helpers import MODEL_PATH, assert_steps_match_eager, llama_env


@pytest.fixture(scope="module")
def prefetch_build(tmp_path_factory):
    with llama_env(BATCH=3):
        loaded = load_model_file(MODEL_PATH)
        out = tmp_path_factory.mktemp("llama_prefetch") / "out"
        result = coopt.Pipeline(DEFAULT_PIPELINE + ",prefetch-next-weight", top_k=1).build(
            loaded.model, loaded.example_inputs, out, model_path=loaded.path)
        eager = load_model_file(MODEL_PATH)
    return result, out, eager


def test_each_gemv_a_gemv_follows_takes_its_weight(prefetch_build):
    result, _, eager = prefetch_build
    layers = eager.model.args.n_layers
    assert result.counters["prefetch.next_weight"] == 3 * layers
    assert result.counters["prefetch.next_weight.skipped.next"] == layers + 1  # each q|k|v, lm_head
    gemvs = [r for r in result.regions if r.summary.family == "matmul_epilogue"]
    by_weight = {r.summary.input_names[1]: r for r in gemvs}
    order = [r.summary.name for r in result.regions]
    for region in gemvs:
        prefetch = region.summary.attrs.get("tail_prefetch")
        if prefetch is None:
            continue
        following = by_weight[region.summary.input_names[prefetch["input"]]]
        assert order.index(following.summary.name) == order.index(region.summary.name) + 1
        chosen = next(c for c in region.candidates if c.label == region.selected)
        assert chosen.verified and chosen.params["GEMV"], region.summary.name
    assert result.e2e["ok"]


def test_built_step_with_the_next_weights_matches_eager(prefetch_build):
    _, out, eager = prefetch_build
    assert_steps_match_eager(coopt.load(out), eager)
