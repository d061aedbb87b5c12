"""cse-aten: one ATen call on the same operands is computed once, and a functional copy of a
value into a tensor of its own type is that value.

transformers 5's exported decode step recomputes the same small values per layer: each layer's
StaticCache copies cache_position[0] into its cumulative_length buffer (a functional
`copy(buffer, select(cache_position, 0, 0))`), then makes its write positions as
`arange(1) + that copy` and the buffer's next value as `copy + 1`. Run as written, a 32-layer
step launches ~5 such one-element kernels a layer. With the copies folded (a copy into a tensor of
the same type and shape takes the source's values whatever the destination held) the layers'
calls become the same calls on the same operands and run once; what is left a layer is the
buffer's own write.

Only deterministic calls merge (`_DETERMINISTIC`: views, index arithmetic, elementwise math):
two random draws or two uninitialised allocations are not the same value. Ops inside kernel
regions are not looked at (the pass runs before any region is made). Counters `cse.aten.merged`,
`cse.aten.copy_folded`.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.func import FuncOp

from coopt.ir.dialect import AtenOp
from coopt.passes.base import CooptPass, aten_target, tensor_arg
from coopt.passes.stats import count

_DETERMINISTIC = frozenset({
    "aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.full.default",
    "aten.select.int", "aten.slice.Tensor", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.view.default",
    "aten.reshape.default", "aten._unsafe_view.default", "aten.expand.default", "aten.alias.default",
    "aten.permute.default", "aten.transpose.int", "aten._to_copy.default", "aten.to.dtype",
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.neg.default",
    "aten.le.Tensor", "aten.lt.Tensor", "aten.ge.Tensor", "aten.gt.Tensor", "aten.eq.Tensor",
    "aten.le.Scalar", "aten.lt.Scalar", "aten.ge.Scalar", "aten.gt.Scalar", "aten.eq.Scalar",
    "aten.cat.default", "aten.cos.default", "aten.sin.default", "aten.index.Tensor", "aten.embedding.default",
})


def _copied_value(op: AtenOp):
    """src when op is copy(dst, src) with src of dst's type (shape, dtype, symbolic dims): the
    result holds src's values, nothing of dst's."""
    if aten_target(op) != "aten.copy.default":
        return None
    dst, src = tensor_arg(op, 0), tensor_arg(op, 1)
    return src if dst is not None and src is not None and src.type == dst.type else None


@dataclass(frozen=True)
class CseAten(CooptPass):
    name = "cse-aten"
    summary = "the same ATen call on the same operands once; a copy into a tensor of its own type is its source"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for func in [o for o in op.walk() if isinstance(o, FuncOp)]:
            seen: dict[tuple, AtenOp] = {}
            for aten in [o for o in func.body.block.ops if isinstance(o, AtenOp)]:
                source = _copied_value(aten)
                if source is not None:
                    aten.results[0].replace_all_uses_with(source)
                    aten.detach()
                    aten.erase()
                    count("cse.aten.copy_folded")
                    continue
                if aten.target.data not in _DETERMINISTIC:
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
