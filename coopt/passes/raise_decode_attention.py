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

transformers builds the same decode mask as a float one added to the scores: 0 up to the
position, its dtype's minimum after it (`full((1, S), min) * (arange(S) > cache_position.reshape(-1,
1))`, then [None, None] and expanded over the batch). No finite score survives that minimum, so it
selects the same keys and is raised the same way. transformers 5 builds a boolean one,
`arange(S) + 0 <= arange(T) + cache_position[0]` broadcast to [B, 1, T, S]: raised too, a
decode step's or (T > 1) a prompt's over the cache.
"""

from __future__ import annotations

import math

from xdsl.dialects.builtin import TensorType
from xdsl.ir import SSAValue
from xdsl.pattern_rewriter import (
    PatternRewriter,
    RewritePattern,
    op_type_rewrite_pattern,
)
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.ir.dialect import AtenOp, CacheAttentionOp, DecodeAttentionOp
from coopt.passes.base import (
    aten_target,
    literal_arg,
    static_shape,
    tensor_arg,
    zero_based_arange,
)
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
    """(input_pos, S) when mask == le(arange(S)[None, :], input_pos[:, None]), else None."""
    le = mask.owner
    if aten_target(le) != "aten.le.Tensor":
        return None
    positions, pos = _unsqueezed(tensor_arg(le, 0), 0), _unsqueezed(tensor_arg(le, 1), 1)
    if positions is None or pos is None:
        return None
    length = zero_based_arange(positions)
    return None if length is None else (pos, length)


# what transformers puts between its [T, S] mask and SDPA: [None, None], expand over the batch,
# [..., :key_length]; `_under_mask_views` takes them only where they leave every query row's keys
# as they were
_MASK_VIEWS = ("aten.alias.default", "aten.unsqueeze.default", "aten.expand.default", "aten.slice.Tensor")
# an additive mask's fill below this is exp() == 0 after any finite score: as good as -inf
_MASKED_OUT = -1e30


def _column_of(value):
    """p when value is p viewed as a column [T, 1] (view / reshape to [-1, 1], unsqueeze(1))."""
    op = value.owner
    target, shape = aten_target(op), static_shape(value)
    if target == "aten.unsqueeze.default" and literal_arg(op, 1) in (1, -1) and len(shape) == 2:
        return tensor_arg(op, 0)
    if target in ("aten.view.default", "aten.reshape.default") and len(shape) == 2 and shape[1] == 1:
        source = tensor_arg(op, 0)
        return source if len(static_shape(source)) == 1 else None
    return None


def _under_mask_views(mask):
    """The mask under _MASK_VIEWS whose last two dims (query tokens, keys) are the mask's own:
    None where a view would move them (an unsqueeze between or after them, an expand of either)
    or a slice would not keep every key (a slice of the keys from 0 to their end is a no-op)."""
    if len(static_shape(mask)) < 2:
        return None
    while aten_target(mask.owner) in _MASK_VIEWS:
        op = mask.owner
        source, out = tensor_arg(op, 0), static_shape(mask)
        below = static_shape(source)
        if len(below) < 2 or out[-2:] != below[-2:]:  # expand or slice changed query tokens or keys
            return None
        if aten_target(op) == "aten.unsqueeze.default" and literal_arg(op, 1) % len(out) >= len(out) - 2:
            return None
        mask = source
    return mask


def _additive_positions_mask(mask):
    """(input_pos, S) when mask is transformers' decode mask over a static cache
    (_prepare_4d_causal_attention_mask_with_cache_position at one query token):
    full((1, S), min) * (arange(S) > input_pos.reshape(-1, 1)), under _MASK_VIEWS: 0 for the keys
    at or before the position, a fill no finite score survives for those after it. Else None."""
    mask = _under_mask_views(mask)
    mul = mask.owner if mask is not None else None
    if aten_target(mul) != "aten.mul.Tensor" or len(mul.inputs) != 2 or static_shape(mask)[:1] != [1]:
        return None
    fill, after = mul.inputs if aten_target(mul.inputs[0].owner) == "aten.full.default" else mul.inputs[::-1]
    full, gt = fill.owner, after.owner
    value = literal_arg(full, 1) if aten_target(full) == "aten.full.default" else None
    value = value.get("$f") if isinstance(value, dict) else value
    # finite: a -inf fill times the False of a visible key is NaN in the model's own mask
    if not isinstance(value, (int, float, str)) or not -math.inf < float(value) <= _MASKED_OUT:
        return None
    if aten_target(gt) == "aten.gt.Tensor":
        positions, column = tensor_arg(gt, 0), tensor_arg(gt, 1)
    elif aten_target(gt) == "aten.lt.Tensor":
        column, positions = tensor_arg(gt, 0), tensor_arg(gt, 1)
    else:
        return None
    length, pos = zero_based_arange(positions), _column_of(column)
    if length is None or pos is None:
        return None
    return (pos, length) if static_shape(fill) == [1, length] else None


def _one_dim_source(value):
    """(the 1-D tensor under unsqueezes of `value`, value's shape), else (None, shape)."""
    shape = static_shape(value)
    while aten_target(value.owner) == "aten.unsqueeze.default":
        value = tensor_arg(value.owner, 0)
    return (value if len(static_shape(value)) == 1 else None), shape


def _plus_zero(value):
    """x when value is x + 0 (transformers offsets its key positions by a kv offset of 0)."""
    op = value.owner
    if aten_target(op) == "aten.add.Tensor" and len(op.inputs) == 1 and literal_arg(op, 1) == 0:
        return op.inputs[0]
    return value


_ANDS = ("aten.__and__.Tensor", "aten.bitwise_and.Tensor", "aten.logical_and.default")


def _and_terms(value) -> list:
    """The terms of a conjunction tree of masks (`a & b & ...`), or [value]."""
    op = value.owner
    if aten_target(op) in _ANDS and len(op.inputs) == 2:
        return _and_terms(op.inputs[0]) + _and_terms(op.inputs[1])
    return [value]


def _always_true(term, keys, query, length: int) -> bool:
    """A conjunct that holds for every key of a cache of `length` positions: a scalar True
    (new_ones of bool) or a sliding window at least as long as the cache,
    `keys > query - window` with window >= length (the query's position is below the cache's
    length: its row is written there, bounded at call time)."""
    op = term.owner
    target = aten_target(op)
    if target == "aten.new_ones.default":
        return literal_arg(op, 2, "dtype") == {"$dtype": "bool"} and static_shape(term) == []
    if target != "aten.gt.Tensor" or tensor_arg(op, 0) is not keys:
        return False
    shifted = tensor_arg(op, 1)
    sub = shifted.owner if shifted is not None else None
    window = literal_arg(sub, 1) if aten_target(sub) == "aten.sub.Tensor" else None
    return (tensor_arg(sub, 0) is query and isinstance(window, int) and window >= length
            and literal_arg(sub, 2, "alpha", 1) == 1)


def _broadcast_positions_mask(mask):
    """(input_pos, S) when mask is transformers' (5.x) boolean mask over a static cache: key
    positions arange(S) (+ 0) as [1, ..., 1, S] compared `<=` with the query tokens' positions
    input_pos [T] as [1, ..., 1, T, 1] (T = 1 in a decode step), under _MASK_VIEWS (expanded over
    the batch), and-ed with nothing or with terms true for every key (Mistral's sliding window
    where it covers the whole cache). Else None."""
    root = _under_mask_views(mask)
    terms = _and_terms(root) if root is not None else []
    compares = [t for t in terms if aten_target(t.owner) in ("aten.le.Tensor", "aten.ge.Tensor")]
    if len(compares) != 1:
        return None
    le = compares[0]
    keys4d, query4d = tensor_arg(le.owner, 0), tensor_arg(le.owner, 1)
    if aten_target(le.owner) == "aten.ge.Tensor":
        keys4d, query4d = query4d, keys4d
    (keys, key_shape), (query, query_shape) = _one_dim_source(keys4d), _one_dim_source(query4d)
    if keys is None or query is None or len(key_shape) < 2 or len(query_shape) != len(key_shape):
        return None
    length, tokens = zero_based_arange(_plus_zero(keys)), static_shape(query)
    rank = len(key_shape)
    if length is None or key_shape != [1] * (rank - 1) + [length] or query_shape != [1] * (rank - 2) + tokens + [1]:
        return None
    if not all(_always_true(t, keys4d, query4d, length) for t in terms if t is not le):
        return None
    return query, length


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
        additive = False
        if found is None and per_row is None:  # transformers' masks over a static cache
            found = _broadcast_positions_mask(mask)
            if found is None and qs[2] == 1:
                found = _additive_positions_mask(mask)
                additive = found is not None
        if found is None:
            return
        input_pos, positions = found
        if positions != ks[2] or static_shape(mask)[-1] != positions or len(static_shape(input_pos)) != 1:
            return  # the mask must cover every key: one broadcast column would show them all
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
        if additive:
            count("raise.attention.decode.additive_mask")

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
