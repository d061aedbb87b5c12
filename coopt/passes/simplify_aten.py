"""simplify-aten: exact rewrites of ATen calls into forms with fewer kernels, before raising.

transformers computes its rotary tables every decode step as

    freqs = (inv_freq[None, :, None].expand(B, -1, 1) @ positions[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1);  cos, sin = emb.cos(), emb.sin()

which runs as a matmul, a cat and the elementwise kernels around them: four launches for a
[B, T, D] table. Each rewrite below is exact (the same IEEE operations on the same values); together
they leave `positions.float() * W` with W = cat(inv_freq, inv_freq) a weight-only expression
(fold-constants computes it once, at build time), and the product, cos and sin one elementwise
kernel:

- OuterProductMatmul: a matmul whose contraction has one element, a [.., n, 1] @ b [.., 1, m], is
  the broadcast product a * b (each output one product, rounded once either way).
- TransposeIntoPointwise: a transpose of a pointwise op's only result is the op over its operands
  transposed (operands of the result's rank: broadcasting lines up the same way), so views move
  to the inputs, where an elementwise kernel reads them through strides.
- CatOfRepeats: cat([x, x, ...], d) of a pointwise x read only there is the op over its operands
  repeated along d; an operand of size 1 there (broadcast) is read as it is.

- TypeAsToCast: `x.type_as(y)` is x where the dtypes agree, else the cast `x.to(y.dtype)` that
  raise-patterns knows (Gemma's RMSNorm ends in `.type_as(x)`; left as it was, the norm had a
  reader that is not a linear and could not become a GEMV's prologue).

Counters `simplify.outer_product`, `simplify.transpose_sunk`, `simplify.cat_of_repeats`,
`simplify.type_as`.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from coopt.frontend.aten_table import ELEMENTWISE
from coopt.ir.dialect import AtenOp, KernelOp
from coopt.ir.summary import dtype_name
from coopt.passes.base import (
    CooptPass,
    aten_op,
    aten_target,
    is_float_tensor,
    literal_arg,
    static_shape,
    tensor_arg,
)
from coopt.passes.stats import count

_MATMULS = ("aten.matmul.default", "aten.bmm.default")


def _outside_kernels(op) -> bool:
    return not isinstance(op.parent_op(), KernelOp)


def _pointwise(op) -> bool:
    """An elementwise ATen op (aten_table.ELEMENTWISE), or a cast that only changes the dtype."""
    target = aten_target(op)
    if target == "aten._to_copy.default":
        return set(op.call["kwargs"]) == {"dtype"}
    return target in ELEMENTWISE


def _static(value) -> bool:
    return isinstance(value.type, TensorType) and None not in static_shape(value)


def _same_rank_operands(op: AtenOp) -> bool:
    """Every operand a static tensor of the result's rank (so a transpose or repeat of the result
    is the same one of each operand)."""
    rank = len(static_shape(op.results[0]))
    return all(_static(v) and len(static_shape(v)) == rank for v in op.inputs)


def _typed(value, shape: list[int]) -> TensorType:
    return TensorType(value.type.element_type, shape)


def _rebuilt(op: AtenOp, operands: list, shape: list[int]) -> AtenOp:
    """`op` over new operands (one per old one, same positions in its call), of result shape `shape`."""
    return AtenOp(op.target.data, op.call, operands, [_typed(op.results[0], shape)])


class OuterProductMatmul(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        if op.target.data not in _MATMULS or not _outside_kernels(op):
            return
        a, b = tensor_arg(op, 0), tensor_arg(op, 1)
        if a is None or b is None or not (is_float_tensor(a) and is_float_tensor(b)):
            return
        if a.type.element_type != b.type.element_type or not (_static(a) and _static(b)):
            return
        sa, sb = static_shape(a), static_shape(b)
        if len(sa) < 2 or len(sb) < 2 or sa[-1] != 1 or sb[-2] != 1:
            return
        rewriter.replace_matched_op(aten_op("aten.mul.Tensor", [{"$t": 0}, {"$t": 1}], [a, b], op.results[0].type))
        count("simplify.outer_product")


def _pointwise_read_once(value) -> AtenOp | None:
    """The pointwise op `value` is the only result of, where nothing else reads it and its
    operands have its rank (so a view or repeat of it is the same one of each operand)."""
    inner = value.owner if value is not None else None
    if (isinstance(inner, AtenOp) and _pointwise(inner) and len(inner.results) == 1
            and len(list(value.uses)) == 1 and _same_rank_operands(inner)):
        return inner
    return None


def _onto_operands(op: AtenOp, inner: AtenOp, rewriter: PatternRewriter, operand) -> None:
    """Replace `op`, a view or repeat of `inner`'s result, by `inner` over `operand(value)` of each
    of its operands: the value itself, or a new op computing it (inserted before `op`)."""
    operands = []
    for value in inner.inputs:
        moved = operand(value)
        if isinstance(moved, AtenOp):
            rewriter.insert_op(moved)
            moved = moved.results[0]
        operands.append(moved)
    rewriter.replace_matched_op(_rebuilt(inner, operands, static_shape(op.results[0])))
    rewriter.erase_op(inner)


class TransposeIntoPointwise(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        if op.target.data != "aten.transpose.int" or not _outside_kernels(op):
            return
        inner = _pointwise_read_once(tensor_arg(op, 0))
        if inner is None:
            return
        d0, d1 = literal_arg(op, 1), literal_arg(op, 2)

        def transposed(value):
            shape = static_shape(value)
            shape[d0], shape[d1] = shape[d1], shape[d0]
            return aten_op("aten.transpose.int", [{"$t": 0}, d0, d1], [value], _typed(value, shape))

        _onto_operands(op, inner, rewriter, transposed)
        count("simplify.transpose_sunk")


class CatOfRepeats(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        if op.target.data != "aten.cat.default" or len(op.inputs) != 1 or not _outside_kernels(op):
            return
        parts = literal_arg(op, 0)
        if not isinstance(parts, list) or len(parts) < 2 or any(p != {"$t": 0} for p in parts):
            return
        inner = _pointwise_read_once(op.inputs[0])
        if inner is None:
            return
        shape = static_shape(op.inputs[0])
        dim = literal_arg(op, 1, "dim", 0) % len(shape)
        if shape[dim] == 1:  # operands of size 1 there: broadcast or not, undecidable; rare
            return

        def repeated(value):
            value_shape = static_shape(value)
            if value_shape[dim] == 1:  # broadcast along dim: read as it is
                return value
            value_shape[dim] *= len(parts)
            return aten_op("aten.cat.default", [parts, dim], [value], _typed(value, value_shape))

        _onto_operands(op, inner, rewriter, repeated)
        count("simplify.cat_of_repeats")


class TypeAsToCast(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        if op.target.data != "aten.type_as.default" or not _outside_kernels(op):
            return
        source, like = tensor_arg(op, 0), tensor_arg(op, 1)
        if source is None or like is None or not isinstance(source.type, TensorType):
            return
        if source.type == op.results[0].type:  # already of that dtype: type_as returns it
            rewriter.replace_matched_op([], [source])
        else:
            dtype = dtype_name(op.results[0])
            rewriter.replace_matched_op(aten_op("aten._to_copy.default", [{"$t": 0}], [source], op.results[0].type,
                                                {"dtype": {"$dtype": dtype}}))
        count("simplify.type_as")


@dataclass(frozen=True)
class SimplifyAten(CooptPass):
    name = "simplify-aten"
    summary = "exact ATen rewrites to fewer kernels (a K = 1 matmul as a product, views and repeats moved to inputs)"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        PatternRewriteWalker(
            GreedyRewritePatternApplier([OuterProductMatmul(), TransposeIntoPointwise(), CatOfRepeats(),
                                         TypeAsToCast()]),
            apply_recursively=True,
        ).rewrite_module(op)
