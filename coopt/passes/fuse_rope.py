"""fuse-rope: each `coopt.rope` becomes its own `rope` kernel region (family schema in
coopt/ir/region.py); it is a separate pass so a pipeline can leave RoPE to the reference."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp

from coopt.ir.dialect import KernelOp, RopeOp
from coopt.ir.outline import outline
from coopt.passes.base import CooptPass
from coopt.passes.stats import count


@dataclass(frozen=True)
class FuseRope(CooptPass):
    name = "fuse-rope"
    summary = "rotary embedding (coopt.rope) → rope region"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for rope in [o for o in op.walk() if isinstance(o, RopeOp)]:
            if isinstance(rope.parent_op(), KernelOp):
                continue
            outline([rope], "rope", {}, inputs=[rope.x, rope.cos, rope.sin], outputs=[rope.results[0]])
            count("fuse.rope")
