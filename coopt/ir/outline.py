"""Outline a group of ops into a `coopt.kernel` region (what every fusion pass does last), and inline one back."""

from __future__ import annotations

import json

from xdsl.ir import Block, Operation, Region, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.ir.dialect import KernelOp, YieldOp, json_prop
from xdsl.dialects.builtin import StringAttr


def _ordered(ops: list[Operation]) -> list[Operation]:
    block = ops[0].parent_block()
    order = {op: i for i, op in enumerate(block.ops)}
    return sorted(ops, key=order.__getitem__)


def region_boundary(ops: list[Operation]) -> tuple[list[SSAValue], list[SSAValue]]:
    """(inputs, outputs): values used inside but defined outside, and defined inside but used outside."""
    inside = set(ops)
    inputs: list[SSAValue] = []
    outputs: list[SSAValue] = []
    for op in ops:
        for operand in op.operands:
            if operand.owner not in inside and operand not in inputs:
                inputs.append(operand)
        for result in op.results:
            if any(use.operation not in inside for use in result.uses) and result not in outputs:
                outputs.append(result)
    return inputs, outputs


def can_outline(ops: list[Operation]) -> bool:
    """The kernel takes the place of the group's last op. Its inputs are then always defined
    (each was defined before the group op that read it); the only hazard is an op outside the
    group, sitting between the group's first and last op, that reads a group result."""
    ops = _ordered(ops)
    inside = set(ops)
    between = False
    for op in ops[0].parent_block().ops:
        if op is ops[-1]:
            return True
        if op is ops[0]:
            between = True
        elif between and op not in inside and any(v.owner in inside for v in op.operands):
            return False
    return True


def outline(
    ops: list[Operation],
    family: str,
    attrs: dict,
    inputs: list[SSAValue] | None = None,
    outputs: list[SSAValue] | None = None,
) -> KernelOp:
    """Replace `ops` by one KernelOp whose body holds clones of them; returns the kernel.

    `inputs` / `outputs` fix the order the family's schema wants (coopt.ir.region); they must
    be exactly the region's boundary values. Regions are named later (name-regions).
    """
    ops = _ordered(ops)
    found_inputs, found_outputs = region_boundary(ops)
    inputs = found_inputs if inputs is None else inputs
    outputs = found_outputs if outputs is None else outputs
    assert set(inputs) == set(found_inputs) and set(outputs) >= set(found_outputs), "bad region boundary"
    block = Block(arg_types=[v.type for v in inputs])
    mapping: dict[SSAValue, SSAValue] = dict(zip(inputs, block.args))
    for op in ops:
        clone = op.clone(value_mapper=mapping)
        block.add_op(clone)
        for old, new in zip(op.results, clone.results):
            mapping[old] = new
    block.add_op(YieldOp([mapping[v] for v in outputs]))
    kernel = KernelOp.create(
        operands=inputs,
        result_types=[v.type for v in outputs],
        properties={"sym_name": StringAttr(""), "family": StringAttr(family), "attrs": json_prop(attrs)},
        regions=[Region(block)],
    )
    Rewriter.insert_op(kernel, InsertPoint.after(ops[-1]))
    for old, new in zip(outputs, kernel.results):
        old.replace_uses_with_if(new, lambda use: use.operation is not kernel and use.operation not in ops)
    for op in reversed(ops):
        op.detach()
        op.erase()
    return kernel


def set_attrs(kernel: KernelOp, attrs: dict) -> None:
    kernel.properties["attrs"] = StringAttr(json.dumps(attrs, sort_keys=True))


def inline(kernel: KernelOp) -> tuple[list[Operation], list[SSAValue]]:
    """Replace `kernel` by clones of its body's ops in its place; (the clones, what it yielded)."""
    mapping: dict[SSAValue, SSAValue] = dict(zip(kernel.body.block.args, kernel.inputs))
    clones: list[Operation] = []
    yielded: list[SSAValue] = []
    for inner in kernel.body.block.ops:
        if isinstance(inner, YieldOp):
            yielded = [mapping[v] for v in inner.values]
            continue
        clone = inner.clone(value_mapper=mapping)
        Rewriter.insert_op(clone, InsertPoint.before(kernel))
        mapping.update(zip(inner.results, clone.results))
        clones.append(clone)
    for old, new in zip(kernel.results, yielded):
        old.replace_all_uses_with(new)
    kernel.detach()
    kernel.erase()
    return clones, yielded
