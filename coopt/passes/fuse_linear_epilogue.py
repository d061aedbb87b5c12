"""fuse-linear-epilogue: a linear and the elementwise chain that consumes it → one GEMM kernel.

`outline_linear` builds every matmul_epilogue region (this pass's, and fuse-decode-gemv's with an
RMSNorm prologue and / or a GLU epilogue), so the two passes agree on the schema
(coopt/ir/region.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue

from coopt.ir.dialect import ElementwiseOp, KernelOp, LinearOp, RMSNormOp
from coopt.ir.outline import can_outline, outline
from coopt.passes.base import CooptPass, is_float_tensor
from coopt.passes.fusion_common import ew_program, extend_chain
from coopt.passes.shapes import broadcasts_to
from coopt.passes.stats import count


@dataclass(frozen=True)
class GatedHalves:
    """A linear whose output is cut into two halves that meet in act(one) * other (SwiGLU):
    `low` / `high` are the slices of the output's columns [0, N) and [N, 2N), `ops` the slices,
    the activation and the product, `result` the product."""

    low: SSAValue
    high: SSAValue
    ops: tuple[Operation, ...]
    gate_ops: tuple[ElementwiseOp, ...]  # activation, then product: the epilogue's first two ops
    result: SSAValue


def outline_linear(linear: LinearOp, max_ops: int, norm: RMSNormOp | None = None,
                   gated: GatedHalves | None = None) -> KernelOp | None:
    """Outline `linear` (with the RMSNorm `norm` producing its input, and the gated product
    `gated` of its halves) and the elementwise chain after it into a matmul_epilogue region.
    None when the ops cannot become one kernel (an op in between reads one of them)."""
    head = [norm] if norm is not None else []
    core = [linear, *gated.ops] if gated is not None else [linear]
    start = gated.result if gated is not None else linear.result

    def allowed(v):  # the GEMM input itself may come back as the residual: x + f(x W)
        return is_float_tensor(v) and broadcasts_to(v, start)

    chain = extend_chain(start, allowed, max_ops, lambda v: True)
    while not can_outline([*head, *core, *chain]):
        if not chain:
            return None
        chain.pop()
    extras: list = []
    for ew in chain:
        extras += [v for v in ew.inputs if v not in extras and v.owner not in chain and v is not start]
    names = {gated.low: "acc", gated.high: "acc_hi"} if gated is not None else {linear.result: "acc"}
    names.update({v: f"in{i}" for i, v in enumerate(extras)})
    program = ew_program([*(gated.gate_ops if gated is not None else ()), *chain], names)
    result = chain[-1].results[0] if chain else start
    attrs = {
        "b_layout": linear.b_layout.data,
        "has_bias": linear.bias is not None,
        "epilogue": program,
        "outputs": [names[result]],
    }
    norm_weight = []
    if norm is not None:
        attrs["prologue"] = {"kind": "rms_norm", "eps": norm.eps.value.data, "has_weight": norm.weight is not None}
        norm_weight = [norm.weight] if norm.weight is not None else []
    if gated is not None:
        attrs["glu"] = True
    x = norm.x if norm is not None else linear.x
    bias = [linear.bias] if linear.bias is not None else []
    inputs = [x, linear.w, *bias, *norm_weight, *extras]
    kernel = outline([*head, *core, *chain], "matmul_epilogue", attrs, inputs=inputs, outputs=[result])
    count("fuse.matmul_epilogue")
    count("fuse.matmul_epilogue.epilogue_ops", len(chain))
    return kernel


@dataclass(frozen=True)
class FuseLinearEpilogue(CooptPass):
    name = "fuse-linear-epilogue"
    summary = "linear(+bias) and its elementwise consumers (activation, residual add) → matmul_epilogue region"

    max_ops: int = 8  # epilogue length cap: each op adds registers to every output tile

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for linear in [o for o in op.walk() if isinstance(o, LinearOp)]:
            if isinstance(linear.parent_op(), KernelOp):
                continue
            outline_linear(linear, self.max_ops)
