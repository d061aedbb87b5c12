"""Ragged decode on the tiny Llama: one token per sequence, each sequence at its own position
(tokens [B, 1], positions [B]). Eager: the ragged step equals each row decoded alone. Built
(COOPT_LLAMA_RAGGED=1, Triton's interpreter): the per-row mask is raised to decode_attention
with per-row lengths, the per-row cache writes (with K's rope) become one kv_write region per
layer, and decoding a batch at different positions matches eager row by row, caches included.
"""

from __future__ import annotations

import json

import pytest
import torch

import coopt
from coopt.frontend.model_file import load_model_file
from llama_helpers import DEVICE, MODEL_PATH

BATCH, MAX_SEQ, POS = 3, 64, 40


def tiny(llama, batch=BATCH, max_seq=MAX_SEQ):
    model = llama.Transformer(llama.ModelArgs.from_preset("tiny"), seed=0).eval()
    model.setup_caches(batch, max_seq)
    return model


def test_a_ragged_step_equals_each_row_decoded_alone(llama):
    batched, alone = tiny(llama), tiny(llama, batch=1)
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 2, 12)]
    with torch.no_grad():
        for b, prompt in enumerate(prompts):  # each row's history, prefilled into its own cache row
            model = tiny(llama, batch=1)
            model(prompt, torch.arange(prompt.shape[1]))
            for layer, source in zip(batched.layers, model.layers):
                layer.attention.k_cache[b] = source.attention.k_cache[0]
                layer.attention.v_cache[b] = source.attention.v_cache[0]
        tokens = torch.tensor([[5], [9], [200]])
        positions = torch.tensor([p.shape[1] for p in prompts])
        assert llama.is_ragged_step(tokens, positions)
        ragged = batched(tokens, positions)
        for b, prompt in enumerate(prompts):
            alone = tiny(llama, batch=1)
            alone(prompt, torch.arange(prompt.shape[1]))
            expected = alone(tokens[b:b + 1], positions[b:b + 1])
            torch.testing.assert_close(ragged[b:b + 1], expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(batched.layers[1].attention.k_cache[b], alone.layers[1].attention.k_cache[0])


def test_one_row_or_shared_positions_keep_the_shared_form(llama):
    assert not llama.is_ragged_step(torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]))
    assert not llama.is_ragged_step(torch.zeros(3, 1, dtype=torch.long), torch.tensor([3]))
    assert not llama.is_ragged_step(torch.zeros(3, 3, dtype=torch.long), torch.tensor([0, 1, 2]))
    assert llama.ragged_positions(40, 3).tolist() == [40, 27, 14]


# ── the build ─────────────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ragged") / "out"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("COOPT_LLAMA_RAGGED", "1")
        env.setenv("COOPT_LLAMA_BATCH", str(BATCH))
        env.setenv("COOPT_LLAMA_MAX_SEQ", str(MAX_SEQ))
        env.setenv("COOPT_LLAMA_POS", str(POS))
        env.setenv("COOPT_LLAMA_PREFILL", "0")
        result = coopt.build(MODEL_PATH, out, top_k=1)
        eager = load_model_file(MODEL_PATH)
    assert result.e2e["ok"], result.e2e
    return out, eager


def test_the_build_raises_and_fuses_the_per_row_step(built_dir):
    out, _ = built_dir
    build = json.loads((out / "build.json").read_text())
    counters = build["counters"]
    assert counters["raise.attention.decode.per_row"] == 2 and counters["fuse.decode_attention"] == 2
    assert counters["fuse.kv_write"] == counters["fuse.kv_write.per_row"] == counters["fuse.kv_write.rope"] == 2
    selection = json.loads((out / "selection.json").read_text())["regions"]
    writes = [r for r in selection.values() if r["family"] == "kv_write"]
    assert all(r["summary"]["attrs"]["positions"] == "per-row" for r in writes)
    chosen = [next(c for c in r["candidates"] if c["label"] == r["selected"]) for r in writes]
    assert all(c["verified"] and c["family"] == "kv_write" for c in chosen)


def test_decoding_rows_at_different_positions_matches_eager(built_dir):
    out, loaded = built_dir
    built, eager = coopt.load(out), loaded.model.to(DEVICE)
    tokens, positions = (x.to(DEVICE) for x in loaded.example_inputs)
    assert positions.tolist() == [40, 27, 14]
    with torch.no_grad():
        for step in range(3):  # each step attends to the rows the steps before it wrote
            torch.testing.assert_close(built(tokens, positions), eager(tokens, positions), rtol=1e-4, atol=1e-4)
            for layer in range(eager.args.n_layers):
                for name in ("k_cache", "v_cache"):
                    torch.testing.assert_close(built.state_tensor(f"layers.{layer}.attention.{name}"),
                                               getattr(eager.layers[layer].attention, name), rtol=1e-5, atol=1e-5)
            tokens = (tokens * 7 + 3) % 256
            positions = positions + torch.tensor([1, 2, 1], device=DEVICE)  # rows advance on their own
    with pytest.raises(ValueError, match=r"holds 64, outside \[0, 64\): it indexes dim 2 .*k_cache"):
        built.check_call(tokens, torch.tensor([0, MAX_SEQ, 3], device=DEVICE))  # one row past the cache
