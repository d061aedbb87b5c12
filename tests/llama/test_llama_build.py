"""`coopt build examples/llama/model.py` on the tiny preset (2 layers): the build succeeds through
the CLI, and the loaded build reproduces eager decode steps, cache writes included.

Without a GPU the kernels run in Triton's interpreter; this build takes about 30 s here.
"""

from __future__ import annotations

import json

import pytest
import torch

import coopt
from coopt.emit.state_file import stored_state
from coopt.frontend.model_file import load_model_file
from llama_helpers import DEVICE, MODEL_PATH, cli_build


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    """The CLI build of the tiny preset: the decode step plus its prefill entry point."""
    out = tmp_path_factory.mktemp("llama") / "out"
    build = cli_build(out)
    assert build["end_to_end"]["ok"] and build["entries"]["prefill"]["end_to_end"]["ok"]
    return out


def test_cli_build_of_the_tiny_decode_step_matches_eager(built_dir):
    eager = load_model_file(MODEL_PATH)  # same seeds: the weights and cache history of the build
    eager.model.to(DEVICE)
    built = coopt.load(built_dir)
    tokens, input_pos = (t.to(DEVICE) for t in eager.example_inputs)
    with torch.no_grad():  # two steps: the second attends to the keys the first one wrote
        for step in range(2):
            position = input_pos + step
            torch.testing.assert_close(built(tokens, position), eager.model(tokens, position), rtol=1e-4, atol=1e-4)
            # the kv_write region wrote the new rows into the model's own cache buffers, in place
            for layer in range(eager.model.args.n_layers):
                for name in ("k_cache", "v_cache"):
                    ours = built.state_tensor(f"layers.{layer}.attention.{name}")
                    theirs = getattr(eager.model.layers[layer].attention, name)
                    torch.testing.assert_close(ours[:, :, position], theirs[:, :, position], rtol=1e-5, atol=1e-5)
            tokens = (tokens * 7 + 3) % eager.model.args.vocab_size
    # the whole cache agrees, rows written by neither step included
    torch.testing.assert_close(built.state_tensor("layers.1.attention.k_cache"),
                               eager.model.layers[1].attention.k_cache, rtol=1e-5, atol=1e-5)


def test_each_layer_writes_its_cache_in_one_region_with_k_rope(built_dir):
    """fuse-kv-write: per layer one kv_write region (K's rope absorbed) in both entries; in the
    decode step fuse-kv-write-attention folds each into its layer's decode attention, the
    rotary tables read whole at the position there. Each verified and selected; the positions
    still bound by the cache at call time."""
    for entry in (built_dir, built_dir / "entries" / "prefill"):
        decode_step = entry == built_dir
        counters = json.loads((entry / "build.json").read_text())["counters"]
        assert counters["fuse.kv_write"] == counters["fuse.kv_write.rope"] == 2, counters
        assert counters.get("fuse.kv_write_attention", 0) == counters.get("fuse.kv_write_attention.gathered_tables", 0) \
            == 2 * decode_step
        selection = json.loads((entry / "selection.json").read_text())["regions"]
        writes = [r for r in selection.values() if r["family"] == "kv_write"]
        attentions = [r for r in selection.values() if r["family"] == "decode_attention"]
        if decode_step:
            assert not writes and len(attentions) == 2
            assert all(r["summary"]["attrs"]["kv_write"] == {"positions_input": 6, "rope": True, "rope_tables_input": 4,
                                                               "gathered_tables": True}
                       and r["summary"]["attrs"]["inplace"] == [1, 2] for r in attentions)
        else:
            assert len(writes) == 2 and all(r["summary"]["attrs"] == {"rope": True, "quant": "none", "inplace": [0, 1]}
                                            for r in writes)
        # q's rope: inside the decode attention in the decode step, its own region in the prefill
        assert sum(r["family"] == "rope" for r in selection.values()) == (0 if decode_step else 2)
        assert all(r["summary"]["attrs"].get("rope") is True for r in attentions) \
            and counters.get("fuse.decode_attention.rope", 0) == 2 * decode_step
        chosen = [next(c for c in r["candidates"] if c["label"] == r["selected"]) for r in writes + attentions]
        assert all(c["verified"] and c["family"] in ("kv_write", "decode_attention") for c in chosen)
    built = coopt.load(built_dir)
    with pytest.raises(ValueError, match="outside the KV cache"):
        built.check_call(torch.tensor([[1]]), torch.tensor([128]))


def test_report_lists_the_ops_left_to_pytorch_between_the_kernels(built_dir):
    """What no region took, each a PyTorch launch of its own: the token embedding only (the
    rotary rows are read inside the decode attentions, and the lengths' positions + 1 is added
    there too); views launch nothing and are not listed. build.json keeps the counts, the report
    prints them."""
    build = json.loads((built_dir / "build.json").read_text())
    assert build["unfused_ops"] == {"aten.embedding.default": 1}
    assert build["counters"]["fuse.decode_attention.lengths_add"] == 2  # both layers'
    report = (built_dir / "report.md").read_text()
    assert "Outside every region, 1 op a call runs through PyTorch" in report
    assert "- `aten.embedding.default` ×1" in report and "aten.reshape" not in report.split("## Regions")[0]


def test_prefill_entry_shares_weights_and_cache_with_the_decode_step(built_dir):
    """One artifact, two entry points: the prefill writes the cache the decode step reads, and no
    tensor is stored twice."""
    counters = json.loads((built_dir / "entries" / "prefill" / "build.json").read_text())["counters"]
    assert counters["fuse.attention.prompt_over_cache"] == 2  # each layer's prompt attention is a flash kernel
    main = stored_state(built_dir / "weights.pt")
    extra = stored_state(built_dir / "entries" / "prefill" / "weights.pt")
    assert not set(main) & set(extra)
    built = coopt.load(built_dir)
    prefill = built.entry_points["prefill"]
    cache = "layers.0.attention.k_cache"
    assert prefill.state_tensor(cache) is built.state_tensor(cache)
    built.double()  # moving the model keeps the entry point on the same tensors
    assert prefill.state_tensor(cache) is built.state_tensor(cache) and prefill.state_tensor(cache).dtype == torch.float64
    built.float()

    eager = load_model_file(MODEL_PATH).model.to(DEVICE)
    prompt = torch.randint(0, eager.args.vocab_size, (1, 11), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    positions = torch.arange(11, device=DEVICE)
    with torch.no_grad():  # prompt length 11 differs from the example's 16: the entry is dynamic in T
        torch.testing.assert_close(prefill(prompt, positions), eager(prompt, positions), rtol=1e-4, atol=1e-4)
        # the decode step continues from the cache the prefill wrote
        step = torch.tensor([[7]], device=DEVICE), torch.tensor([11], device=DEVICE)
        torch.testing.assert_close(built(*step), eager(*step), rtol=1e-4, atol=1e-4)


def test_generate_prefills_through_the_entry_point_and_matches_eager_greedy(built_dir, monkeypatch):
    built = coopt.load(built_dir)
    prefill = built.entry_points["prefill"]
    calls = []
    original = type(prefill).forward
    monkeypatch.setattr(type(prefill), "forward", lambda self, *a: calls.append(a[0].shape) or original(self, *a))
    eager = load_model_file(MODEL_PATH).model
    prompt = torch.randint(0, eager.args.vocab_size, (1, 9), generator=torch.Generator().manual_seed(6))
    tokens = coopt.generate(built, prompt, 6)
    assert calls == [torch.Size([1, 9])]  # the whole prompt in one call
    expected = prompt
    with torch.no_grad():
        logits = eager(prompt, torch.arange(9))[:, -1]
        for i in range(6):
            next_token = logits.argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], 1)
            logits = eager(next_token, torch.tensor([9 + i]))[:, -1]
    assert tokens.tolist() == expected.tolist()


def test_decode_attention_plans_for_the_example_cache_length(built_dir):
    """The advisor and the timing see the example call's valid length (position + 1), not the
    whole cache: a decode step at position 64 of a 128-slot cache reads 65 positions."""
    _, input_pos = load_model_file(MODEL_PATH).example_inputs
    selection = json.loads((built_dir / "selection.json").read_text())["regions"]
    decode = [r for r in selection.values() if r["family"] == "decode_attention"]
    assert decode and {r["summary"]["attrs"]["example_length"] for r in decode} == {int(input_pos[0]) + 1}
