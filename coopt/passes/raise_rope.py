"""The rotate-half rotary embedding as ATen records it (Llama, Mistral, Qwen2 in HF and gpt-fast
style):

    x * cos + cat((-x[..., D/2:], x[..., :D/2]), -1) * sin        (either operand order)

→ one `coopt.rope(x, cos, sin)`. Seven ops, each a kernel reading and writing the activation,
become one op that the `rope` template family implements in a single pass over x.
"""

from __future__ import annotations

from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern

from coopt.ir.dialect import ElementwiseOp, RopeOp
from coopt.passes.base import aten_target, literal_arg, static_shape, tensor_arg
from coopt.passes.stats import count

_TO_THE_END = 2**63 - 1  # torch.export's encoding of an open slice end


def _mul_operands(value):
    """(a, b) of a two-tensor mul, else None."""
    op = value.owner
    if isinstance(op, ElementwiseOp) and op.fn.data == "mul" and len(op.inputs) == 2 and list(op.arg_refs) == [0, 1]:
        return op.inputs[0], op.inputs[1]
    return None


def _last_dim_slice(value, rank: int):
    """(source, start, end) of a slice over the last dim, else None."""
    op = value.owner
    if aten_target(op) != "aten.slice.Tensor":
        return None
    dim, start, end = literal_arg(op, 1, "dim", 0), literal_arg(op, 2, "start", 0), literal_arg(op, 3, "end", _TO_THE_END)
    if not all(isinstance(v, int) for v in (dim, start, end)) or dim % rank != rank - 1:
        return None
    return tensor_arg(op, 0), start, end


def _rotate_half_source(value):
    """x when `value` is cat((-x[..., D/2:], x[..., :D/2]), -1), else None."""
    op = value.owner
    if aten_target(op) != "aten.cat.default":
        return None
    parts, dim = literal_arg(op, 0), literal_arg(op, 1, "dim", 0)
    shape = static_shape(value)
    if not isinstance(parts, list) or len(parts) != 2 or not isinstance(dim, int) or dim % len(shape) != len(shape) - 1:
        return None
    if not all(isinstance(p, dict) and "$t" in p for p in parts):
        return None
    first, second = (op.inputs[p["$t"]] for p in parts)
    neg = first.owner
    if not (isinstance(neg, ElementwiseOp) and neg.fn.data == "neg" and len(neg.inputs) == 1):
        return None
    high, low = _last_dim_slice(neg.inputs[0], len(shape)), _last_dim_slice(second, len(shape))
    d = shape[-1]
    if high is None or low is None or high[0] is not low[0] or d is None or d % 2:
        return None
    if (high[1], min(high[2], d)) != (d // 2, d) or (low[1], min(low[2], d)) != (0, d // 2):
        return None
    return high[0]


class RaiseRope(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ElementwiseOp, rewriter: PatternRewriter) -> None:
        if op.fn.data != "add" or len(op.inputs) != 2 or list(op.arg_refs) != [0, 1]:
            return
        for plain, rotated in ((op.inputs[0], op.inputs[1]), (op.inputs[1], op.inputs[0])):
            found = self._match(plain, rotated)
            if found is not None and found[0].type == op.results[0].type:
                rewriter.replace_matched_op(RopeOp(*found, op.results[0].type))
                count("raise.rope")
                return

    @staticmethod
    def _match(plain, rotated):
        """(x, cos, sin) when plain = x·cos and rotated = rotate_half(x)·sin, else None."""
        a, b = _mul_operands(plain) or (None, None), _mul_operands(rotated) or (None, None)
        if a[0] is None or b[0] is None:
            return None
        for rot, sin in ((b[0], b[1]), (b[1], b[0])):
            x = _rotate_half_source(rot)
            if x is None:
                continue
            for x_side, cos in ((a[0], a[1]), (a[1], a[0])):
                if x_side is x:
                    return x, cos, sin
        return None
