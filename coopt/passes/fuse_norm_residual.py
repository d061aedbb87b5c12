"""fuse-norm-residual: rms_norm / layer_norm / softmax, with the residual add that feeds a norm
when the sum is also used later (the transformer residual stream) → one row_reduction kernel."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp

from coopt.ir.dialect import (
    ElementwiseOp,
    KernelOp,
    LayerNormOp,
    LogSoftmaxOp,
    RMSNormOp,
    SoftmaxOp,
)
from coopt.ir.outline import can_outline, outline
from coopt.passes.base import CooptPass
from coopt.passes.shapes import dims
from coopt.passes.stats import count

_KIND = {RMSNormOp: "rms_norm", LayerNormOp: "layer_norm", SoftmaxOp: "softmax", LogSoftmaxOp: "log_softmax"}


def _residual_add(norm) -> ElementwiseOp | None:
    add = norm.x.owner
    if not (isinstance(add, ElementwiseOp) and add.fn.data == "add" and len(add.inputs) == 2):
        return None
    a, b = add.inputs
    if not (dims(a) == dims(b) == dims(add.results[0])) or a.type.element_type != b.type.element_type:
        return None
    users = {use.operation for use in add.results[0].uses}
    return add if len(users) > 1 else None  # sum used elsewhere: writing it from the kernel pays


@dataclass(frozen=True)
class FuseNormResidual(CooptPass):
    name = "fuse-norm-residual"
    summary = "norm / softmax (+ residual add whose sum is reused) → row_reduction region"

    residual: bool = True  # take the feeding residual add into the kernel

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for norm in [o for o in op.walk() if type(o) in _KIND]:
            if isinstance(norm.parent_op(), KernelOp):
                continue
            kind = _KIND[type(norm)]
            is_norm = isinstance(norm, (RMSNormOp, LayerNormOp))  # (the softmaxes: no eps, no residual)
            add = _residual_add(norm) if self.residual and is_norm else None
            if add is not None and not can_outline([add, norm]):
                add = None
            weight = getattr(norm, "weight", None)
            bias = getattr(norm, "bias", None)
            x_inputs = list(add.inputs) if add is not None else [norm.x]
            inputs = x_inputs + [v for v in (weight, bias) if v is not None]
            if len(set(inputs)) != len(inputs):  # e.g. x + x: keep it simple, no residual form
                if add is None:
                    continue
                add, x_inputs = None, [norm.x]
                inputs = x_inputs + [v for v in (weight, bias) if v is not None]
            attrs = {
                "kind": kind,
                "eps": norm.eps.value.data if is_norm else 0.0,
                "has_weight": weight is not None,
                "has_bias": bias is not None,
                "residual": add is not None,
            }
            ops = [add, norm] if add is not None else [norm]
            outputs = [norm.results[0]] + ([add.results[0]] if add is not None else [])
            outline(ops, "row_reduction", attrs, inputs=inputs, outputs=outputs)
            count(f"fuse.row_reduction.{kind}" + ("+residual" if add is not None else ""))
