"""Hugging Face-format checkpoint directories for the Llama tests, written with safetensors and
a name table of their own (independent of the model file's); `llama_env`, the model file's
settings for a module-scoped build; `cli_build`, the example built by the CLI;
`assert_steps_match_eager`, a build against its eager model file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from built_calls import DEVICE, beside_eager  # noqa: F401 (DEVICE: the Llama tests import it from here)

MODEL_PATH = Path(__file__).resolve().parents[2] / "examples" / "llama" / "model.py"


@contextmanager
def llama_env(dtype: str | None = None, **settings):
    """The model file's environment for a build outside the function-scoped `clean_env`: the
    caller's COOPT_LLAMA_* and COOPT_EXAMPLE_DTYPE removed, then COOPT_LLAMA_<NAME>=value for
    each setting (and COOPT_EXAMPLE_DTYPE=dtype).

        with llama_env(RAGGED=1, BATCH=2):
            coopt.build(MODEL_PATH, out, paged_kv=16)
    """
    with pytest.MonkeyPatch.context() as env:
        for name in [n for n in os.environ if n.startswith("COOPT_LLAMA_") or n == "COOPT_EXAMPLE_DTYPE"]:
            env.delenv(name)
        for name, value in settings.items():
            env.setenv(f"COOPT_LLAMA_{name}", str(value))
        if dtype is not None:
            env.setenv("COOPT_EXAMPLE_DTYPE", dtype)
        yield


def cli_build(out: Path, *options: str) -> dict:
    """`coopt build` of the example model file (its tiny preset: no COOPT_LLAMA_* or
    COOPT_EXAMPLE_DTYPE of the caller's) into `out` with --top-k 1 --json and `options`; the
    build's JSON summary, after asserting it exited 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COOPT_LLAMA_") and k != "COOPT_EXAMPLE_DTYPE"}
    command = [sys.executable, "-m", "coopt.cli.main", "build", str(MODEL_PATH), "-o", str(out), "--top-k", "1",
               "--json", *options]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


# our state-dict name -> Hugging Face's, written out independently of the model file's table
def hf_name(name: str) -> str:
    parts = name.split(".")
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    layer, module, leaf = parts[1], parts[2], ".".join(parts[3:])
    prefix = f"model.layers.{layer}"
    if module == "attention_norm":
        return f"{prefix}.input_layernorm.{leaf}"
    if module == "ffn_norm":
        return f"{prefix}.post_attention_layernorm.{leaf}"
    if module == "attention":  # wq.weight -> q_proj.weight
        return f"{prefix}.self_attn.{leaf[1]}_proj.{parts[4]}"
    if module == "feed_forward":  # w_gate.weight -> gate_proj.weight
        return f"{prefix}.mlp.{parts[3][2:]}_proj.{parts[4]}"
    raise AssertionError(name)


def hf_config(args, architecture: str = "LlamaForCausalLM") -> dict:
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}[architecture]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.ffn_hidden_size,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "num_hidden_layers": args.n_layers,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        config["attention_bias"] = args.attention_bias
    return config


def write_hf_checkpoint(directory: Path, model, architecture: str = "LlamaForCausalLM", shards: int = 1) -> Path:
    """`model`'s weights as a Hugging Face directory: config.json and one model.safetensors, or
    `shards` files with model.safetensors.index.json. Tied models omit lm_head.weight."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(model.args, architecture)))
    tensors = {hf_name(k): v.clone().contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_word_embeddings:
        del tensors["lm_head.weight"]
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names = sorted(tensors)
    weight_map = {}
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = names[index::shards]
        save_file({n: tensors[n] for n in part}, str(directory / file))
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def assert_steps_match_eager(built, eager, steps: int = 2) -> None:
    """`steps` decode steps of the loaded build against the eager model file it was built from
    (same weights and cache history), each step's tokens derived from the last ones."""
    tokens, input_pos = eager.example_inputs
    with torch.no_grad():
        for step in range(steps):
            position = input_pos + step
            torch.testing.assert_close(beside_eager(built)(tokens, position), eager.model(tokens, position), rtol=1e-4, atol=1e-4)
            tokens = (tokens * 7 + 3) % eager.model.args.vocab_size
