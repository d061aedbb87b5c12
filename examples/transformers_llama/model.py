"""transformers' own LlamaForCausalLM decoding one token over its StaticCache: the model as
transformers writes it, through its exportable wrapper
(`transformers.integrations.executorch.TorchExportableModuleWithStaticCache`), as a coopt model
file. Needs `pip install transformers` (5.x; the tests pin 5.18):

    coopt build examples/transformers_llama/model.py -o out/hf-llama

The same environment knobs as examples/llama/model.py, so bench/decode.py can time either file:

    COOPT_LLAMA_PRESET      "tiny" (default; 2 layers of 64) or "llama-3-8b"
    COOPT_LLAMA_LAYERS      number of decoder layers (default: the preset's)
    COOPT_LLAMA_BATCH       sequences per step (default 1)
    COOPT_LLAMA_MAX_SEQ     the StaticCache's length (default 256)
    COOPT_LLAMA_POS         position of the decode step (default max_seq // 2); the cache before it
                            holds seeded random keys / values, standing in for a prefilled prompt
    COOPT_EXAMPLE_DTYPE     float32 (default) or bfloat16
    COOPT_LLAMA_PREFILL     example prompt length of the prefill entry point (default 16; 0 builds
                            the decode step only)

The weights are transformers' own random initialisation (seeded by the loader): nothing is
downloaded. forward(input_ids [B, T], cache_position [T]) -> logits [B, T, vocab]: the decode step
(T = 1) and, as its `prefill` entry point, a prompt.
"""

from __future__ import annotations

import os

import torch

try:
    import transformers
    from transformers.integrations.executorch import (
        TorchExportableModuleWithStaticCache,
    )
except ImportError as error:  # the loader reports it as the model file's error, in one line
    raise ImportError(f"examples/transformers_llama needs transformers (pip install transformers): {error}") from error

PRESETS = {
    "tiny": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
             "intermediate_size": 96, "vocab_size": 128},
    "llama-3-8b": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
                   "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
}


def _settings() -> dict:
    env = os.environ.get
    preset = dict(PRESETS[env("COOPT_LLAMA_PRESET", "tiny")])
    if env("COOPT_LLAMA_LAYERS"):
        preset["num_hidden_layers"] = int(env("COOPT_LLAMA_LAYERS"))
    max_seq = int(env("COOPT_LLAMA_MAX_SEQ", 256))
    return {"config": preset, "batch": int(env("COOPT_LLAMA_BATCH", 1)), "max_seq": max_seq,
            "pos": int(env("COOPT_LLAMA_POS", max_seq // 2)), "dtype": env("COOPT_EXAMPLE_DTYPE", "float32"),
            "prefill": int(env("COOPT_LLAMA_PREFILL", min(16, max_seq)))}


class Model(torch.nn.Module):
    """The exportable wrapper called with positional inputs, its caches' first `decode_pos` slots
    holding seeded random keys / values."""

    def __init__(self, config: dict, batch: int, max_seq: int, dtype: str, decode_pos: int):
        super().__init__()
        config = transformers.LlamaConfig(**config, max_position_embeddings=max(max_seq, 2048),
                                          attn_implementation="sdpa")
        # made where it will be built (the GPU where there is one): StaticCache keeps the device it
        # was made on, a plain attribute that moving the model's tensors does not change
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval().to(device)
        model.generation_config = transformers.GenerationConfig(
            use_cache=True, cache_implementation="static", max_length=max_seq,
            cache_config={"batch_size": batch, "max_cache_len": max_seq, "device": device})
        self.wrapped = TorchExportableModuleWithStaticCache(model)
        generator = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for name, cache in self.wrapped.named_buffers():
                if name.startswith(("key_cache_", "value_cache_")):  # [B, Hkv, S, D]
                    history = cache[:, :, :decode_pos]
                    history.copy_(torch.empty(history.shape).normal_(generator=generator))

    def forward(self, input_ids, cache_position):
        return self.wrapped(input_ids=input_ids, cache_position=cache_position)


def get_init_inputs():
    s = _settings()
    return [s["config"], s["batch"], s["max_seq"], s["dtype"], s["pos"]]


def get_inputs():
    s = _settings()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, s["config"]["vocab_size"], (s["batch"], 1), generator=generator)
    return [tokens, torch.tensor([s["pos"]])]


def entry_points():
    """The prompt as a second entry point of the same artifact (any length 2 .. max_seq at positions
    0 .. T-1, sharing weights and StaticCache with the decode step): generate() prefills a prompt in
    one call, then decodes with the graph-replayed step."""
    s = _settings()
    if s["prefill"] < 2:
        return {}
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, s["config"]["vocab_size"], (s["batch"], s["prefill"]), generator=generator)
    length = torch.export.Dim("prompt_length", min=2, max=s["max_seq"])
    return {"prefill": ([tokens, torch.arange(s["prefill"])], ({1: length}, {0: length}))}
