"""transformers' own Llama-family models (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM:
tiny random configs, nothing downloaded) decoding one token over their StaticCache through
transformers' exportable wrapper, built by coopt. Strict capture (the wrapper keeps its cache
tensors on plain objects too); the cache writes (index_copy_), the 5.x boolean mask (with
Mistral's sliding window where it covers the cache) and the per-layer position bookkeeping
recognised, so each layer builds as the project's own Llama: a norm-prologue q|k|v GEMV (Qwen2's
biases concatenated with it), one decode attention with the rotary and the rows' write folded in,
the MLP GEMVs. The built steps follow transformers' own logits step after step, and the runtime's
generate() reproduces its greedy tokens."""

from __future__ import annotations

import pytest
import torch
from built_calls import beside_eager

import coopt

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

LAYERS, MAX_CACHE = 2, 32
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # q, k, v with biases
    "mistral": ("MistralConfig", "MistralForCausalLM"),  # a sliding window (default 4096) in its mask
    # RMSNorm (normed * (1 + w)).type_as(x), GeGLU (gelu tanh), the embedding scaled by sqrt(hidden)
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
}
FAMILY_CONFIG = {"gemma": {"head_dim": 16}}  # (Gemma's default is 256 whatever the hidden size)
# where builds run: transformers' StaticCache keeps the device it was made on (a plain attribute
# its arange uses), so a model to build on the GPU is made there (session 43: made on the CPU and
# moved, its capture met CPU and GPU tensors in one add)
BUILD_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class DecodeStep(torch.nn.Module):
    """The wrapper called with positional inputs (the build's example inputs are a tuple)."""

    def __init__(self, family: str, seed: int = 0, device: str = "cpu", **config):
        super().__init__()
        torch.manual_seed(seed)
        config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
        config = config_class(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=LAYERS,
                              intermediate_size=96, vocab_size=128, max_position_embeddings=64,
                              attn_implementation="sdpa", **{**FAMILY_CONFIG.get(family, {}), **config})
        model = model_class(config).eval().to(device)
        model.generation_config = transformers.GenerationConfig(
            use_cache=True, cache_implementation="static", max_length=MAX_CACHE,
            cache_config={"batch_size": 1, "max_cache_len": MAX_CACHE, "device": device})
        self.wrapped = TorchExportableModuleWithStaticCache(model)

    def forward(self, input_ids, cache_position):
        return self.wrapped(input_ids=input_ids, cache_position=cache_position)


def build_and_follow(tmp_path, family: str, steps: int = 8, **config):
    """Build the family's step, then run it beside transformers' own from empty caches, teacher-
    forced by transformers' greedy tokens; returns (the build's result, the loaded build)."""
    result = coopt.Pipeline(top_k=1).build(DecodeStep(family, device=BUILD_DEVICE, **config),
                                           (torch.tensor([[5]]), torch.tensor([3])),
                                           tmp_path / "out")
    assert result.e2e["ok"] and any("strict torch.export" in w for w in result.warnings)
    built, eager = coopt.load(tmp_path / "out"), DecodeStep(family, **config)
    for name, buffer in built.named_buffers():
        if "cache" in name:  # the build's own checks wrote rows: start both from empty caches
            buffer.zero_()
    token, call = torch.tensor([[5]]), beside_eager(built)
    with torch.no_grad():
        for pos in range(steps):
            expected = eager(token, torch.tensor([pos]))
            torch.testing.assert_close(call(token, torch.tensor([pos])), expected, rtol=1e-4, atol=1e-4)
            token = expected[:, -1:].argmax(-1)
    return result, built


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_transformers_decode_step_builds_as_the_projects_own_llama(tmp_path, family):
    result, built = build_and_follow(tmp_path, family)
    counters = result.counters
    assert counters["raise.attention.decode"] == LAYERS and counters["fuse.kv_write_attention"] == LAYERS
    assert counters["fuse.decode_attention.rope"] == LAYERS and counters["inplace.index_copy"] == 2 * LAYERS
    # q|k|v and gate|up of every layer, each one GEMV taking its norm; the head takes the final
    # norm (its alias(norm(h)) folded by cse-aten)
    assert counters["fuse.parallel_linears"] == 2 * LAYERS and counters["fuse.decode_gemv.norm_prologue"] == 2 * LAYERS + 1
    assert counters["cse.aten.alias_folded"] == 1
    assert counters.get("fuse.parallel_linears.with_bias", 0) == (LAYERS if family == "qwen2" else 0)
    families = [r.summary.family for r in result.regions]
    assert families.count("decode_attention") == LAYERS and not {"attention", "kv_write"} & set(families)
    assert "row_reduction" not in families
    # the rotary tables one elementwise kernel (cos and sin of positions * cat(inv_freq, inv_freq),
    # that weight computed at build time: simplify-aten, fold-constants); Gemma's norms' (1 + w)
    # folded too, their type_as a cast, each norm one rms_norm of its input (a GEMV prologue
    # above), and its embedding's scaling one more elementwise kernel
    gemma = family == "gemma"
    assert counters["simplify.outer_product"] == 1 and counters["simplify.cat_of_repeats"] == 1
    assert counters["fold.constants"] == 1 + gemma * (2 * LAYERS + 1)
    assert counters.get("simplify.type_as", 0) == gemma * (2 * LAYERS + 1)
    assert counters.get("fuse.decode_gemv.glu.gelu_tanh", 0) == gemma * LAYERS
    assert families.count("elementwise") == 1 + gemma
    # between the kernels, a step: the embedding, the position arithmetic once for all layers
    # (the lengths' + 1 is the attention kernels' own: fuse-attention's lengths_add), and each
    # layer's cumulative_length write (one torch._foreach_copy_ in program.py)
    assert counters["fuse.decode_attention.lengths_add"] == LAYERS
    assert result.unfused_ops == {"aten.embedding.default": 1, "aten.arange.default": 1, "aten.add.Tensor": 2,
                                  "coopt.state_write": LAYERS}
    assert not result.fallback_ops
    # the runtime's generate() drives it as a decoder (greedy): transformers' tokens, one call a token
    prompt, eager = torch.tensor([[5, 17, 3]]), DecodeStep(family)
    with torch.no_grad():
        for pos in range(prompt.shape[1]):
            logits = eager(prompt[:, pos:pos + 1], torch.tensor([pos]))
        expected = [prompt]
        for pos in range(prompt.shape[1], prompt.shape[1] + 6):
            expected.append(logits[:, -1:].argmax(-1))
            logits = eager(expected[-1], torch.tensor([pos]))
    assert torch.equal(built.generate(prompt, max_new_tokens=6).cpu(), torch.cat(expected, dim=1))
    # a position outside the cache is refused at call time (the write's positions are computed
    # as arange(1) + cache_position[0]: still the input's value)
    for outside in (MAX_CACHE, -1):
        with pytest.raises(ValueError, match=rf"cache_position: holds {outside}, outside \[0, {MAX_CACHE}\)"):
            beside_eager(built)(torch.tensor([[5]]), torch.tensor([outside]))


def test_a_sliding_window_shorter_than_the_cache_stays_sdpa(tmp_path):
    """Mistral with a window of 8 over a 32-position cache: a decode attention over the first
    position + 1 keys would see keys the window hides, so the attention is left to SDPA; 20
    steps take the position past the window."""
    result, _ = build_and_follow(tmp_path, "mistral", steps=20, sliding_window=8)
    assert "raise.attention.decode" not in result.counters
    assert result.unfused_ops["aten.scaled_dot_product_attention.default"] == LAYERS


def test_a_transformers_prompt_chunk_attends_over_the_cache(tmp_path):
    """Four tokens a call (a prompt in chunks): the mask's four query positions become one
    attention over the cache with a length per position; two chunks match transformers'."""
    prompt = torch.tensor([[5, 17, 3, 99, 42, 7, 64, 1]])
    result = coopt.Pipeline(top_k=1).build(DecodeStep("llama", device=BUILD_DEVICE), (prompt[:, :4], torch.arange(4)),
                                           tmp_path / "out")
    assert result.counters["raise.attention.prompt_over_cache"] == LAYERS and result.e2e["ok"]
    assert "aten.scaled_dot_product_attention.default" not in result.unfused_ops
    built, eager = coopt.load(tmp_path / "out"), DecodeStep("llama")
    for name, buffer in built.named_buffers():
        if "cache" in name:
            buffer.zero_()
    with torch.no_grad():
        for start in (0, 4):  # the second chunk reads the rows the first wrote
            chunk, positions = prompt[:, start:start + 4], torch.arange(start, start + 4)
            torch.testing.assert_close(beside_eager(built)(chunk, positions), eager(chunk, positions), rtol=1e-4, atol=1e-4)


def test_the_example_model_file_builds(tmp_path, monkeypatch):
    """examples/transformers_llama/model.py as `coopt build` takes it (tiny preset, a decode step at
    position 128 of a 256-position cache holding random history, and a prefill entry point)."""
    import os
    from pathlib import Path

    for knob in [k for k in os.environ if k.startswith("COOPT_LLAMA_") or k == "COOPT_EXAMPLE_DTYPE"]:
        monkeypatch.delenv(knob)  # the file's defaults, whatever an earlier test set

    example = Path(__file__).resolve().parents[2] / "examples" / "transformers_llama" / "model.py"
    result = coopt.build(example, tmp_path / "out")
    assert result.e2e["ok"] and result.counters["raise.attention.decode"] == LAYERS
    assert [r.summary.family for r in result.regions].count("decode_attention") == LAYERS
    # its prefill entry point: the prompt's attention over the cache, every length 2 .. 256 in one artifact
    (prefill,) = result.entries.values()
    assert prefill.counters["raise.attention.prompt_over_cache"] == LAYERS and prefill.e2e["ok"]
    # generate() prefills through it, then decodes: transformers' greedy tokens, one call a token
    from coopt.frontend.model_file import load_model_file

    eager, prompt = load_model_file(example).model, torch.tensor([[5, 17, 3, 99]])
    eager = beside_eager(eager)  # (made on the GPU where there is one, as the build's model)
    with torch.no_grad():
        logits = eager(prompt, torch.arange(prompt.shape[1]))
        expected = [prompt]
        for pos in range(prompt.shape[1], prompt.shape[1] + 6):
            expected.append(logits[:, -1:].argmax(-1))
            logits = eager(expected[-1], torch.tensor([pos]))
    assert torch.equal(coopt.load(tmp_path / "out").generate(prompt, max_new_tokens=6).cpu(), torch.cat(expected, dim=1))
