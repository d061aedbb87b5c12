"""inplace-state-writes: a buffer update (KV-cache write) happens in place.

torch.export's functional graph writes a buffer as `new = index_put(old, idx, src)` plus a
buffer-mutation output; run as is, every decode step would build a whole new cache and copy it
back. When the functional update's input is the buffer itself and nothing reads the old value
after the update, this pass turns the pair into one `coopt.state_update` (an in-place ATen op),
so the step writes only the new token's keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.rewriter import Rewriter

from coopt.ir.dialect import StateUpdateOp, StateWriteOp, WeightOp
from coopt.passes.base import CooptPass, aten_target, tensor_arg
from coopt.passes.stats import count

# functional update -> in-place form (operands and arguments unchanged)
IN_PLACE = {
    "aten.index_put.default": "aten.index_put_.default",
    "aten.index_copy.default": "aten.index_copy_.default",
    "aten.slice_scatter.default": "coopt.slice_copy_",
}


def _reads_old_value_later(buffer, update) -> bool:
    order = {op: i for i, op in enumerate(update.parent_block().ops)}
    return any(use.operation is not update and order.get(use.operation, -1) > order[update] for use in buffer.uses)


@dataclass(frozen=True)
class InplaceStateWrites(CooptPass):
    name = "inplace-state-writes"
    summary = "buffer updates (KV-cache writes) in place instead of rebuilding and copying the buffer"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for write in [o for o in op.walk() if isinstance(o, StateWriteOp)]:
            update = write.value.owner
            target = aten_target(update)
            if target not in IN_PLACE:
                continue
            buffer = tensor_arg(update, 0)
            if not (isinstance(buffer.owner, WeightOp) and buffer.owner.ref.data == write.ref.data):
                continue
            if _reads_old_value_later(buffer, update):
                continue  # someone still needs the old contents after the write
            in_place = StateUpdateOp(write.ref.data, IN_PLACE[target], update.call, list(update.inputs), update.results[0].type)
            Rewriter.replace_op(update, in_place)
            write.detach()
            write.erase()
            count(f"inplace.{target.split('.')[1]}")
