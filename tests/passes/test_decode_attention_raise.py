"""A static-cache decode step (gpt-fast style): the masked SDPA over the cache becomes a
decode_attention region with explicit lengths = input_pos + 1, and the build stays exact."""

import torch
import torch.nn.functional as F

import coopt
from pass_helpers import kernels, run_pipeline


class DecodeStep(torch.nn.Module):
    def __init__(self, heads=4, kv_heads=2, dim=16, max_seq=32):
        super().__init__()
        self.register_buffer("k_cache", torch.randn(1, kv_heads, max_seq, dim))
        self.register_buffer("v_cache", torch.randn(1, kv_heads, max_seq, dim))
        self.register_buffer("cache_positions", torch.arange(max_seq))

    def forward(self, q, k, v, input_pos):
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        mask = self.cache_positions[None, :] <= input_pos[:, None]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)


def inputs(pos: int):
    return torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), torch.tensor([pos])


def test_masked_decode_sdpa_becomes_a_decode_attention_region():
    module, counters = run_pipeline(DecodeStep(), inputs(5))
    assert counters["raise.attention.decode"] == 1 and counters["fuse.decode_attention"] == 1
    (region,) = [k for k in kernels(module) if k.family.data == "decode_attention"]
    attrs = region.family_attrs
    assert (attrs["num_heads"], attrs["num_kv_heads"], attrs["lengths_input"]) == (4, 2, 3)
    assert "cache_positions" not in str(module)  # the mask is gone: lengths carry it


def test_a_mask_over_something_else_is_left_alone():
    class OtherMask(DecodeStep):
        def forward(self, q, k, v, input_pos):
            mask = (self.cache_positions * 2)[None, :] <= input_pos[:, None]
            return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)

    _, counters = run_pipeline(OtherMask(), inputs(5))
    assert counters["raise.attention.decode"] == 0


def test_built_decode_steps_match_eager(tmp_path):
    torch.manual_seed(0)
    eager = DecodeStep()
    coopt.Pipeline(top_k=1).build(DecodeStep(), inputs(3), tmp_path / "out")
    built = coopt.load(tmp_path / "out")
    built.w_k_cache.copy_(eager.k_cache)
    built.w_v_cache.copy_(eager.v_cache)
    for pos in (3, 4, 31):
        step = inputs(pos)
        torch.testing.assert_close(built(*step), eager(*step), rtol=1e-4, atol=1e-4)
