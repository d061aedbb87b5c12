"""The model against Hugging Face's own implementations, where `transformers` is installed (it is not
a coopt dependency; the test skips without it): a tiny random LlamaForCausalLM / Qwen2ForCausalLM
saved with save_pretrained loads into our model and gives the same logits. This is the check
that our RoPE convention (rotate_half, no q/k permutation) and name mapping are HF's."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
TINY = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5)


@pytest.mark.parametrize(
    "config_class, extra",
    [
        ("LlamaConfig", {"rope_theta": 500000.0}),
        ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": {**LLAMA3_SCALING, "rope_theta": 500000.0}}),
        ("LlamaConfig", {"tie_word_embeddings": True}),
        ("MistralConfig", {"rope_theta": 1e6, "sliding_window": None}),
        ("Qwen2Config", {"rope_theta": 1e6, "rms_norm_eps": 1e-6}),
    ],
)
def test_logits_match_hugging_face(llama, tmp_path, config_class, extra):
    config = getattr(transformers, config_class)(**{**TINY, **extra})
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # HF initialises norms to one and biases to zero: make them matter
        for name, param in reference.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    reference.save_pretrained(tmp_path)
    args = llama.ModelArgs.from_hf_config(config.to_dict())
    model = llama.Transformer(args, seed=None).eval()
    llama.load_hf_checkpoint(model, tmp_path)
    model.setup_caches(2, 64)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        torch.testing.assert_close(model(tokens), expected, rtol=1e-4, atol=1e-4)
        prefill = model(tokens[:, :30], torch.arange(30))
        decode = [model(tokens[:, i : i + 1], torch.tensor([i])) for i in range(30, 40)]
        torch.testing.assert_close(torch.cat([prefill, *decode], dim=1), expected, rtol=1e-4, atol=1e-4)
