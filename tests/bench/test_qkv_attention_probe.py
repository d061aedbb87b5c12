"""bench/qkv_attention_probe.py without a GPU: the probe kernel's two halves (PHASE 1, the q|k|v
GEMV with its RMSNorm; PHASE 2, the folded attention reading them), run as two launches in
Triton's interpreter, give a decode layer's attention step: the output and the new K/V row in
the caches, with the counters zero again after. The one-launch form waits for the other programs
of its kv head, which the interpreter (programs one after another) cannot run: the GPU test
compares it with the two launches."""

from __future__ import annotations

import pytest
import torch
from qkv_attention_probe import Probe

HEADS, KV_HEADS, D, HIDDEN, CACHE = 4, 2, 16, 64, 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the kernels without a GPU


def inputs(length: int, device=DEVICE, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
    g = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device=device)).to(torch.bfloat16)
    w = (torch.randn((HEADS + 2 * KV_HEADS) * D, HIDDEN, generator=gen, device=device) / HIDDEN ** 0.5).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, KV_HEADS, CACHE, D, generator=gen, device=device).to(torch.bfloat16) for _ in "kv")
    angles = torch.rand(1, D, generator=gen, device=device) * 6.283
    out = torch.empty(1, HEADS, 1, D, device=device, dtype=torch.bfloat16)
    pos = torch.tensor([length - 1], device=device)
    return [x, g, w, k_cache, v_cache, angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16), pos, out]


def reference(x, g, w, k_cache, v_cache, cos, sin, pos, out):
    """(attention output [H, D], new K row [Hkv, D], new V row) of the layer step in fp32, each
    rounding to bf16 where the step stores a tensor."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * g.float()
    y = (normed @ w.float().T).to(torch.bfloat16).float()[0]
    q, k_new, v_new = y[:HEADS * D].view(HEADS, D), y[HEADS * D:(HEADS + KV_HEADS) * D].view(KV_HEADS, D), y[(HEADS + KV_HEADS) * D:].view(KV_HEADS, D)

    def rope(t):
        rotated = torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1)
        return (t * cos.float()[0] + rotated * sin.float()[0]).to(torch.bfloat16).float()

    q, k_new = rope(q), rope(k_new)
    n = int(pos) + 1
    keys, values = k_cache[0, :, :n].float().clone(), v_cache[0, :, :n].float().clone()
    keys[:, n - 1], values[:, n - 1] = k_new, v_new
    keys, values = (t.repeat_interleave(HEADS // KV_HEADS, 0) for t in (keys, values))
    attention = torch.softmax(q[:, None] @ keys.transpose(-1, -2) * D ** -0.5, -1) @ values
    return attention[:, 0], k_new, v_new


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("length,split", [(40, 2), (64, 4)])
def test_two_launches_give_the_layer_step(length, split, prefetch):
    """With PREFETCH the first K/V tile is loaded before the new row is written: the new row must
    be patched into it (the cache's old row there is random, so a stale read shows)."""
    args = inputs(length)
    expected, k_new, v_new = reference(*args)
    probe = Probe(split, 4, 32, 2, prefetch, DEVICE, heads=HEADS, kv_heads=KV_HEADS, head_dim=D, hidden=HIDDEN)
    out = probe.pair(*args)
    assert (out.float()[0, :, 0] - expected).abs().max() <= 2e-2 * expected.abs().max()
    assert torch.allclose(args[3][0, :, length - 1].float(), k_new, atol=3e-2, rtol=1e-2)
    assert torch.allclose(args[4][0, :, length - 1].float(), v_new, atol=3e-2, rtol=1e-2)
    assert probe.arrivals.count_nonzero() == 0 and probe.sync.count_nonzero() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [False, True])
def test_one_launch_matches_the_two_launches_on_the_gpu(prefetch):
    args = inputs(40, device="cuda")
    copies = [t.clone() for t in args]
    kwargs = dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=D, hidden=HIDDEN)
    pair = Probe(2, 4, 32, 2, False, "cuda", **kwargs).pair(*args)
    fused = Probe(2, 4, 32, 2, prefetch, "cuda", **kwargs)
    for _ in range(3):  # the counters come back to zero for the next launch
        out = fused.fused(*copies)
    torch.testing.assert_close(out, pair)
    torch.testing.assert_close(copies[3], args[3])
    assert fused.sync.count_nonzero() == 0
