"""Chunked prefill on the tiny Llama: a build with `prefill_chunk=16` (`--prefill-chunk 16`)
whose prefill entry point takes at most 16 tokens per call. A 40-token prompt prefilled chunk by
chunk through it writes the same KV cache and gives the same logits as eager's one-shot prefill
of the whole prompt, and generate() equals eager greedy decoding.

One build per module (about 25 s in Triton's interpreter): the example prompt (32 tokens) is
longer than the chunk, so the build checks its program on the example's first chunk.
"""

from __future__ import annotations

import os

import pytest
import torch

import coopt
from coopt.frontend.model_file import load_model_file
from llama_helpers import DEVICE, MODEL_PATH

CHUNK, PROMPT, NEW_TOKENS = 16, 40, 8
PLAIN = {"cuda_graphs": False}


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("chunked") / "out"
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in [n for n in os.environ if n.startswith("COOPT_LLAMA_") or n == "COOPT_EXAMPLE_DTYPE"]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("COOPT_LLAMA_PREFILL", "32")
        result = coopt.build(MODEL_PATH, out, top_k=1, prefill_chunk=CHUNK)
    assert result.e2e["ok"] and result.entries["prefill"].e2e["ok"]
    # the decode step (T = 1) is left alone; the prefill entry runs the pass
    assert result.prefill_chunk is None and result.entries["prefill"].prefill_chunk == CHUNK
    assert result.entries["prefill"].counters["chunked_prefill.narrowed"] == 1
    return out


def fresh(built_dir):
    """The build and the eager model (same seeds: same weights and cache history), both fresh."""
    eager = load_model_file(MODEL_PATH).model.to(DEVICE)
    return coopt.load(built_dir), eager


def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(7)).to(DEVICE)


def eager_greedy(eager, tokens: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        logits = eager(tokens, torch.arange(tokens.shape[1], device=DEVICE))[:, -1]
        out = [tokens]
        for i in range(new_tokens):
            out.append(logits.argmax(-1, keepdim=True))
            if i + 1 < new_tokens:
                logits = eager(out[-1], torch.tensor([tokens.shape[1] + i], device=DEVICE))[:, -1]
    return torch.cat(out, dim=1)


def test_the_prefill_entry_carries_the_chunk(built_dir):
    built, _ = fresh(built_dir)
    entry = built.entry_points["prefill"]
    assert entry.decoder["length"] == [2, CHUNK] and entry.decoder["prefill_chunk"] == CHUNK
    assert "prefill_chunk" not in built.decoder  # the decode step has no prompt length to chunk


def test_chunked_prefill_matches_eager_one_shot_prefill(built_dir):
    built, eager = fresh(built_dir)
    entry, tokens = built.entry_points["prefill"], prompt()
    with torch.no_grad():
        expected = eager(tokens, torch.arange(PROMPT, device=DEVICE))
        pieces = []
        for start in range(0, PROMPT, CHUNK):  # 16 + 16 + 8: each chunk attends to the cache written before it
            end = min(start + CHUNK, PROMPT)
            pieces.append(entry(tokens[:, start:end], torch.arange(start, end, device=DEVICE)))
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pieces[-1][:, -1], expected[:, -1], rtol=1e-4, atol=1e-4)  # the next-token logits
    for layer in range(eager.args.n_layers):
        for name in ("k_cache", "v_cache"):
            ours = built.state_tensor(f"layers.{layer}.attention.{name}")
            theirs = getattr(eager.layers[layer].attention, name)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # written rows and untouched history


class EntryCalls:
    def __init__(self, entry):
        self.lengths = []
        self.handle = entry.register_forward_pre_hook(lambda _, args: self.lengths.append(args[0].shape[1]))


def test_generate_prefills_in_chunks_and_equals_eager_greedy(built_dir):
    built, eager = fresh(built_dir)
    expected = eager_greedy(eager, prompt(), NEW_TOKENS)
    calls = EntryCalls(built.entry_points["prefill"])
    assert torch.equal(coopt.generate(built, prompt(), NEW_TOKENS, **PLAIN), expected)
    assert calls.lengths == [16, 16, 8]
    calls.lengths.clear()  # a smaller chunk than the build's; a larger one is capped by it
    assert torch.equal(built.generate(prompt(), NEW_TOKENS, prefill_chunk=8, **PLAIN), expected)
    assert calls.lengths == [8] * 5
    calls.lengths.clear()
    assert torch.equal(coopt.generate(built, prompt(), NEW_TOKENS, prefill_chunk=1024, **PLAIN), expected)
    assert calls.lengths == [16, 16, 8]
    with pytest.raises(ValueError, match="prefill_chunk must be None or an int >= 1"):
        coopt.generate(built, prompt(), NEW_TOKENS, prefill_chunk=0)


def test_the_prefill_entry_refuses_a_call_longer_than_the_chunk(built_dir):
    built, _ = fresh(built_dir)
    entry = built.entry_points["prefill"]
    before = built.state_tensor("layers.0.attention.k_cache").clone()
    tokens = prompt()[:, :CHUNK + 1]
    with pytest.raises(ValueError, match=r"dim 1 has size 17, outside \[2, 16\]"):
        entry(tokens, torch.arange(CHUNK + 1, device=DEVICE))
    assert torch.equal(built.state_tensor("layers.0.attention.k_cache"), before)  # refused before any write
