"""The decode step of a static-KV-cache model: SDPA of one query token with a mask
`cache_positions[None, :] <= input_pos[:, None]` is attention over the first
input_pos + 1 positions of the cache. Raised to coopt.decode_attention with explicit
lengths, so a flash-decoding kernel reads only the valid part of the cache. The same mask with
several query tokens (a prompt, or a chunk of one, over the cache) becomes
coopt.cache_attention with one length per query position.

A ragged decode step (one token per row, each row at its own position: input_pos [B]) masks
row b with `(cache_positions[None, :] <= input_pos[:, None]).view(B, 1, 1, S)`: the same
comparison, one row per sequence, broadcast over heads and the single query. It is raised to a
decode_attention with per-row lengths input_pos + 1 ([B], no expand).
"""

from __future__ import annotations

import math

from xdsl.dialects.builtin import TensorType
from xdsl.ir import SSAValue
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.ir.dialect import AtenOp, CacheAttentionOp, DecodeAttentionOp, WeightOp
from coopt.passes.base import aten_target, literal_arg, static_shape, tensor_arg
from coopt.passes.stats import count


def _unsqueezed(value, dim: int):
    op = value.owner
    if aten_target(op) == "aten.unsqueeze.default" and literal_arg(op, 1) == dim:
        return tensor_arg(op, 0)
    return None


def _per_row_view(mask):
    """The [B, S] mask under a [B, 1, 1, S] view of it (a ragged step's per-row mask), else None."""
    op = mask.owner
    if aten_target(op) not in ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"):
        return None
    source = tensor_arg(op, 0)
    shape, out = (static_shape(source) if source is not None else []), static_shape(mask)
    if len(shape) != 2 or len(out) != 4 or out != [shape[0], 1, 1, shape[1]]:
        return None
    return source


def _positions_mask(mask):
    """input_pos when mask == le(arange_buffer[None, :], input_pos[:, None]), else None."""
    le = mask.owner
    if aten_target(le) != "aten.le.Tensor":
        return None
    positions, pos = _unsqueezed(tensor_arg(le, 0), 0), _unsqueezed(tensor_arg(le, 1), 1)
    if positions is None or pos is None:
        return None
    if not (isinstance(positions.owner, WeightOp) and "coopt.arange" in positions.owner.attributes):
        return None
    return pos, static_shape(positions)[0]


class RaiseDecodeSDPA(RewritePattern):
    """One instance per rewrite of a module: it remembers the lengths it built, so every layer's
    attention over the same positions reads one lengths tensor (one ATen kernel a step, not one
    a layer)."""

    def __init__(self):
        self._lengths: dict[tuple, SSAValue] = {}

    def _shared_lengths(self, key: tuple, op: AtenOp) -> SSAValue | None:
        """The lengths built for `key` by an earlier attention of op's block, if it precedes op."""
        lengths = self._lengths.get(key)
        owner = getattr(lengths, "owner", None)
        if owner is None or owner.parent_block() is not op.parent_block():
            return None
        block = op.parent_block()
        return lengths if block.get_operation_index(owner) < block.get_operation_index(op) else None

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        if op.target.data != "aten.scaled_dot_product_attention.default":
            return
        q, k, v, mask = tensor_arg(op, 0), tensor_arg(op, 1), tensor_arg(op, 2), tensor_arg(op, 3, "attn_mask")
        if mask is None or literal_arg(op, 4, "dropout_p", 0.0) != 0.0 or literal_arg(op, 5, "is_causal", False):
            return
        qs, ks = static_shape(q), static_shape(k)
        if len(qs) != 4 or None in (qs[1], ks[1], ks[2]) or qs[1] % ks[1]:
            return
        if qs[2] == 1 and qs[0] is None:
            return
        per_row = _per_row_view(mask)  # a ragged step: one position per sequence
        found = _positions_mask(per_row if per_row is not None else mask)
        if found is None:
            return
        input_pos, positions = found
        if positions != ks[2] or len(static_shape(input_pos)) != 1:
            return
        scale = literal_arg(op, 6, "scale", None)
        scale = 1.0 / math.sqrt(qs[3]) if scale is None else scale
        prompt = qs[2] != 1  # a prompt (chunk) over the cache: one length per query position
        if per_row is not None and (prompt or static_shape(input_pos) != [qs[0]]):
            return
        if prompt and input_pos.type.get_shape()[0] != q.type.get_shape()[2]:
            return
        if not prompt and per_row is None and static_shape(input_pos) != [1]:
            return
        attention = CacheAttentionOp if prompt else DecodeAttentionOp
        key = (input_pos, prompt, per_row is not None, qs[0])
        lengths = self._shared_lengths(key, op)
        if lengths is None:
            lengths = self._build_lengths(input_pos, prompt, per_row is not None, qs[0], op)
            self._lengths[key] = lengths
        else:
            count("raise.attention.shared_lengths")
        rewriter.replace_matched_op(attention(q, k, v, lengths, float(scale), op.results[0].type))
        count("raise.attention." + ("prompt_over_cache" if prompt else "decode"))
        if per_row is not None:
            count("raise.attention.decode.per_row")

    @staticmethod
    def _build_lengths(input_pos: SSAValue, prompt: bool, per_row: bool, batch, op: AtenOp) -> SSAValue:
        # lengths = input_pos + 1, per query position or (decode) per sequence, in input_pos's
        # integer dtype: the attention kernels read int32 or int64 lengths, and a cast to int32
        # would be one more PyTorch launch a step (session 11: ~1 µs of a b32 step)
        plus_one = AtenOp("aten.add.Tensor", {"args": [{"$t": 0}, 1], "kwargs": {}}, [input_pos], [input_pos.type])
        new_ops = [plus_one]
        if not prompt and not per_row:  # one shared position: the same length for every sequence
            element = input_pos.type.element_type
            new_ops.append(AtenOp("aten.expand.default", {"args": [{"$t": 0}, [batch]], "kwargs": {}},
                                  [plus_one.results[0]], [TensorType(element, [batch])]))
        for new in new_ops:
            Rewriter.insert_op(new, InsertPoint.before(op))
        return new_ops[-1].results[0]


def lengths_source(lengths):
    """(block argument, offset) when `lengths` is the chain RaiseDecodeSDPA builds from a user
    input (expand(input + offset), an integer cast allowed between), else None: the example
    call's lengths are then that input's example values + offset."""
    from xdsl.ir import BlockArgument

    value, offset = lengths, 0
    while not isinstance(value, BlockArgument):
        op = value.owner
        target = aten_target(op)
        if target in ("aten.expand.default", "aten._to_copy.default") and tensor_arg(op, 0) is not None:
            value = tensor_arg(op, 0)
        elif target == "aten.add.Tensor" and isinstance(literal_arg(op, 1), int) and tensor_arg(op, 0) is not None:
            offset += literal_arg(op, 1)
            value = tensor_arg(op, 0)
        else:
            return None
    return value, offset
