"""What every coopt pass shares: metadata that the registry, `coopt passes` and the report read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from xdsl.dialects.builtin import DYNAMIC_INDEX, TensorType
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.ir.dialect import AtenOp, WeightOp


@dataclass(frozen=True)
class CooptPass(ModulePass):
    """A coopt pass: an xDSL ModulePass plus a one-line summary and a lossy flag.

    Fields of subclasses are the knobs (`name{knob=value}` in pipeline strings). A lossy pass
    changes numerics (fp8 KV cache, GQA conversion): it is never in the default pipeline and
    every build that uses it reports its measured accuracy impact.
    """

    summary: ClassVar[str] = ""
    lossy: ClassVar[bool] = False


FLOAT_TYPES = ("f32", "f16", "bf16")


def is_float_tensor(value: SSAValue) -> bool:
    t = value.type
    return isinstance(t, TensorType) and str(t.element_type) in FLOAT_TYPES


def is_bool_tensor(value: SSAValue) -> bool:
    t = value.type
    return isinstance(t, TensorType) and str(t.element_type) == "i1"


def static_shape(value: SSAValue) -> list[int | None]:
    """Shape with None for symbolic dims."""
    return [None if d == DYNAMIC_INDEX else d for d in value.type.get_shape()]


def same_shape(a: SSAValue, b: SSAValue) -> bool:
    return a.type.get_shape() == b.type.get_shape() and a.type.encoding == b.type.encoding


def aten_op(target: str, args: list, inputs: list, type_: TensorType, kwargs: dict | None = None) -> AtenOp:
    """A new `coopt.aten` op of one result (args in the importer's encoding: {"$t": i} is input
    i), not yet inserted."""
    return AtenOp(target, {"args": args, "kwargs": kwargs or {}}, inputs, [type_])


def insert_aten(target: str, args: list, inputs: list, type_: TensorType, before, kwargs: dict | None = None) -> SSAValue:
    """`aten_op` inserted before the op `before`; its result."""
    op = aten_op(target, args, inputs, type_, kwargs)
    Rewriter.insert_op(op, InsertPoint.before(before))
    return op.results[0]


def aten_target(op) -> str | None:
    return op.target.data if isinstance(op, AtenOp) else None


def tensor_arg(op: AtenOp, position: int, kw: str | None = None) -> SSAValue | None:
    """The operand passed as positional arg `position` (or keyword `kw`), if it is a value."""
    call = op.call
    arg = call["args"][position] if position < len(call["args"]) else call["kwargs"].get(kw)
    if isinstance(arg, dict) and "$t" in arg:
        return op.inputs[arg["$t"]]
    return None


def literal_arg(op: AtenOp, position: int, kw: str | None = None, default=None):
    call = op.call
    if position < len(call["args"]):
        return call["args"][position]
    return call["kwargs"].get(kw, default) if kw else default


# ATen ops whose result may share operand 0's storage: after an in-place write of a buffer, a view
# taken before it shows the new values
VIEW_OPS = frozenset({
    "aten.alias.default", "aten.slice.Tensor", "aten.select.int", "aten.narrow.default", "aten.view.default",
    "aten._unsafe_view.default", "aten.reshape.default", "aten.expand.default", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.permute.default", "aten.transpose.int",
    "aten.t.default", "aten.diagonal.default", "aten.as_strided.default", "aten.split.Tensor", "aten.chunk.default",
    "aten.unbind.int", "aten.split_with_sizes.default", "aten.flatten.using_ints", "aten.unflatten.int",
})

ARANGES = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


def may_share_state(value) -> bool:
    """Whether `value` may be (a view of) a buffer or a kernel's result, which an in-place write
    could change after `value` was read: a copy or a sum of it is a snapshot, a view is not."""
    from coopt.ir.dialect import KernelOp, StateUpdateOp

    while aten_target(value.owner) in VIEW_OPS:
        value = value.owner.inputs[0]
    return isinstance(value.owner, (WeightOp, StateUpdateOp, KernelOp))


def written_refs(module) -> set[str]:
    """The buffers the program writes (state updates and writes, by ref): their values at import
    are only their first call's."""
    from coopt.ir.dialect import StateUpdateOp, StateWriteOp

    return {op.ref.data for op in module.walk() if isinstance(op, (StateUpdateOp, StateWriteOp))}


def written_in_the_program(weight: WeightOp) -> bool:
    """Whether the program writes the buffer `weight` reads (`written_refs`)."""
    top = weight
    while top.parent_op() is not None:
        top = top.parent_op()
    return weight.ref.data in written_refs(top)


def zero_based_arange(value: SSAValue) -> int | None:
    """n when `value` holds the integers 0, 1, ..., n - 1 (cache positions, a batch's row index):
    an integer ATen arange from 0 by 1 with no tensor operands, or a buffer the importer found to
    hold exactly that (its `coopt.arange` attribute) that the program never writes; else None."""
    op, shape = value.owner, static_shape(value)
    if len(shape) != 1 or shape[0] is None or str(value.type.element_type) not in ("i64", "i32"):
        return None  # a float arange rounds: bf16 holds 0 .. 256 exactly, not 0 .. 511
    if isinstance(op, WeightOp):
        return shape[0] if "coopt.arange" in op.attributes and not written_in_the_program(op) else None
    target = aten_target(op)
    if target not in ARANGES or op.inputs:
        return None
    args = op.call["args"]
    start, step = (0, 1) if target == "aten.arange.default" else (args[0], args[2] if len(args) > 2 else 1)
    return shape[0] if start == 0 and step == 1 else None


def aten_arange(value: SSAValue) -> AtenOp | None:
    """The ATen arange op when `value` is one of 0, 1, ..., n - 1 (a batch's row index), else None."""
    return value.owner if aten_target(value.owner) in ARANGES and zero_based_arange(value) is not None else None


def make_available(value: SSAValue, kernel: Operation) -> bool:
    """Whether `value` is available where `kernel` (a region, or an op about to become one) is,
    once a model weight defined later (a WeightOp reads nothing) has been moved up before it."""
    owner = value.owner
    if not isinstance(owner, Operation):
        return True  # a block argument (a model input)
    block = kernel.parent_block()
    if owner.parent_block() is not block:
        return False
    order = {o: i for i, o in enumerate(block.ops)}
    if order[owner] < order[kernel]:
        return True
    if isinstance(owner, WeightOp):  # no operands: it may be defined anywhere before its readers
        owner.detach()
        Rewriter.insert_op(owner, InsertPoint.before(kernel))
        return True
    return False
