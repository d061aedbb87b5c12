"""Helpers the fusion passes share: elementwise programs from ops, and single-use chains."""

from __future__ import annotations

from xdsl.ir import Operation, SSAValue

from coopt.ir.dialect import ElementwiseOp


def only_user(value: SSAValue) -> Operation | None:
    users = {use.operation for use in value.uses}
    return users.pop() if len(users) == 1 else None


def ew_program(ops: list[ElementwiseOp], names: dict[SSAValue, str]) -> list:
    """The region-schema program of `ops` (in order); `names` maps values defined outside to
    program names ("in0", "acc") and gains an entry "t<i>" per op result."""
    program = []
    for i, op in enumerate(ops):
        args = [a["$f"] if isinstance(a, dict) else names[op.inputs[a]] for a in op.arg_refs]
        result = f"t{i}"
        program.append([result, op.fn.data, args])
        names[op.results[0]] = result
    return program


def extend_chain(start: SSAValue, allowed_inputs, max_ops: int, available_before) -> list[ElementwiseOp]:
    """Follow single consumers of `start` while they are elementwise ops whose other operands
    are `allowed_inputs(value)` and defined before the chain starts (`available_before(value)`)."""
    chain: list[ElementwiseOp] = []
    value = start
    while len(chain) < max_ops:
        user = only_user(value)
        if not isinstance(user, ElementwiseOp):
            break
        others = [v for v in user.inputs if v is not value]
        if not all(allowed_inputs(v) and available_before(v) for v in others):
            break
        chain.append(user)
        value = user.results[0]
    return chain
