"""bench/fp8_kv_probe.py: its fake quantizer, its attention hook and the premise of smoothing K."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fp8_kv_probe as probe


def test_fake_fp8_keeps_e4m3_values_and_saturates_beyond_the_scale():
    scale = torch.tensor([[0.5], [2.0]])  # [Hkv, 1]
    exact = torch.tensor([1.0, -3.0, 0.5 * 448, 0.0])  # multiples of representable e4m3 values
    x = torch.stack([exact * 0.5, exact * 2.0])[None, :, None, :]  # [1, Hkv, 1, 4]
    torch.testing.assert_close(probe.fake_fp8(x, scale), x, rtol=0, atol=0)
    over = torch.full((1, 2, 1, 1), 1e6)
    assert probe.fake_fp8(over, torch.ones(2, 1)).flatten().tolist() == [448.0, 448.0]
    rounded = probe.fake_fp8(torch.full((1, 2, 1, 1), 1.05), torch.ones(2, 1))  # 3 mantissa bits: 1.0 or 1.125
    assert rounded.flatten().tolist() == [1.0, 1.0]


def test_the_hook_transforms_each_call_and_puts_attention_back():
    q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))
    seen = []
    with probe.attention_hook(lambda call, key, value: (seen.append(call) or key, torch.zeros_like(value))):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        F.scaled_dot_product_attention(q, k, v)
    assert seen == [0, 1] and torch.equal(out, torch.zeros_like(out))
    assert not torch.equal(F.scaled_dot_product_attention(q, k, v), torch.zeros_like(out))  # restored


def test_subtracting_a_per_channel_key_mean_leaves_causal_gqa_attention_unchanged():
    # the premise of the smoothed-K variants: q . mean is the same for every key of a query
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 16, dtype=torch.float64), torch.randn(2, 2, 5, 16, dtype=torch.float64), \
        torch.randn(2, 2, 5, 16, dtype=torch.float64)
    mean = 3.0 + torch.randn(1, 2, 1, 16, dtype=torch.float64)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    smoothed = F.scaled_dot_product_attention(q, k - mean, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(smoothed, plain)
