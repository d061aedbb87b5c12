"""A ragged decode step (one token per sequence, each at its own position): the per-row mask
`(cache_positions[None, :] <= pos[:, None]).view(B, 1, 1, S)` is raised to decode_attention with
per-row lengths pos + 1, and the per-row cache writes `cache[arange(B), :, pos] = k[:, :, 0]`
(with K's rope) become one kv_write region with "positions": "per-row"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coopt.codegen.torch_lines import reference_module_source
from coopt.ir.dialect import DecodeAttentionOp, StateUpdateOp
from coopt.runtime.kernel_loader import load_module_from_source
from pass_helpers import kernels, run_pipeline

FUSE = "inplace-state-writes,raise-patterns,fuse-attention,fuse-kv-write,fuse-rope"


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


class RaggedStep(torch.nn.Module):
    """One layer of a ragged decode step over a static cache [B_max, Hkv, S, D]."""

    def __init__(self, b_max=3, max_seq=32, rows="arange", v_rows="arange"):
        super().__init__()
        self.rows, self.v_rows = rows, v_rows
        self.register_buffer("k_cache", torch.randn(b_max, 2, max_seq, 8))
        self.register_buffer("v_cache", torch.randn(b_max, 2, max_seq, 8))
        self.register_buffer("cache_positions", torch.arange(max_seq))

    def forward(self, q, k, v, cos, sin, pos):
        batch = q.shape[0]
        k = k * cos + rotate_half(k) * sin
        rows = torch.arange(batch) if self.rows == "arange" else torch.arange(batch).flip(0)
        self.k_cache[rows, :, pos] = k[:, :, 0]
        if self.v_rows == "shared":
            self.v_cache[:batch, :, pos[:1]] = v
        else:
            self.v_cache[rows, :, pos] = v[:, :, 0]
        mask = (self.cache_positions[None, :] <= pos[:, None]).view(batch, 1, 1, -1)
        return F.scaled_dot_product_attention(q, self.k_cache[:batch], self.v_cache[:batch], attn_mask=mask,
                                              enable_gqa=True)


def inputs(b=3, positions=(5, 0, 31)):
    torch.manual_seed(0)
    return [torch.randn(b, 4, 1, 8), torch.randn(b, 2, 1, 8), torch.randn(b, 2, 1, 8),
            torch.randn(b, 1, 1, 8), torch.randn(b, 1, 1, 8), torch.tensor(positions)]


def test_the_per_row_mask_becomes_per_row_lengths():
    module, counters = run_pipeline(RaggedStep(), inputs(), "inplace-state-writes,raise-patterns")
    assert counters["raise.attention.decode"] == counters["raise.attention.decode.per_row"] == 1
    (attention,) = [op for op in module.walk() if isinstance(op, DecodeAttentionOp)]
    # lengths = add(pos, 1) [B] in pos's int64 (no cast: the kernels read either width), no
    # expand of one shared length
    plus_one = attention.lengths.owner
    assert plus_one.target.data == "aten.add.Tensor" and attention.lengths.type.get_shape() == (3,)
    assert str(attention.lengths.type.element_type) == "i64" and plus_one.inputs[0] is module.body.block.first_op.body.block.args[5]


def test_per_row_writes_become_one_region_with_the_rows_inside():
    module, counters = run_pipeline(RaggedStep(), inputs(), FUSE)
    assert counters["fuse.kv_write"] == counters["fuse.kv_write.per_row"] == counters["fuse.kv_write.rope"] == 1
    (region,) = [k for k in kernels(module) if k.family.data == "kv_write"]
    assert region.family_attrs == {"rope": True, "quant": "none", "inplace": [0, 1], "positions": "per-row",
                                   "index_input": 2, "index_bound": [0, 2]}
    body = [getattr(op, "target", None) and op.target.data or type(op).__name__ for op in region.body.block.ops]
    assert body == ["RopeOp", "aten.arange.default", "aten.select.int", "aten.index_put_.default",
                    "aten.select.int", "aten.index_put_.default", "YieldOp"]
    assert [v.type.get_shape() for v in region.inputs[2:5]] == [(3,), (3, 2, 1, 8), (3, 2, 1, 8)]
    assert not [op for op in module.walk() if isinstance(op, StateUpdateOp) and op.parent_op() is not region]
    assert not [op for op in module.walk() if getattr(op, "target", None) is not None
                and op.target.data == "aten.arange.default" and op.parent_op() is not region]


def test_the_region_reference_writes_each_row_at_its_position(tmp_path):
    module, _ = run_pipeline(RaggedStep(), inputs(), FUSE)
    (region,) = [k for k in kernels(module) if k.family.data == "kv_write"]
    reference = load_module_from_source(reference_module_source(region), tmp_path, "reference")
    k_cache, v_cache = torch.zeros(3, 2, 32, 8), torch.zeros(3, 2, 32, 8)
    _, k, v, cos, sin, pos = inputs()
    reference.run(k_cache, v_cache, pos, k, v, cos, sin)
    for b, p in enumerate(pos.tolist()):
        torch.testing.assert_close(k_cache[b, :, p], (k * cos + rotate_half(k) * sin)[b, :, 0])
        torch.testing.assert_close(v_cache[b, :, p], v[b, :, 0])
    assert int((k_cache != 0).any(-1).sum()) == 3 * 2  # one row per sequence and head, nothing else


@pytest.mark.parametrize("model,why", [
    (RaggedStep(rows="flipped"), "indices"),  # the batch index is not arange(B)
    (RaggedStep(v_rows="shared"), "unpaired"),  # K per row, V at one shared position: no partner
], ids=["rows-not-arange", "mixed-pair"])
def test_other_per_row_writes_are_left_alone(model, why):
    module, counters = run_pipeline(model, inputs(), FUSE)
    assert not [k for k in kernels(module) if k.family.data == "kv_write"]
    assert counters[f"fuse.kv_write.skipped.{why}"] >= 1, counters
