"""Repeated key / value heads folded into grouped-query attention (applied by raise-patterns first).

Model code written for attention that wants as many key / value heads as query heads copies each
kv head n times before scaled_dot_product_attention:

    k[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)    # Hugging Face's repeat_kv
    k.repeat_interleave(n, dim=1)

Both put kv head g at heads g * n ... g * n + n - 1, which is grouped-query attention's own
mapping (query head i reads kv head i // n). So the attention can read the h heads themselves,
with `enable_gqa=True`: the same numbers without the copy. In a decode step the copy is of the
whole KV cache, every step, n times its bytes, and it hides the cache from the passes that
recognise a decode attention over state (raise_decode_attention, fuse-kv-write-attention).
The explicit attention (softmax(q k^T * scale) v, raised to coopt.attention by raise-patterns)
over repeated heads folds the same way: coopt.attention takes fewer kv heads than query heads.
Lossless: nothing is computed or rounded differently. `k.repeat(1, n, 1, 1)` (query head i reads
kv head i % h) is another mapping and is left alone.
"""

from __future__ import annotations

from xdsl.ir import SSAValue
from xdsl.pattern_rewriter import (
    PatternRewriter,
    RewritePattern,
    op_type_rewrite_pattern,
)

from coopt.ir.dialect import AtenOp, AttentionOp
from coopt.passes.base import aten_target, literal_arg, tensor_arg
from coopt.passes.shapes import dims
from coopt.passes.stats import count

SDPA = "aten.scaled_dot_product_attention.default"
# what a reshape of the expanded copy exports as (clone + _unsafe_view when it must copy)
_RESHAPES = ("aten._unsafe_view.default", "aten.view.default", "aten.reshape.default")


def unrepeated_heads(value: SSAValue) -> tuple[SSAValue, int] | None:
    """(x, n) where `value` [b, h * n, s, d] is x [b, h, s, d] with each head repeated n times in
    place (repeat_interleave on dim 1, or unsqueeze(2) -> expand -> reshape); else None."""
    shape = dims(value)
    op = value.owner
    target = aten_target(op)
    if len(shape) != 4 or not isinstance(shape[1], int):
        return None
    if target == "aten.repeat_interleave.self_int":
        x, n = tensor_arg(op, 0), literal_arg(op, 1, "repeats")
        if x is None or literal_arg(op, 2, "dim") not in (1, -3) or not isinstance(n, int) or n < 1:
            return None
        return (x, n) if _heads_repeated(dims(x), shape, n) else None
    if target not in _RESHAPES or (copy := tensor_arg(op, 0)) is None:
        return None
    if aten_target(copy.owner) == "aten.clone.default":
        copy = tensor_arg(copy.owner, 0)
    expand = copy.owner if copy is not None else None
    if aten_target(expand) != "aten.expand.default" or (unsqueezed := tensor_arg(expand, 0)) is None:
        return None
    if aten_target(unsqueezed.owner) != "aten.unsqueeze.default" or literal_arg(unsqueezed.owner, 1) not in (2, -3):
        return None
    x = tensor_arg(unsqueezed.owner, 0)
    if x is None:
        return None
    source, expanded = dims(x), dims(copy)
    # the expand may broadcast the new dim only: every other dim is x's own
    if len(expanded) != 5 or expanded[:2] + expanded[3:] != source:
        return None
    n = expanded[2]
    return (x, n) if isinstance(n, int) and _heads_repeated(source, shape, n) else None


def _heads_repeated(source: list, repeated: list, n: int) -> bool:
    """`repeated` is `source` with its head dim (1) n times larger, the other dims the same."""
    return (len(source) == 4 and isinstance(source[1], int) and repeated[1] == source[1] * n
            and [repeated[0], *repeated[2:]] == [source[0], *source[2:]])


class FoldRepeatedKVHeads(RewritePattern):
    """SDPA over keys and values repeated n times a head → SDPA over the heads, enable_gqa=True."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        if op.target.data != SDPA:
            return
        call = op.call
        q, k, v = tensor_arg(op, 0, "query"), tensor_arg(op, 1, "key"), tensor_arg(op, 2, "value")
        if q is None or k is None or v is None:
            return
        folded = [unrepeated_heads(k), unrepeated_heads(v)]
        if None in folded or folded[0][1] != folded[1][1]:
            return  # both or neither: SDPA takes one head count for keys and values
        # the query must have as many heads as the repeated keys (eager SDPA would broadcast fewer),
        # or a multiple of them where the call already asked for grouped heads
        q_heads, repeated = dims(q)[1], dims(k)[1]
        if not isinstance(q_heads, int) or not (q_heads == repeated or (call["kwargs"].get("enable_gqa")
                                                                       and q_heads % repeated == 0)):
            return
        replaced = {1: folded[0][0], "key": folded[0][0], 2: folded[1][0], "value": folded[1][0]}
        gqa, inputs = _rebuilt_call(call, op.inputs, replaced)
        gqa["kwargs"]["enable_gqa"] = True
        rewriter.replace_matched_op(AtenOp(SDPA, gqa, inputs, [r.type for r in op.results]))
        count("raise.attention.repeated_kv_folded")


def _rebuilt_call(call: dict, inputs, replaced: dict) -> tuple[dict, list]:
    """(call, operands) with the args at the positions / keywords in `replaced` passing those
    values instead. Operands are numbered afresh: one that was shared (q, k and v all the same
    repeated tensor) keeps serving the args not replaced, and one no arg passes any more is dropped."""
    operands: list = []

    def ref(value) -> dict:
        index = next((i for i, known in enumerate(operands) if known is value), None)
        if index is None:
            operands.append(value)
            index = len(operands) - 1
        return {"$t": index}

    def rebuilt(arg):
        if isinstance(arg, dict) and "$t" in arg:
            return ref(inputs[arg["$t"]])
        if isinstance(arg, list):
            return [rebuilt(a) for a in arg]
        return arg

    args = [ref(replaced[i]) if i in replaced else rebuilt(a) for i, a in enumerate(call["args"])]
    kwargs = {kw: ref(replaced[kw]) if kw in replaced else rebuilt(a) for kw, a in call["kwargs"].items()}
    return {"args": args, "kwargs": kwargs}, operands


class FoldRepeatedKVIntoAttention(RewritePattern):
    """coopt.attention over keys and values repeated n times a head → over the heads (GQA)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AttentionOp, rewriter: PatternRewriter) -> None:
        folded = [unrepeated_heads(op.k), unrepeated_heads(op.v)]
        if None in folded or folded[0][1] != folded[1][1] or dims(op.q)[1] != dims(op.k)[1]:
            return  # (a query of fewer heads than the repeated keys was broadcast: not GQA)
        (k, _), (v, _) = folded
        rewriter.replace_matched_op(AttentionOp(op.q, k, v, bool(op.causal.value.data), op.scale.value.data, op.result.type))
        count("raise.attention.repeated_kv_folded")
