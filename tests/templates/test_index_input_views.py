"""Integer inputs that index (decode lengths, prompt lengths, cache write positions) often arrive
as views: a decode step's lengths are expand(input_pos + 1) over the batch, a stride-0 tensor
holding one element. Verification draws them contiguous; the kernels must read them by index all
the same. (A batch-32 decode step read past that one element and got garbage lengths for
sequences 1..31: found by end-to-end bisection, every region having passed its own check.)"""

from __future__ import annotations

import torch
from template_helpers import on_test_device

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.decode_attention import DecodeAttentionFamily
from coopt.templates.kv_write import KvWriteFamily


def test_decode_attention_reads_expanded_lengths(load_candidate, assert_close):
    batch, heads, kv_heads, max_len, dim = 4, 4, 2, 64, 16
    q_spec = TensorSpec((batch, heads, 1, dim), "float32")
    kv = TensorSpec((batch, kv_heads, max_len, dim), "float32")
    region = RegionSummary("attn", "decode_attention", inputs=(q_spec, kv, kv, TensorSpec((batch,), "int32")),
                           outputs=(q_spec,), attrs={"scale": dim ** -0.5, "num_heads": heads,
                                                     "num_kv_heads": kv_heads, "lengths_input": 3,
                                                     "lengths_bound": [1, 2]})
    family = DecodeAttentionFamily()
    params = family.legal_points(region, H200)[0]
    module = load_candidate(family.render(region, params))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((batch, heads, 1, dim), kv.shape, kv.shape))
    lengths = (torch.tensor([37]) + 1).to(torch.int32).expand(batch)  # stride 0, one element
    assert lengths.stride() == (0,)
    (out,) = module.run(*on_test_device([q, k, v, lengths]))
    mask = (torch.arange(max_len)[None, :] < lengths[:, None])[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert_close(out, expected)


def test_kv_write_reads_expanded_positions(load_candidate):
    batch, kv_heads, max_len, dim = 3, 2, 16, 8
    cache = TensorSpec((batch, kv_heads, max_len, dim), "float32")
    value = TensorSpec((batch, kv_heads, 2, dim), "float32")
    region = RegionSummary("w", "kv_write", inputs=(cache, cache, TensorSpec((2,), "int64"), value, value),
                           outputs=(cache, cache), attrs={"rope": False, "quant": "none", "inplace": [0, 1]})
    family = KvWriteFamily()
    module = load_candidate(family.render(region, family.legal_points(region, H200)[0]))
    k_cache, v_cache = torch.zeros(cache.shape), torch.zeros(cache.shape)
    k, v = torch.randn(value.shape), torch.randn(value.shape)
    positions = torch.tensor([5, 0, 9, 0])[::2]  # a strided view: positions 5 and 9
    assert positions.stride() == (2,)
    tensors = on_test_device([k_cache, v_cache, positions, k, v])
    module.run(*tensors)
    expected_k = torch.zeros(cache.shape)
    expected_k[:, :, [5, 9]] = k
    torch.testing.assert_close(tensors[0].cpu(), expected_k)
