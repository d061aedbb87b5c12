"""fuse-linear-epilogue: a linear and the elementwise chain that consumes it → one GEMM kernel."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp

from coopt.ir.dialect import KernelOp, LinearOp
from coopt.ir.outline import can_outline, outline
from coopt.passes.base import CooptPass, is_float_tensor
from coopt.passes.fusion_common import ew_program, extend_chain
from coopt.passes.shapes import broadcasts_to
from coopt.passes.stats import count


@dataclass(frozen=True)
class FuseLinearEpilogue(CooptPass):
    name = "fuse-linear-epilogue"
    summary = "linear(+bias) and its elementwise consumers (activation, residual add) → matmul_epilogue region"

    max_ops: int = 8  # epilogue length cap: each op adds registers to every output tile

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for linear in [o for o in op.walk() if isinstance(o, LinearOp)]:
            if isinstance(linear.parent_op(), KernelOp):
                continue
            out = linear.result

            def allowed(v):  # the GEMM input itself may come back as the residual: x + f(x W)
                return is_float_tensor(v) and broadcasts_to(v, out)

            chain = extend_chain(out, allowed, self.max_ops, lambda v: True)
            while not can_outline([linear, *chain]):
                chain.pop()
            extras: list = []
            for ew in chain:
                extras += [v for v in ew.inputs if v not in extras and v.owner not in chain and v is not out]
            names = {out: "acc", **{v: f"in{i}" for i, v in enumerate(extras)}}
            program = ew_program(chain, names)
            result = chain[-1].results[0] if chain else out
            attrs = {
                "b_layout": linear.b_layout.data,
                "has_bias": linear.bias is not None,
                "epilogue": program,
                "outputs": [names[result]],
            }
            inputs = [linear.x, linear.w] + ([linear.bias] if linear.bias is not None else []) + extras
            outline([linear, *chain], "matmul_epilogue", attrs, inputs=inputs, outputs=[result])
            count("fuse.matmul_epilogue")
            count("fuse.matmul_epilogue.epilogue_ops", len(chain))
