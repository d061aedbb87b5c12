"""A static-cache decode step (gpt-fast style): the masked SDPA over the cache becomes a
decode_attention region with explicit lengths = input_pos + 1, and the build stays exact."""

import json

import torch
import torch.nn.functional as F
from pass_helpers import kernels, run_pipeline

import coopt
from coopt.ir.dialect import AtenOp, KernelOp
from coopt.passes.raise_decode_attention import lengths_source
from coopt.passes.registry import DEFAULT_PIPELINE


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


def build_and_compare(step_class, out, pipeline=DEFAULT_PIPELINE):
    """Build `step_class()` (top-1 advice: the kernels), give it eager's caches, compare steps
    and the caches they wrote; returns the loaded build."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where coopt.load puts the build
    eager = step_class().to(device)
    coopt.Pipeline(pipeline, top_k=1).build(step_class(), inputs(3), out)
    built = coopt.load(out)
    built.w_k_cache.copy_(eager.k_cache)
    built.w_v_cache.copy_(eager.v_cache)
    for pos in (3, 4, 31):
        step = [x.to(device) for x in inputs(pos)]
        torch.testing.assert_close(built(*step), eager(*step), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(built.w_k_cache, eager.k_cache, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(built.w_v_cache, eager.v_cache, rtol=1e-5, atol=1e-5)
    return built


def test_built_decode_steps_match_eager(tmp_path):
    build_and_compare(DecodeStep, tmp_path / "out")


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_tables(seed: int = 2, rows: int = 32, dim: int = 16):
    """cos, sin [rows, dim] of random frequencies (position x frequency angles)."""
    angles = torch.arange(rows)[:, None] * torch.rand(dim, generator=torch.Generator().manual_seed(seed))
    return angles.cos(), angles.sin()


class RopedDecodeStep(DecodeStep):
    """The query rotated (RoPE at input_pos) before the decode attention, as a Llama layer does."""

    def __init__(self, also_return_q=False):
        super().__init__()
        cos, sin = rotary_tables()
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.also_return_q = also_return_q

    def forward(self, q, k, v, input_pos):
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        q = q * cos + rotate_half(q) * sin
        out = super().forward(q, k, v, input_pos)
        return (out, q) if self.also_return_q else out


def test_the_query_rope_joins_the_decode_attention_region(tmp_path):
    module, counters = run_pipeline(RopedDecodeStep(), inputs(5))
    (region,) = [k for k in kernels(module) if k.family.data == "decode_attention"]
    assert counters["fuse.decode_attention.rope"] == 1 and region.family_attrs["rope"] is True
    assert not [k for k in kernels(module) if k.family.data == "rope"] and not counters["fuse.rope"]
    # a rotated query read elsewhere too stays its own rope region
    module, counters = run_pipeline(RopedDecodeStep(also_return_q=True), inputs(5))
    assert not counters["fuse.decode_attention.rope"] and counters["fuse.rope"] == 1
    # and the knob turns it off
    _, counters = run_pipeline(RopedDecodeStep(), inputs(5), DEFAULT_PIPELINE.replace("fuse-attention", "fuse-attention{rope=false}"))
    assert not counters["fuse.decode_attention.rope"] and counters["fuse.rope"] == 1
    # the built step (the kernel rotating q in the interpreter) matches eager
    build_and_compare(RopedDecodeStep, tmp_path / "out")
    (attention,) = [r for r in json.loads((tmp_path / "out" / "selection.json").read_text())["regions"].values()
                    if r["family"] == "decode_attention"]
    chosen = next(c for c in attention["candidates"] if c["label"] == attention["selected"])
    assert chosen["verified"] and chosen["family"] == "decode_attention"  # the kernel, not the reference


class TwoLayerDecodeStep(torch.nn.Module):
    """Two layers' caches and decode attentions over the same input_pos."""

    def __init__(self):
        super().__init__()
        self.first, self.second = DecodeStep(), DecodeStep()

    def forward(self, q, k, v, input_pos):
        return self.second(self.first(q, k, v, input_pos), k, v, input_pos)


def test_layers_share_one_lengths_tensor():
    module, counters = run_pipeline(TwoLayerDecodeStep(), inputs(5))
    attentions = [k for k in kernels(module) if k.family.data == "decode_attention"]
    assert len(attentions) == 2 and counters["raise.attention.shared_lengths"] == 1
    assert attentions[0].inputs[3] is attentions[1].inputs[3]  # one add + cast a step, not one a layer


def test_the_lengths_add_runs_in_the_attention_kernels():
    """fuse-attention's lengths_add: each decode region takes the step's positions (one shared
    view, not the `+ 1`) and adds 1 in its body and kernel (attrs lengths_offset), so no ATen add
    is left to launch each step; the knob keeps the shared add."""
    module, counters = run_pipeline(TwoLayerDecodeStep(), inputs(5))
    attentions = [k for k in kernels(module) if k.family.data == "decode_attention"]
    assert counters["fuse.decode_attention.lengths_add"] == 2
    assert all(a.family_attrs["lengths_offset"] == 1 for a in attentions)
    view = attentions[0].inputs[3]
    assert view is attentions[1].inputs[3] and view.owner.target.data == "aten.expand.default"
    assert view.owner.operands[0].index == 3  # input_pos itself, the user's fourth input
    outside = [o for o in module.walk() if not isinstance(o.parent_op(), KernelOp) and isinstance(o, AtenOp)]
    assert not [o for o in outside if o.target.data == "aten.add.Tensor"]
    module, counters = run_pipeline(TwoLayerDecodeStep(), inputs(5),
                                    DEFAULT_PIPELINE.replace("fuse-attention", "fuse-attention{lengths-add=false}"))
    attentions = [k for k in kernels(module) if k.family.data == "decode_attention"]
    assert not counters["fuse.decode_attention.lengths_add"] and "lengths_offset" not in attentions[0].family_attrs
    assert lengths_source(attentions[0].inputs[3])[1] == 1  # the add (+ 1) outside, as raise-patterns built it


def test_two_built_layers_with_their_lengths_in_the_kernels_match_eager(tmp_path):
    torch.manual_seed(0)
    eager = TwoLayerDecodeStep()
    coopt.Pipeline(DEFAULT_PIPELINE, top_k=1).build(TwoLayerDecodeStep(), inputs(3), tmp_path / "out")
    built = coopt.load(tmp_path / "out")
    device = next(built.buffers()).device
    eager = eager.to(device)
    for name, cache in (("first_k_cache", eager.first.k_cache), ("first_v_cache", eager.first.v_cache),
                        ("second_k_cache", eager.second.k_cache), ("second_v_cache", eager.second.v_cache)):
        getattr(built, "w_" + name).copy_(cache)
    for pos in (0, 3, 31):
        step = [x.to(device) for x in inputs(pos)]
        torch.testing.assert_close(built(*step), eager(*step), rtol=1e-4, atol=1e-4)
    selection = json.loads((tmp_path / "out" / "selection.json").read_text())
    attentions = [r for r in selection["regions"].values() if r["family"] == "decode_attention"]
    assert attentions and all(next(c for c in r["candidates"] if c["label"] == r["selected"])["family"] == "decode_attention"
                              or selection["measured"] for r in attentions)
