"""examples/llama/model.py: the cached forward against the cache-free one, Hugging Face
checkpoints, and what torch.export + coopt's importer make of a decode step."""

from __future__ import annotations

import json

import pytest
import torch

from coopt.frontend.capture import capture
from coopt.frontend.importer import import_program
from coopt.ir.dialect import StateWriteOp
from llama_helpers import write_hf_checkpoint


def tiny(llama, seed=0, **overrides):
    return llama.Transformer(llama.ModelArgs.from_preset("tiny", **overrides), seed=seed).eval()


# ── the cached forward ────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_then_decode_equals_the_cache_free_forward(llama, batch):
    model = tiny(llama)
    model.setup_caches(max_batch_size=2, max_seq_length=32)  # batch 1 uses part of a batch-2 cache
    tokens = torch.randint(0, 256, (batch, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        prefill = model(tokens[:, :9], torch.arange(9))
        decode = [model(tokens[:, i : i + 1], torch.tensor([i])) for i in range(9, 13)]
    torch.testing.assert_close(torch.cat([prefill, *decode], dim=1), full, rtol=1e-5, atol=1e-5)
    assert full.shape == (batch, 13, 256)
    assert full.std() > 0.3, "random weights should give logits of order one"


def test_decode_steps_attend_to_what_earlier_steps_wrote(llama):
    """The cache is state: the same token at the same position gives other logits after a
    different history, and the written slots hold that history's keys."""
    model = tiny(llama)
    model.setup_caches(1, 16)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), torch.arange(3))
        first = model(torch.tensor([[7]]), torch.tensor([3]))
        model(torch.tensor([[4, 5, 6]]), torch.arange(3))
        second = model(torch.tensor([[7]]), torch.tensor([3]))
    assert not torch.allclose(first, second)
    for layer in model.layers:
        assert layer.attention.k_cache[:, :, :4].abs().sum() > 0
        assert layer.attention.k_cache[:, :, 4:].abs().sum() == 0


def test_generate_reference_is_greedy_over_the_cache_free_forward(llama):
    model = tiny(llama)
    model.setup_caches(2, 24)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    tokens, step_logits = llama.generate_reference(model, prompt, 8, return_logits=True)
    assert tokens.shape == (2, 13) and step_logits.shape == (2, 8, 256)
    assert torch.equal(tokens[:, :5], prompt)
    for step in range(8):  # each new token is the argmax of a full forward over what came before
        full = model(tokens[:, : 5 + step])[:, -1]
        torch.testing.assert_close(step_logits[:, step], full, rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens[:, 5 + step], full.argmax(-1))
    with pytest.raises(ValueError, match="does not fit"):
        llama.generate_reference(model, prompt, 20)


def test_rope_scores_depend_only_on_the_relative_position(llama):
    args = llama.ModelArgs.from_preset("tiny")
    cos, sin = llama.rope_tables(args, 64)
    q, k = torch.randn(2, args.head_dim, dtype=torch.float64)
    score = lambda m, n: llama.apply_rope(q, cos[m].double(), sin[m].double()) @ llama.apply_rope(k, cos[n].double(), sin[n].double())
    assert abs(score(10, 3) - score(40, 33)) < 1e-4
    assert abs(score(10, 3) - score(10, 4)) > 1e-3


def test_llama3_rope_scaling_keeps_short_and_slows_long_wavelengths(llama):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    args = llama.ModelArgs.from_preset("llama-3-8b", n_layers=1)
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    scaled = llama._llama3_scaled(inv_freq, scaling)
    wavelength = 2 * torch.pi / inv_freq
    short, long = wavelength < 8192 / 4, wavelength > 8192
    assert torch.equal(scaled[short], inv_freq[short])
    torch.testing.assert_close(scaled[long], inv_freq[long] / 8)
    middle = ~short & ~long
    assert middle.any() and ((scaled[middle] < inv_freq[middle]) & (scaled[middle] > inv_freq[middle] / 8)).all()


# ── configs and checkpoints ───────────────────────────────────────────────────────────────────────


def test_hf_configs_map_to_the_presets(llama):
    llama3 = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu", "rope_scaling": None,
    }
    assert llama.ModelArgs.from_hf_config(llama3) == llama.ModelArgs.from_preset("llama-3-8b")
    qwen2 = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "sliding_window": 131072, "use_sliding_window": False,
    }
    assert llama.ModelArgs.from_hf_config(qwen2) == llama.ModelArgs.from_preset("qwen2-7b")
    mistral_v01 = {**llama3, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096}
    assert llama.ModelArgs.from_hf_config(mistral_v01).sliding_window == 4096
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        llama.ModelArgs.from_hf_config({**llama3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize(
    "case, overrides, architecture, shards",
    [
        ("single file", {}, "LlamaForCausalLM", 1),
        ("sharded with index", {}, "MistralForCausalLM", 3),
        ("tied embeddings", {"tie_word_embeddings": True}, "LlamaForCausalLM", 1),
        ("qwen2 biases", {"attention_bias": True, "norm_eps": 1e-6}, "Qwen2ForCausalLM", 2),
    ],
)
def test_checkpoint_reproduces_the_model_it_was_written_from(llama, tmp_path, case, overrides, architecture, shards):
    source = tiny(llama, seed=7, **overrides)
    if overrides.get("attention_bias"):
        assert source.layers[0].attention.wq.bias is not None
    directory = write_hf_checkpoint(tmp_path / "ckpt", source, architecture, shards)
    assert (directory / "model.safetensors.index.json").is_file() == (shards > 1)
    loaded = tiny(llama, seed=0, **overrides)
    llama.load_hf_checkpoint(loaded, directory)
    for name, tensor in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    for model in (source, loaded):
        model.setup_caches(1, 16)
    tokens = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), source(tokens), rtol=0, atol=0)


def test_load_weights_follows_the_environment(llama, tmp_path, monkeypatch):
    """COOPT_LLAMA_CHECKPOINT gives the config and the weights; COOPT_LLAMA_LAYERS keeps the first
    layers (the benchmark's 8 of 32); COOPT_EXAMPLE_DTYPE converts."""
    source = tiny(llama, seed=5, n_layers=3)
    directory = write_hf_checkpoint(tmp_path / "ckpt", source, shards=2)
    monkeypatch.setenv("COOPT_LLAMA_CHECKPOINT", str(directory))
    monkeypatch.setenv("COOPT_LLAMA_LAYERS", "2")
    monkeypatch.setenv("COOPT_EXAMPLE_DTYPE", "bfloat16")
    model = llama.Model(*llama.get_init_inputs())
    llama.load_weights(model)
    assert model.args.n_layers == 2 and model.output.weight.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, source.state_dict()[name].to(torch.bfloat16)), name


def test_bad_checkpoints_are_refused_clearly(llama, tmp_path):
    directory = write_hf_checkpoint(tmp_path / "ckpt", tiny(llama))
    with pytest.raises(ValueError, match="does not match"):
        llama.load_hf_checkpoint(tiny(llama, hidden_size=32), directory)
    config = json.loads((directory / "config.json").read_text())
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(incomplete / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        llama.load_hf_checkpoint(tiny(llama), incomplete)


# ── capture and import ────────────────────────────────────────────────────────────────────────────


def test_decode_step_exports_cache_writes_as_state_writes(llama):
    model = llama.Model(*llama.get_init_inputs()).eval()
    inputs = tuple(llama.get_inputs())
    assert inputs[0].shape == (1, 1) and inputs[1].shape == (1,)
    program = capture(model, inputs)
    caches = {f"layers.{i}.attention.{kv}_cache" for i in range(2) for kv in "kv"}
    mutated = {spec.target for spec in program.graph_signature.output_specs if spec.kind.name == "BUFFER_MUTATION"}
    assert mutated == caches
    # each new cache value is an index_put at input_pos, and attention reads it
    outputs = program.graph_module.graph.output_node().args[0]
    for node in outputs[: len(caches)]:
        assert str(node.target) == "aten.index_put.default"
        readers = [u for view in node.users for u in [view, *view.users]]
        assert any("scaled_dot_product_attention" in str(u.target) for u in readers)
    imported = import_program(program, inputs)
    writes = [op.ref.data for op in imported.module.walk() if isinstance(op, StateWriteOp)]
    assert sorted(writes) == sorted(caches)
    assert not any(name.endswith("_cache") for name in model.state_dict()), "caches stay out of checkpoints"
