"""A gpt-fast-style Llama-family decoder (Llama 2/3, Mistral, Qwen2): RMSNorm, rotary embeddings,
grouped-query attention over a static KV cache written in place, SwiGLU.

    logits = model(tokens, input_pos)    # tokens [B, T] int64, input_pos [T] int64 -> [B, T, vocab]
    logits = model(tokens, positions)    # ragged decode: tokens [B, 1], positions [B] (B > 1), row b
                                         # at its own position positions[b] -> [B, 1, vocab]

writes the keys and values of positions `input_pos` into every layer's cache buffers
(`k_cache[:, :, input_pos] = k`: torch.export captures it as `aten.index_put` plus a
BUFFER_MUTATION output, which coopt imports as `coopt.state_write`) and attends over the whole
static cache with the mask `cache_position <= input_pos`. One call serves prefill (T prompt
tokens) and decode (T = 1). `model(tokens)` without `input_pos` is the cache-free causal
forward over positions 0..T-1 (a reference for the cached path).

KernelBench entry points (`coopt build examples/llama/model.py`): `Model`, `get_init_inputs()`,
`get_inputs()` (one decode step), `entry_points()` (the prefill), `calibration_inputs()` (a
prompt, for `--kv-cache fp8`) and `load_weights(model)`, configured by the environment:

    COOPT_LLAMA_PRESET      tiny (default) | llama-3-8b | mistral-7b | qwen2-7b
    COOPT_LLAMA_LAYERS      number of layers (the benchmark keeps 8 of Llama-3-8B's 32)
    COOPT_LLAMA_CHECKPOINT  Hugging Face directory (config.json + *.safetensors): its config
                            replaces the preset and load_weights() loads its weights
    COOPT_EXAMPLE_DTYPE     float32 (default) | bfloat16 | float16
    COOPT_LLAMA_BATCH       cache batch = batch of the decode step (default 1)
    COOPT_LLAMA_MAX_SEQ     cache length (default min(max_position_embeddings, 4096))
    COOPT_LLAMA_POS         position of the decode step (default max_seq // 2); the cache before
                            it holds seeded random keys/values, standing in for a prefilled prompt
    COOPT_LLAMA_RAGGED      1: the decode step of get_inputs() is ragged (needs COOPT_LLAMA_BATCH
                            > 1): tokens [B, 1] at positions [B], row b at COOPT_LLAMA_POS - b *
                            (COOPT_LLAMA_POS // B), sequences of different lengths in one batch;
                            built with --paged-kv P it is what coopt.runtime.serve.PagedDecoder
                            serves (add / step / release sequences, docs/kv-cache.md)

Without a checkpoint the weights are random (seeded), scaled so activations and logits stay O(1).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    head_dim: int | None = None  # hidden_size // n_heads when not given
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3.1's {"rope_type": "llama3", ...}; None: plain RoPE
    norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # not modelled: caches longer than the window are refused

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ModelArgs:
        """`ModelArgs.from_preset("llama-3-8b", n_layers=8)`."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset '{name}'; presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelArgs:
        """From a Hugging Face config.json of LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM."""
        architecture = (config.get("architectures") or [""])[0]
        is_qwen2 = config.get("model_type") == "qwen2" or architecture.startswith("Qwen2")
        if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias", False):
            raise ValueError("only SwiGLU MLPs without biases (hidden_act 'silu') are modelled")
        # transformers >= 5 moved rope_theta/rope_scaling into rope_parameters
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type '{rope_type}' is not modelled (only default and llama3)")
        window = config.get("sliding_window") if config.get("use_sliding_window", not is_qwen2) else None
        return cls(
            hidden_size=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"],
            n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            ffn_hidden_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            head_dim=config.get("head_dim"),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=dict(rope) if rope_type == "llama3" else None,
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            attention_bias=is_qwen2 or bool(config.get("attention_bias")),  # Qwen2 always has them
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=window,
        )


_LLAMA3_8B = dict(hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_size=14336)
PRESETS: dict[str, dict] = {
    "llama-3-8b": {**_LLAMA3_8B, "vocab_size": 128256, "rope_theta": 500000.0, "norm_eps": 1e-5, "max_position_embeddings": 8192},
    "mistral-7b": {**_LLAMA3_8B, "vocab_size": 32768, "rope_theta": 1e6, "norm_eps": 1e-5, "max_position_embeddings": 32768},  # v0.3
    "qwen2-7b": dict(hidden_size=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_hidden_size=18944, vocab_size=152064,
                     rope_theta=1e6, norm_eps=1e-6, max_position_embeddings=131072, attention_bias=True),
    "tiny": dict(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_size=160, vocab_size=256, max_position_embeddings=128),
}


# ── model ─────────────────────────────────────────────────────────────────────────────────────────


def rope_tables(args: ModelArgs, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] in fp32, each frequency repeated over both halves.

    Angles are computed in fp32 as the reference implementations (Meta's, Hugging Face's) do, so
    long positions round the way the checkpoints were trained with."""
    dim = args.head_dim
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if args.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, args.rope_scaling)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 long-context RoPE: long wavelengths slowed by `factor`, short ones kept, a
    linear blend (in 1/wavelength) between the two bands."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return blend * inv_freq + (1 - blend) * inv_freq / factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotation of the pairs (i, i + head_dim/2), Hugging Face's convention. Meta's checkpoints
    # rotate adjacent pairs (2i, 2i+1); HF's conversion permuted the q/k projection rows to match
    # rotate_half, so HF-format weights load here as they are, with no permutation.
    return x * cos + rotate_half(x) * sin


def is_ragged_step(tokens: torch.Tensor, input_pos: torch.Tensor | None) -> bool:
    """A ragged decode step: one token per row (tokens [B, 1], B > 1) and one position per row
    (input_pos [B]): row b's token sits at position input_pos[b], so the rows of a batch may be
    sequences of different lengths. With B = 1 the two forms are the same step, and the shared
    form (input_pos [T]) is used."""
    if input_pos is None or input_pos.dim() != 1 or tokens.shape[1] != 1:
        return False
    return tokens.shape[0] > 1 and input_pos.shape[0] == tokens.shape[0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # aten.rms_norm stays whole in the captured graph and reduces in fp32 for 16-bit inputs
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.hidden_size, args.n_heads * args.head_dim, bias=args.attention_bias)
        self.wk = nn.Linear(args.hidden_size, args.n_kv_heads * args.head_dim, bias=args.attention_bias)
        self.wv = nn.Linear(args.hidden_size, args.n_kv_heads * args.head_dim, bias=args.attention_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.hidden_size, bias=False)
        # [max_batch, n_kv_heads, max_seq, head_dim], allocated by Transformer.setup_caches; not
        # in the state dict (checkpoints never hold them)
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, cos, sin, input_pos, mask, per_row: bool = False):
        batch, length, _ = x.shape
        q = self.wq(x).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if input_pos is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif per_row:
            # ragged decode: row b's one token goes to its own position input_pos[b]
            rows = torch.arange(batch, device=x.device)
            self.k_cache[rows, :, input_pos] = k[:, :, 0]
            self.v_cache[rows, :, input_pos] = v[:, :, 0]
            out = F.scaled_dot_product_attention(
                q, self.k_cache[:batch], self.v_cache[:batch], attn_mask=mask, enable_gqa=True
            )
        else:
            # index assignment, not index_copy_: both export as buffer mutations, but index_put
            # is an op coopt's importer knows (index_copy would be a fallback op)
            self.k_cache[:batch, :, input_pos] = k
            self.v_cache[:batch, :, input_pos] = v
            out = F.scaled_dot_product_attention(
                q, self.k_cache[:batch], self.v_cache[:batch], attn_mask=mask, enable_gqa=True
            )
        return self.wo(out.transpose(1, 2).reshape(batch, length, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w_gate = nn.Linear(args.hidden_size, args.ffn_hidden_size, bias=False)
        self.w_up = nn.Linear(args.hidden_size, args.ffn_hidden_size, bias=False)
        self.w_down = nn.Linear(args.ffn_hidden_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x, cos, sin, input_pos, mask, per_row: bool = False):
        x = x + self.attention(self.attention_norm(x), cos, sin, input_pos, mask, per_row)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Embedding, `n_layers` blocks, final norm, output head. Weights random (`seed`) or, with
    `seed=None`, left uninitialised for a checkpoint to fill (`load_hf_checkpoint`).

        model = Transformer(ModelArgs.from_preset("tiny"))
        model.setup_caches(max_batch_size=2, max_seq_length=64)
        logits = model(prompt, torch.arange(prompt.shape[1]))            # prefill
        logits = model(next_token, torch.tensor([prompt.shape[1]]))       # decode
    """

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32, seed: int | None = 0):
        super().__init__()
        self.args = args
        with torch.device("meta"):  # allocate once below instead of initialising twice
            self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
            self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
            self.norm = RMSNorm(args.hidden_size, args.norm_eps)
            self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.to(dtype=dtype).to_empty(device="cpu")
        for name in ("rope_cos", "rope_sin", "cache_positions"):
            self.register_buffer(name, None, persistent=False)
        self.max_batch_size = self.max_seq_length = 0
        if seed is not None:
            self.init_random_weights(seed)

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0) -> None:
        """Seeded normal weights: each linear keeps unit variance (std 1/sqrt(fan_in)), the
        residual-branch outputs are scaled by 1/sqrt(2 n_layers), norm weights are 1 + noise (so
        a dropped norm weight shows in the logits). Drawn in fp32: every dtype rounds the same values."""
        generator = torch.Generator().manual_seed(seed)
        residual_scale = (2 * self.args.n_layers) ** -0.5
        for name, param in self.named_parameters():
            if name == "output.weight" and self.args.tie_word_embeddings:
                continue
            if name.endswith("norm.weight"):
                mean, std = 1.0, 0.1
            elif name.endswith(".bias"):
                mean, std = 0.0, 0.1
            else:  # embedding [vocab, hidden] and linears [out, in]: std 1/sqrt(last dim)
                mean, std = 0.0, param.shape[-1] ** -0.5
                if name.endswith(("wo.weight", "w_down.weight")):
                    std *= residual_scale
            param.copy_(torch.empty(param.shape).normal_(mean, std, generator=generator))
        if self.args.tie_word_embeddings:
            self.output.weight.copy_(self.embed.weight)

    def setup_caches(self, max_batch_size: int, max_seq_length: int, dtype: torch.dtype | None = None) -> None:
        """Zeroed KV caches [max_batch_size, n_kv_heads, max_seq_length, head_dim] per layer and the
        RoPE tables, in `dtype` (default: the weights') on the weights' device."""
        window = self.args.sliding_window
        if window is not None and max_seq_length > window:
            raise ValueError(f"max_seq_length {max_seq_length} exceeds the sliding window {window}, which is not modelled")
        dtype = dtype or self.output.weight.dtype
        device = self.output.weight.device
        shape = (max_batch_size, self.args.n_kv_heads, max_seq_length, self.args.head_dim)
        for layer in self.layers:
            layer.attention.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.attention.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        cos, sin = rope_tables(self.args, max_seq_length)
        self.rope_cos, self.rope_sin = cos.to(device, dtype), sin.to(device, dtype)
        self.cache_positions = torch.arange(max_seq_length, device=device)
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        if self.rope_cos is None:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before running the model")
        batch, length = tokens.shape
        x = self.embed(tokens)
        per_row = is_ragged_step(tokens, input_pos)
        if input_pos is None:  # cache-free causal forward over positions 0..length-1
            cos, sin, mask = self.rope_cos[:length], self.rope_sin[:length], None
        elif per_row:
            # ragged decode: row b at its own position; rope rows [B, 1, 1, D], mask [B, 1, 1, max_seq]
            cos = self.rope_cos[input_pos].view(batch, 1, 1, -1)
            sin = self.rope_sin[input_pos].view(batch, 1, 1, -1)
            mask = (self.cache_positions[None, :] <= input_pos[:, None]).view(batch, 1, 1, -1)
        else:
            cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
            # [length, max_seq]: query i sees cache slot j iff j <= input_pos[i]
            mask = self.cache_positions[None, :] <= input_pos[:, None]
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, mask, per_row)
        return self.output(self.norm(x))


@torch.no_grad()
def generate_reference(model: Transformer, prompt_tokens: torch.Tensor, max_new_tokens: int, *, return_logits: bool = False):
    """Greedy decoding in eager PyTorch: one prefill over the prompt [B, T0], then one decode step
    per new token. Returns the tokens [B, T0 + max_new_tokens] (and, with `return_logits`, the
    logits [B, max_new_tokens, vocab] each new token was chosen from)."""
    batch, prompt_length = prompt_tokens.shape
    if prompt_length + max_new_tokens > model.max_seq_length or batch > model.max_batch_size:
        raise ValueError(f"batch {batch} x {prompt_length}+{max_new_tokens} tokens does not fit the caches "
                         f"({model.max_batch_size} x {model.max_seq_length}); call setup_caches with more")
    device = prompt_tokens.device
    logits = model(prompt_tokens, torch.arange(prompt_length, device=device))[:, -1]
    tokens, step_logits = [prompt_tokens], []
    for step in range(max_new_tokens):
        step_logits.append(logits)
        tokens.append(logits.argmax(dim=-1, keepdim=True))
        if step + 1 < max_new_tokens:
            logits = model(tokens[-1], torch.tensor([prompt_length + step], device=device))[:, -1]
    generated = torch.cat(tokens, dim=1)
    return (generated, torch.stack(step_logits, dim=1)) if return_logits else generated


# ── Hugging Face checkpoints ──────────────────────────────────────────────────────────────────────

_HF_NAMES = [  # Hugging Face parameter name -> ours ({0}, {1}: the groups)
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)", "layers.{0}.attention.w{1}.{2}"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers.{0}.feed_forward.w_{1}.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{0}.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{0}.ffn_norm.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
]
_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq")  # older checkpoints saved their RoPE table


def own_name(hf_name: str) -> str | None:
    """Our state-dict name of a Hugging Face parameter; None for names that hold no weights."""
    for pattern, template in _HF_NAMES:
        if match := re.fullmatch(pattern, hf_name):
            return template.format(*match.groups())
    if _HF_IGNORED.fullmatch(hf_name):
        return None
    raise ValueError(f"unexpected tensor '{hf_name}' in the checkpoint")


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return files


@torch.no_grad()
def load_hf_checkpoint(model: Transformer, directory: str | Path) -> None:
    """Copy a Hugging Face-format checkpoint (config.json + *.safetensors, sharded or not) into
    `model`, converting to the model's dtype. Layers beyond `model.args.n_layers` are skipped."""
    from safetensors import safe_open

    directory = Path(directory)
    config = ModelArgs.from_hf_config(json.loads((directory / "config.json").read_text()))
    # everything that shapes the weights or the numerics must agree; the layer count may be cut
    same = replace(config, n_layers=model.args.n_layers, max_position_embeddings=model.args.max_position_embeddings)
    if same != model.args or model.args.n_layers > config.n_layers:
        raise ValueError(f"checkpoint config {config} does not match the model's {model.args}")
    own = model.state_dict()
    loaded: set[str] = set()
    for file in _safetensors_files(directory):
        with safe_open(str(file), framework="pt") as checkpoint:
            for hf_name in checkpoint.keys():
                name = own_name(hf_name)
                layer = re.match(r"layers\.(\d+)\.", name or "")
                if name is None or (layer and int(layer.group(1)) >= model.args.n_layers):
                    continue
                if name not in own:
                    raise ValueError(f"checkpoint tensor '{hf_name}' has no place in the model ('{name}')")
                tensor = checkpoint.get_tensor(hf_name)
                if tensor.shape != own[name].shape:
                    raise ValueError(f"'{hf_name}' has shape {tuple(tensor.shape)}, the model expects {tuple(own[name].shape)}")
                own[name].copy_(tensor)
                loaded.add(name)
    if config.tie_word_embeddings and "output.weight" not in loaded:
        own["output.weight"].copy_(own["embed.weight"])  # a copy, not shared storage: export sees two plain weights
        loaded.add("output.weight")
    if missing := sorted(set(own) - loaded):
        raise ValueError(f"checkpoint {directory} lacks {len(missing)} tensors, e.g. {missing[:3]}")


# ── KernelBench entry points ──────────────────────────────────────────────────────────────────────


def _settings() -> dict:
    """The build's configuration from the environment (read at call time, so tests can set it)."""
    env = os.environ.get
    checkpoint = env("COOPT_LLAMA_CHECKPOINT")
    if checkpoint:
        args = ModelArgs.from_hf_config(json.loads((Path(checkpoint) / "config.json").read_text()))
    else:
        args = ModelArgs.from_preset(env("COOPT_LLAMA_PRESET", "tiny"))
    if env("COOPT_LLAMA_LAYERS"):
        args = replace(args, n_layers=int(env("COOPT_LLAMA_LAYERS")))
    max_seq = int(env("COOPT_LLAMA_MAX_SEQ", min(args.max_position_embeddings, 4096)))
    return dict(
        args=args,
        batch=int(env("COOPT_LLAMA_BATCH", 1)),
        max_seq=max_seq,
        dtype=env("COOPT_EXAMPLE_DTYPE", "float32"),
        pos=int(env("COOPT_LLAMA_POS", max_seq // 2)),
        checkpoint=checkpoint,
        # example prompt length of the prefill entry point; 0 builds the decode step only
        prefill=int(env("COOPT_LLAMA_PREFILL", min(16, max_seq))),
        ragged=env("COOPT_LLAMA_RAGGED", "0") == "1",
    )


class Model(Transformer):
    """The Transformer with its caches set up, the first `decode_pos` cache slots holding seeded
    random keys/values (a stand-in for a prefilled prompt, so a decode step attends to history)."""

    def __init__(self, args: ModelArgs, max_batch_size: int, max_seq_length: int, dtype: str = "float32",
                 decode_pos: int = 0, seed: int | None = 0):
        super().__init__(args, dtype=getattr(torch, dtype), seed=seed)
        self.setup_caches(max_batch_size, max_seq_length)
        generator = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for layer in self.layers:
                for cache in (layer.attention.k_cache, layer.attention.v_cache):
                    history = cache[:, :, :decode_pos]
                    history.copy_(torch.empty(history.shape).normal_(generator=generator))


def get_init_inputs():
    s = _settings()
    # with a checkpoint the weights are left uninitialised: load_weights() fills them
    return [s["args"], s["batch"], s["max_seq"], s["dtype"], s["pos"], None if s["checkpoint"] else 0]


def get_inputs():
    """One decode step: a token per sequence at position COOPT_LLAMA_POS; with COOPT_LLAMA_RAGGED=1
    each sequence at its own position (`ragged_positions`)."""
    s = _settings()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, s["args"].vocab_size, (s["batch"], 1), generator=generator)
    if s["ragged"]:
        return [tokens, ragged_positions(s["pos"], s["batch"])]
    return [tokens, torch.tensor([s["pos"]])]


def ragged_positions(pos: int, batch: int) -> torch.Tensor:
    """Positions [B] of a ragged decode step's example: pos, then evenly fewer down to about
    pos / B (sequences of different lengths, all within the cache history)."""
    if batch < 2:
        raise ValueError(f"a ragged decode step needs a batch of at least 2 sequences (COOPT_LLAMA_BATCH={batch})")
    return torch.tensor([pos - b * (pos // batch) for b in range(batch)])


def entry_points():
    """The prompt (prefill) as a second entry point of the same artifact: any length 2 ..
    max_seq at positions 0 .. T-1, sharing weights and KV cache with the decode step, so
    `generate()` prefills a prompt in one call and then decodes with the graph-replayed step."""
    s = _settings()
    if s["prefill"] < 2:
        return {}
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, s["args"].vocab_size, (s["batch"], s["prefill"]), generator=generator)
    length = torch.export.Dim("prompt_length", min=2, max=s["max_seq"])
    return {"prefill": ([tokens, torch.arange(s["prefill"])], ({1: length}, {0: length}))}


def calibration_inputs():
    """What an fp8 KV cache's scales are calibrated on (`--kv-cache fp8`): a seeded random prompt
    prefilled at positions 0 .. T-1, writing T rows of every cache (a decode step writes one)."""
    s = _settings()
    length = min(16, s["max_seq"])
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, s["args"].vocab_size, (s["batch"], length), generator=generator)
    return [(tokens, torch.arange(length))]


def load_weights(model: Transformer) -> None:
    """The checkpoint of COOPT_LLAMA_CHECKPOINT if set; otherwise the random weights stay."""
    checkpoint = os.environ.get("COOPT_LLAMA_CHECKPOINT")
    if checkpoint:
        load_hf_checkpoint(model, checkpoint)
