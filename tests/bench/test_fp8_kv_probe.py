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


def test_hadamard_is_an_orthonormal_symmetric_rotation():
    h = probe.hadamard(32)
    torch.testing.assert_close(h @ h, torch.eye(32), rtol=0, atol=1e-6)
    assert torch.equal(h, h.T) and torch.equal(h.abs(), torch.full((32, 32), 32 ** -0.5))


def test_rotating_spreads_a_dominant_channel_so_fp8_scores_err_less():
    # the premise of the rotated variants: where q . k rests on one channel, e4m3 rounds the score
    # like that one element (up to 1/16); rotated, the rounding errors of 32 elements average out
    torch.manual_seed(0)
    q = torch.randn(1, 1, 1, 32, dtype=torch.float64)
    k = torch.randn(1, 1, 2000, 32, dtype=torch.float64) * 0.05
    q[..., 0], k[..., 0] = 4.0, 1.0 + torch.rand(2000, dtype=torch.float64)  # the dominant channel
    h = probe.hadamard(32).double()

    def rounded(keys):  # one per-head scale, as the build's
        return probe.fake_fp8(keys, keys.abs().amax().reshape(1, 1) / probe.FP8_MAX)

    exact = (q * k).sum(-1)
    plain_error = ((q * rounded(k)).sum(-1) - exact).abs().mean()
    rotated_error = ((q @ h * rounded(k @ h)).sum(-1) - exact).abs().mean()  # q rotated alike: (qH) . (kH) = q . k
    assert rotated_error < plain_error / 2, (rotated_error, plain_error)


def test_a_layer_in_bf16_k_layers_keeps_its_k_and_rounds_its_v():
    heads, dim = 2, 8
    stats = [{"k_absmax": torch.full((heads, dim), 4.0), "v_absmax": torch.full((heads, dim), 4.0),
              "k_mean": torch.zeros(heads, dim), "v_mean": torch.zeros(heads, dim)} for _ in range(2)]
    transform = probe.variant(stats, 2, k="head", v="head", bf16_k_layers=frozenset({1}))
    k, v = torch.full((1, heads, 3, dim), 1.05), torch.full((1, heads, 3, dim), 1.05)  # e4m3: 1.0 or 1.125
    for call, k_kept in ((0, False), (1, True), (2, False), (3, True)):  # layer = call % 2
        key, value = transform(call, k, v)
        assert torch.equal(key, k) == k_kept and not torch.equal(value, v)
    assert set(probe.per_layer_variants(3)) == {f"K+V per-head, K smoothed, layer {i}'s K bf16" for i in range(3)}


def test_the_recent_window_hook_reads_the_newest_keys_exact_and_older_ones_transformed():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 6, 8, dtype=torch.float64), torch.randn(1, 2, 6, 8, dtype=torch.float64)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with probe.recent_exact_hook(lambda call, key, value: (key, torch.zeros_like(value)), window=6):
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), exact)
    # window 2: a query's own row and the one before it exact, the older values read as zeros
    with probe.recent_exact_hook(lambda call, key, value: (key, torch.zeros_like(value)), window=2):
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    weights = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8 ** 0.5)
                            .masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf")), dim=-1)
    near = torch.ones(6, 6).tril() - torch.ones(6, 6).tril(-2)  # keys t - 1 and t
    torch.testing.assert_close(mixed, (weights * near) @ v.repeat_interleave(2, 1))
