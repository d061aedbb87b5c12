"""transformers' own LlamaForCausalLM (a tiny random config, no download) decoding one token over
its StaticCache through transformers' exportable wrapper, built by coopt: strict capture (the
wrapper keeps its cache tensors on plain objects too), the cache writes (index_copy_) and the 5.x
boolean mask recognised, so each layer is a norm-prologue q|k|v GEMV, one decode attention with
the rotary and the rows' write folded in, and the MLP GEMVs; the built steps follow transformers'
own logits step after step."""

from __future__ import annotations

import pytest
import torch

import coopt

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

LAYERS, MAX_CACHE = 2, 32


class DecodeStep(torch.nn.Module):
    """The wrapper called with positional inputs (the build's example inputs are a tuple)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                          num_hidden_layers=LAYERS, intermediate_size=96, vocab_size=128,
                                          max_position_embeddings=64, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(config).eval()
        model.generation_config = transformers.GenerationConfig(
            use_cache=True, cache_implementation="static", max_length=MAX_CACHE,
            cache_config={"batch_size": 1, "max_cache_len": MAX_CACHE, "device": "cpu"})
        self.wrapped = TorchExportableModuleWithStaticCache(model)

    def forward(self, input_ids, cache_position):
        return self.wrapped(input_ids=input_ids, cache_position=cache_position)


def test_a_transformers_llama_decode_step_builds_as_the_projects_own(tmp_path):
    result = coopt.Pipeline(top_k=1).build(DecodeStep(), (torch.tensor([[5]]), torch.tensor([3])), tmp_path / "out")
    counters = result.counters
    assert counters["raise.attention.decode"] == LAYERS and counters["fuse.kv_write_attention"] == LAYERS
    assert counters["fuse.decode_attention.rope"] == LAYERS and counters["inplace.index_copy"] == 2 * LAYERS
    assert counters["fuse.decode_gemv.norm_prologue"] == 2 * LAYERS
    families = [r.summary.family for r in result.regions]
    assert families.count("decode_attention") == LAYERS and not {"attention", "kv_write"} & set(families)
    assert "aten.scaled_dot_product_attention.default" not in result.unfused_ops
    assert any("strict torch.export" in w for w in result.warnings) and result.e2e["ok"]

    built, eager = coopt.load(tmp_path / "out"), DecodeStep()
    for name, buffer in built.named_buffers():
        if "cache" in name:  # the build's own checks wrote rows: start both from empty caches
            buffer.zero_()
    token = torch.tensor([[5]])
    with torch.no_grad():
        for pos in range(8):  # teacher-forced by transformers' greedy tokens
            expected = eager(token, torch.tensor([pos]))
            torch.testing.assert_close(built(token, torch.tensor([pos])), expected, rtol=1e-4, atol=1e-4)
            token = expected[:, -1:].argmax(-1)
    # a position outside the cache is refused at call time (transformers computes the write's
    # positions as arange(1) + cache_position[0]: still the input's value)
    for outside in (MAX_CACHE, -1):
        with pytest.raises(ValueError, match=rf"cache_position: holds {outside}, outside \[0, {MAX_CACHE}\)"):
            built(token, torch.tensor([outside]))
