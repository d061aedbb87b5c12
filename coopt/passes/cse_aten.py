"""cse-aten: one ATen call on the same operands is computed once, a functional copy of a
value into a tensor of its own type is that value, and an alias is its source.

transformers 5's exported decode step recomputes the same small values per layer: each layer's
StaticCache copies cache_position[0] into its cumulative_length buffer (a functional
`copy(buffer, select(cache_position, 0, 0))`), then makes its write positions as
`arange(1) + that copy` and the buffer's next value as `copy + 1`. Run as written, a 32-layer
step launches ~5 such one-element kernels a layer. With the copies folded (a copy into a tensor of
the same type and shape takes the source's values whatever the destination held; not a copy of
(a view of) a buffer, a snapshot a later in-place write must not reach) the layers'
calls become the same calls on the same operands and run once; what is left a layer is the
buffer's own write.

transformers 5's causal-LM head reads `hidden_states[:, slice(-logits_to_keep, None), :]`, which
exports (logits_to_keep = 0) as `alias(norm(h))`: the alias kept the final RMSNorm out of the
head GEMV's prologue, one more launch a step. An alias is a view of all of its source, reads of
either are the same reads whatever is written later, so every alias folds (any dtype).

Only deterministic calls of integer or bool results merge (`_DETERMINISTIC`: views, index
arithmetic, comparisons; positions, lengths, masks): two random draws or two uninitialised
allocations are not the same value, and float values are the fusion passes' (a view of an
activation shared by two readers could go into neither's region: session 40 measured a two-layer
step that wrote one k into both caches losing both kv_write folds that way). Ops inside kernel
regions are not looked at (the pass runs before any region is made). Counters `cse.aten.merged`,
`cse.aten.copy_folded`, `cse.aten.alias_folded`.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.dialects.func import FuncOp

from coopt.ir.dialect import AtenOp
from coopt.passes.base import CooptPass, aten_target, may_share_state, tensor_arg
from coopt.passes.stats import count

_DETERMINISTIC = frozenset({
    "aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.full.default",
    "aten.select.int", "aten.slice.Tensor", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.view.default",
    "aten.reshape.default", "aten._unsafe_view.default", "aten.expand.default", "aten.alias.default",
    "aten.permute.default", "aten.transpose.int", "aten._to_copy.default", "aten.to.dtype",
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.neg.default",
    "aten.le.Tensor", "aten.lt.Tensor", "aten.ge.Tensor", "aten.gt.Tensor", "aten.eq.Tensor",
    "aten.le.Scalar", "aten.lt.Scalar", "aten.ge.Scalar", "aten.gt.Scalar", "aten.eq.Scalar",
    "aten.cat.default", "aten.index.Tensor", "aten.__and__.Tensor", "aten.__or__.Tensor",
})


def _integral(value) -> bool:
    """An integer or bool tensor: positions, lengths, masks. Float values are left alone: a view of
    an activation shared by two consumers would no longer be either's alone, and the fusion passes
    take a value's views into a region only where it has no other reader."""
    return isinstance(value.type, TensorType) and str(value.type.element_type) in ("i64", "i32", "i16", "i8", "i1", "ui8")


def _aliased_value(op: AtenOp):
    """x when op is alias(x) of x's own type."""
    if aten_target(op) != "aten.alias.default":
        return None
    source = tensor_arg(op, 0)
    return source if source is not None and source.type == op.results[0].type else None


def _copied_value(op: AtenOp):
    """src when op is copy(dst, src) with src of dst's (integral) type (shape, dtype, symbolic
    dims): the result holds src's values, nothing of dst's. Not where src may be a view of a
    buffer: the copy is a snapshot, and a later in-place write of the buffer would show through src."""
    if aten_target(op) != "aten.copy.default":
        return None
    dst, src = tensor_arg(op, 0), tensor_arg(op, 1)
    if dst is None or src is None or src.type != dst.type or not _integral(src) or may_share_state(src):
        return None
    return src


def _folded_value(op: AtenOp) -> tuple:
    """(the value op's result is, its counter) for a copy or an alias that folds, else (None, None)."""
    for fold, counter in ((_copied_value, "cse.aten.copy_folded"), (_aliased_value, "cse.aten.alias_folded")):
        source = fold(op)
        if source is not None:
            return source, counter
    return None, None


@dataclass(frozen=True)
class CseAten(CooptPass):
    name = "cse-aten"
    summary = "the same ATen call on the same operands once; a copy into a tensor of its own type is its source"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for func in [o for o in op.walk() if isinstance(o, FuncOp)]:
            seen: dict[tuple, AtenOp] = {}
            for aten in [o for o in func.body.block.ops if isinstance(o, AtenOp)]:
                source, counter = _folded_value(aten)
                if source is not None:
                    aten.results[0].replace_all_uses_with(source)
                    aten.detach()
                    aten.erase()
                    count(counter)
                    continue
                if aten.target.data not in _DETERMINISTIC or not all(_integral(r) for r in aten.results):
                    continue
                key = (aten.target.data, aten.args.data, tuple(aten.inputs),
                       tuple(r.type for r in aten.results))
                first = seen.setdefault(key, aten)
                if first is not aten:
                    for mine, kept in zip(aten.results, first.results):
                        mine.replace_all_uses_with(kept)
                    aten.detach()
                    aten.erase()
                    count("cse.aten.merged")
