"""fuse-elementwise: connected elementwise ops → one kernel (one read of each input, one write
of each escaping value, instead of a round trip through memory per op)."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp

from coopt.ir.dialect import ElementwiseOp, KernelOp
from coopt.ir.outline import can_outline, outline, region_boundary
from coopt.passes.base import CooptPass
from coopt.passes.fusion_common import ew_program
from coopt.passes.shapes import broadcasts_to, dims
from coopt.passes.stats import count


def _neighbours(op: ElementwiseOp):
    """The elementwise ops next to `op`: its users, then the producers of its operands (so that
    the branches of a tree, x.clamp(...) + y.erf(), meet in one kernel), then the other readers
    of its operands (x.cos() and x.sin() of a rotary table: one kernel reading x once, two outputs)."""
    yield from (use.operation for use in list(op.results[0].uses))
    yield from (v.owner for v in op.operands)
    yield from (use.operation for v in op.operands for use in list(v.uses) if use.operation is not op)


def _grow(start: ElementwiseOp, max_ops: int) -> list[ElementwiseOp]:
    """Greedy: add elementwise neighbours of the group while the group stays outlinable."""
    group = [start]
    grown = True
    while grown and len(group) < max_ops:
        grown = False
        for member in list(group):
            for other in _neighbours(member):
                if isinstance(other, ElementwiseOp) and other not in group and other.parent_op() is start.parent_op():
                    if can_outline(group + [other]) and _shape_ok(group + [other]):
                        group.append(other)
                        grown = True
                        break
            if grown or len(group) >= max_ops:
                break
    return group


def _shape_ok(group: list[ElementwiseOp]) -> bool:
    """Every escaping value has the one output shape; everything else broadcasts to it."""
    inputs, outputs = region_boundary(group)
    if not outputs:
        outputs = [group[-1].results[0]]
    shape = dims(outputs[0])
    if any(dims(v) != shape for v in outputs):
        return False
    return all(broadcasts_to(v, outputs[0]) for v in inputs + [op.results[0] for op in group])


@dataclass(frozen=True)
class FuseElementwise(CooptPass):
    name = "fuse-elementwise"
    summary = "chains of elementwise ops → elementwise region"

    max_ops: int = 8  # long programs raise register pressure and compile time for little gain
    min_ops: int = 1  # a lone op still gains a verified kernel candidate (fp32 math, one pass)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        taken: set = set()
        for start in [o for o in op.walk() if isinstance(o, ElementwiseOp)]:
            if start in taken or isinstance(start.parent_op(), KernelOp):
                continue
            group = _grow(start, self.max_ops)
            if len(group) < self.min_ops or not _shape_ok(group):
                continue
            taken.update(group)
            block = start.parent_block()
            order = {o: i for i, o in enumerate(block.ops)}
            group.sort(key=order.__getitem__)
            inputs, outputs = region_boundary(group)
            names = {v: f"in{i}" for i, v in enumerate(inputs)}
            program = ew_program(group, names)
            attrs = {"program": program, "outputs": [names[v] for v in outputs]}
            outline(group, "elementwise", attrs, inputs=inputs, outputs=outputs)
            count("fuse.elementwise")
            count("fuse.elementwise.ops", len(group))
