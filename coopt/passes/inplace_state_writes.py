"""inplace-state-writes: a buffer update (KV-cache write) happens in place.

torch.export's functional graph writes a buffer as `new = index_put(old, idx, src)` plus a
buffer-mutation output; run as is, every decode step would build a whole new cache and copy it
back. When the functional update's input is the buffer itself and nothing reads the old value
after the update, this pass turns the pair into one `coopt.state_update` (an in-place ATen op),
so the step writes only the new token's keys and values.

A dynamic batch (B of B_max rows) exports its cache write as
`slice_scatter(buf, index_put(slice(buf, 0, 0, B), idx, src), 0, 0, B)`: done as written, that
copies the B rows of the cache twice a step (into the functional index_put, then back). When the
slice, the index_put and the slice_scatter cover the same range and each is read only by the next,
the pass writes through the slice view instead: `index_put_(slice(buf, 0, 0, B), idx, src)`, a
state_update whose result is still the whole buffer (codegen: the in-place op on the view, then
the buffer), so only the new rows move.

`index_copy(buf, d, idx, src)` (how transformers' StaticCache writes its rows) becomes the
index_put_ that writes the same rows, `index_put_(buf, [None] * d + [idx], src)`: the cache passes
after this one (fuse-kv-write, fp8-kv-cache, paged-kv) then read one form of a row write.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.rewriter import Rewriter

from coopt.ir.dialect import StateUpdateOp, StateWriteOp, WeightOp
from coopt.passes.base import VIEW_OPS, CooptPass, aten_target, literal_arg, tensor_arg
from coopt.passes.fusion_common import only_user
from coopt.passes.stats import count

# functional update -> in-place form (operands and arguments unchanged)
IN_PLACE = {
    "aten.index_put.default": "aten.index_put_.default",
    "aten.index_copy.default": "aten.index_copy_.default",
    "aten.slice_scatter.default": "coopt.slice_copy_",
}


def _reads_old_value_later(buffer, update) -> bool:
    """Whether anything after `update` reads the buffer's value from before it: the buffer itself,
    or a view of it taken before (a view shares the buffer's storage: after an in-place write it
    would show the new rows, as `prev.copy_(cache[3])` then a write of row 3 would)."""
    order = {op: i for i, op in enumerate(update.parent_block().ops)}
    values = [buffer]
    while values:
        for use in values.pop().uses:
            if use.operation is update:
                continue
            if order.get(use.operation, -1) > order[update]:
                return True
            if aten_target(use.operation) in VIEW_OPS:
                values.extend(use.operation.results)
    return False


def _slice_range(op, first: int) -> tuple:
    """(dim, start, end, step) of a slice (`first` = 1) or slice_scatter (2): literals, or the
    operand (SSA value) where one is passed; defaults as in ATen (start 0, step 1)."""
    def arg(k: int, default):
        value = literal_arg(op, first + k)
        if isinstance(value, dict) and "$t" in value:
            return op.inputs[value["$t"]]
        return default if value is None else value
    return arg(0, 0), arg(1, 0), arg(2, None), arg(3, 1)


def _sliced_index_put(update, buffer):
    """The functional index_put that a slice_scatter `update` of `buffer` writes back, when it
    updates the same slice of `buffer` it reads and each op is read only by the next; else None."""
    if aten_target(update) != "aten.slice_scatter.default":
        return None
    source = tensor_arg(update, 1)
    put = source.owner if source is not None else None
    if aten_target(put) != "aten.index_put.default" or literal_arg(put, 3, "accumulate", False):
        return None
    view = tensor_arg(put, 0)
    sliced = view.owner if view is not None else None
    if aten_target(sliced) != "aten.slice.Tensor" or tensor_arg(sliced, 0) is not buffer:
        return None
    if only_user(source) is not update or only_user(view) is not put or _slice_range(sliced, 1) != _slice_range(update, 2):
        return None
    return put


def _index_copy_as_index_put(update) -> dict | None:
    """index_copy(buf, d, idx, src) (transformers' StaticCache writes its rows so) as the call of
    index_put(buf, [None] * d + [idx], src), the form of a cache write that fuse-kv-write and
    fp8-kv-cache read; the same rows written (src has buf's shape but for len(idx) at d). None
    when `update` is no index_copy on a literal dim with a 1-D index."""
    if aten_target(update) != "aten.index_copy.default":
        return None
    rank, dim, index = len(update.inputs[0].type.get_shape()), literal_arg(update, 1), tensor_arg(update, 2)
    if not isinstance(dim, int) or not -rank <= dim < rank or index is None or len(index.type.get_shape()) != 1:
        return None
    return {"args": [{"$t": 0}, [None] * (dim % rank) + [{"$t": 1}], {"$t": 2}], "kwargs": {}}


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
            put = _sliced_index_put(update, buffer)  # a dynamic batch's rows: index_put_ through the slice view
            form, kind = (put, "index_put_slice") if put is not None else (update, target.split(".")[1])
            in_place_target, call = IN_PLACE[aten_target(form)], form.call
            as_put = _index_copy_as_index_put(form)
            if as_put is not None:  # one form of a row write for the passes after this one
                in_place_target, call = "aten.index_put_.default", as_put
            in_place = StateUpdateOp(write.ref.data, in_place_target, call, list(form.inputs), update.results[0].type)
            Rewriter.replace_op(update, in_place)
            if put is not None:
                put.detach()
                put.erase()
            count(f"inplace.{kind}")
            write.detach()
            write.erase()
