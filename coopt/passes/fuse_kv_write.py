"""fuse-kv-write: a layer's two KV-cache writes (plus K's rotary embedding and the fp8
quantization of both values) become one `kv_write` region (schema in coopt/ir/region.py and
docs/kv-cache.md): one launch per layer and step instead of a rope kernel, two index_put_ and,
with an fp8 cache, two quantize kernels.

Matched: two `coopt.state_update` (aten.index_put_, indices [None, None, positions]) of two
cache buffers [B_max, Hkv, S_max, D] (`coopt.weight` state buffers) in one block, with the same
positions operand and values of the indexed shape [B_max, Hkv, T, D]. Walking back from each
written value through producers whose only user is the chain: views that only drop or add
leading size-1 dims (a batch-1 export writes k as [Hkv, T, D]), one `coopt.quantize_fp8`
(per-tensor or per-head: the same granularity on K and V), and on K one `coopt.rope` (kept
outside when anything else reads it: fuse-rope then gives it its own region). The region's
outputs are the caches after the write; they replace the state_update results, so the attention
that follows reads the written caches. The region body is the original ops, so the reference
module does the same index_put_ on its input (an in-place region: "inplace" [0, 1]).

A ragged decode step writes one row per sequence at its own position: `cache.index_put_([rows,
None, positions], select(k, 2, 0))` with rows = arange(B), positions [B] and k [B, Hkv, 1, D].
Such a pair becomes a kv_write region with attrs "positions": "per-row" (k, v the 4-D values,
positions [B]; the region's body clones the arange), counted `fuse.kv_write.per_row`; its
"index_input" / "index_bound" name the positions and the cache dim bounding them, so that
verification draws valid positions for every row.

Paged writes (what paged-kv builds: `pool.index_put_([page_table[rows | :, positions // P], None,
positions % P], value)`, `paged_kv.read_paged_write`) fuse the same way into a kv_write region in
paged mode: the pools in place of the caches, the page table as the last input, attrs
"page_size": P, "page_table_input", "pool_input": 0; the body keeps the page arithmetic.
Counted `fuse.kv_write.paged`.

Left unfused, each with a counter `fuse.kv_write.skipped.<why>`: a write into a slice of the
cache (`slice(cache, 0, 0, B)`: a dynamic batch), a value that is not the whole indexed shape
(index_put_ would broadcast it over the batch), per-token fp8 (its scale computation and
scale-buffer write are not matched yet), and a write with no partner.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.ir.dialect import AtenOp, KernelOp, QuantizeFp8Op, RopeOp, StateUpdateOp, WeightOp
from coopt.ir.outline import can_outline, outline
from coopt.passes.base import CooptPass, aten_target, literal_arg, tensor_arg
from coopt.passes.paged_kv import PagedWrite, read_paged_write
from coopt.passes.fusion_common import only_user
from coopt.passes.shapes import dims
from coopt.passes.stats import count

_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default",
          "aten.squeeze.dim")
_FUSED_GRANULARITIES = ("per-tensor", "per-head")


@dataclass
class _Write:
    """One cache write and the chain that produces its value (ops in program order)."""

    update: StateUpdateOp
    cache: SSAValue
    positions: SSAValue
    source: SSAValue  # the [B_max, Hkv, T, D] value the region reads ([B, Hkv, 1, D] per row)
    views: list[Operation]  # leading-1 views between source and the write: bypassed, erased
    rope: RopeOp | None
    quantize: QuantizeFp8Op | None
    rows: Operation | None = None  # per-row writes: the arange(B) of the batch index
    paged: PagedWrite | None = None  # a write through a page table (paged-kv)


def _strip_leading_ones(shape: list) -> list:
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


_ARANGES = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


def _batch_rows(value: SSAValue) -> Operation | None:
    """The op when `value` is arange(n) (0, 1, ..., n - 1: a batch index), else None."""
    op = value.owner
    target = getattr(op, "target", None)
    if isinstance(op, StateUpdateOp) or target is None or target.data not in _ARANGES or op.inputs:
        return None
    args = op.call["args"]
    start, step = (0, 1) if target.data == "aten.arange.default" else (args[0], args[2] if len(args) > 2 else 1)
    return op if start == 0 and step == 1 and len(dims(value)) == 1 else None


def _paged_cache_write(update: StateUpdateOp):
    """(pool, positions, value, rows, paged) of a write through a page table, else None."""
    paged = read_paged_write(update)
    pool = tensor_arg(update, 0)
    if paged is None or pool is None or not isinstance(pool.owner, WeightOp) or len(dims(pool)) != 4:
        return None
    return pool, paged.positions, paged.value, paged.rows, paged


def _cache_write(update: StateUpdateOp):
    """(cache, positions, value, rows, paged) of `cache.index_put_([None, None, positions],
    value)` (rows None), of a per-row write `cache.index_put_([arange(B), None, positions],
    value)`, or of a write through a page table (paged: a PagedWrite), or why not."""
    if isinstance(update.parent_op(), KernelOp):
        return "not_index_put"
    paged = _paged_cache_write(update)
    if paged is not None:
        return paged
    if update.target.data == "coopt.slice_copy_":
        source = tensor_arg(update, 1)
        if source is not None and getattr(source.owner, "target", None) is not None \
                and source.owner.target.data == "aten.index_put.default":
            return "sliced_cache"  # cache[:B, :, pos] = k with B < B_max: index_put of a slice, copied back
    if update.target.data != "aten.index_put_.default":
        return "not_index_put"
    indices = literal_arg(update, 1)
    accumulate = literal_arg(update, 3, "accumulate", False)
    if not (isinstance(indices, list) and len(indices) == 3 and indices[1] is None) or accumulate:
        return "indices"
    rows = None
    if indices[0] is not None:  # a per-row write: the batch index must be arange(B)
        rows = _batch_rows(update.inputs[indices[0]["$t"]]) if isinstance(indices[0], dict) and "$t" in indices[0] else None
        if rows is None:
            return "indices"
    cache, value = tensor_arg(update, 0), tensor_arg(update, 2)
    positions = update.inputs[indices[2]["$t"]] if isinstance(indices[2], dict) and "$t" in indices[2] else None
    if cache is None or value is None or positions is None:
        return "indices"
    if not isinstance(cache.owner, WeightOp):
        return "sliced_cache"  # slice(cache, 0, 0, B): a dynamic batch, not fused yet
    if len(dims(cache)) != 4 or len(dims(positions)) != 1:
        return "shape"
    if rows is not None and dims(rows.results[0]) != dims(positions):
        return "shape"
    return cache, positions, value, rows, None


def _per_row_value(update: StateUpdateOp, value: SSAValue) -> tuple[SSAValue, Operation] | None:
    """(x, select) when a per-row write stores select(x, 2, 0) of x [B, Hkv, 1, D] read by
    nothing else (the one token of each row), else None."""
    select = value.owner
    if only_user(value) is not update or getattr(select, "target", None) is None \
            or select.target.data != "aten.select.int" or isinstance(select, StateUpdateOp):
        return None
    x = tensor_arg(select, 0)
    if x is None or literal_arg(select, 1) not in (2, -2) or literal_arg(select, 2) != 0:
        return None
    shape = dims(x)
    return (x, select) if len(shape) == 4 and shape[2] == 1 else None


def _value_chain(update: StateUpdateOp, value: SSAValue, absorb_rope: bool):
    """(source, views, rope, quantize): walk back from the written value through single-use
    views that only drop or add leading size-1 dims, one quantize_fp8 and (when `absorb_rope`)
    one rope. `source` is the value before all of them (the region's k or v input)."""
    views: list[Operation] = []
    rope = quantize = None
    user: Operation = update
    while only_user(value) is user:
        producer = value.owner
        target = getattr(producer, "target", None)
        if target is not None and not isinstance(producer, StateUpdateOp) and target.data in _VIEWS:
            source = producer.inputs[0]
            if _strip_leading_ones(dims(source)) != _strip_leading_ones(dims(value)):
                break
            views.append(producer)
        elif isinstance(producer, QuantizeFp8Op) and quantize is None:
            quantize, source = producer, producer.x
        elif isinstance(producer, RopeOp) and absorb_rope:
            rope, source = producer, producer.x
        else:
            break
        user, value = producer, source
        if rope is not None:
            break
    return value, views, rope, quantize


def _read_write(update: StateUpdateOp, absorb_rope: bool, absorb_quantize: bool) -> _Write | str:
    found = _cache_write(update)
    if isinstance(found, str):
        return found
    cache, positions, value, rows, paged = found
    b_max, heads, _, head_dim = dims(cache)
    if paged is not None:  # the pool's dim 0 is pages: the batch is the page table's
        b_max = dims(paged.table)[0]
    views: list[Operation] = []
    if rows is not None:
        per_row = _per_row_value(update, value)
        if per_row is None:
            return "shape"
        value, select = per_row
        views.append(select)
        user = select
    else:
        user = paged.index_ops[-1] if paged is not None else update  # a paged shared write stores permute(x)
    source, chain_views, rope, quantize = _value_chain(user, value, absorb_rope)
    views += chain_views
    if quantize is not None and not absorb_quantize:
        return "quantized"
    if rows is not None:
        batch = dims(positions)[0]
        if not (isinstance(batch, int) and batch <= b_max) or dims(source) != [batch, heads, 1, head_dim]:
            return "shape"  # one [Hkv, D] row per sequence, at most the cache's batch
    elif dims(source) != [b_max, heads, dims(positions)[0], head_dim]:
        return "shape"  # not the whole indexed shape: index_put_ would broadcast it
    if quantize is not None and quantize.granularity.data not in _FUSED_GRANULARITIES:
        return "per_token"
    return _Write(update, cache, positions, source, views, rope, quantize, rows, paged)


def _pair(first: _Write, second: _Write) -> tuple[_Write, _Write] | str:
    """(k, v) of two writes of one step, or why they are not one."""
    if first.cache is second.cache or dims(first.cache) != dims(second.cache):
        return "pair"
    if first.cache.type.element_type != second.cache.type.element_type:
        return "pair"
    if (first.quantize is None) != (second.quantize is None) or (
        first.quantize is not None and first.quantize.granularity.data != second.quantize.granularity.data
    ):
        return "quant_mismatch"
    if first.rope is not None and second.rope is not None:
        return "two_ropes"
    if (first.rows is None) != (second.rows is None) or (first.paged is None) != (second.paged is None):
        return "pair"
    if first.paged is not None and (first.paged.table is not second.paged.table
                                    or first.paged.page_size != second.paged.page_size):
        return "pair"
    return (second, first) if second.rope is not None else (first, second)


@dataclass(frozen=True)
class FuseKvWrite(CooptPass):
    name = "fuse-kv-write"
    summary = "a step's K and V cache writes (+ K's rope, + fp8 quantization) → one kv_write region"

    # absorb the rope producing K (when only the write reads it)
    rope: bool = True
    # absorb the coopt.quantize_fp8 of the written values (fp8-kv-cache); off: leave such writes
    quantize: bool = True

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        pending: dict[tuple, _Write] = {}  # (block, positions) -> an unpaired write
        for update in [o for o in op.walk() if isinstance(o, StateUpdateOp)]:
            write = _read_write(update, self.rope, self.quantize)
            if isinstance(write, str):
                if write != "not_index_put":
                    count(f"fuse.kv_write.skipped.{write}")
                continue
            key = (update.parent_block(), write.positions)
            partner = pending.pop(key, None)
            if partner is None:
                pending[key] = write
                continue
            pair = _pair(partner, write)
            if isinstance(pair, str):
                count(f"fuse.kv_write.skipped.{pair}")
                pending[key] = write  # the later one may pair with a write still to come
                continue
            self._fuse(*pair)
        for _ in pending.values():
            count("fuse.kv_write.skipped.unpaired")

    @staticmethod
    def _fuse(k: _Write, v: _Write) -> None:
        # the group as it stands (views and quantize included): nothing outside it may read it
        # between its first op and the write the region replaces
        group = [op for w in (k, v) for op in (w.rope, *w.views, w.quantize, *_index_ops(w), w.update)
                 if op is not None]
        if not can_outline(group):
            count("fuse.kv_write.skipped.order")
            return
        rows = _own_rows(k, v)
        ops = [*([rows] if rows is not None else []), *_normalize(k), *_normalize(v)]
        inputs = [k.cache, v.cache, k.positions, k.source, v.source]
        if k.rope is not None:
            inputs += [k.rope.cos, k.rope.sin]
        if k.quantize is not None:
            inputs += [k.quantize.scale, v.quantize.scale]
        attrs = {
            "rope": k.rope is not None,
            "quant": k.quantize.granularity.data if k.quantize is not None else "none",
            "inplace": [0, 1],
        }
        if rows is not None:
            # positions [B], one per row, each within the cache's dim 2 (what verification draws)
            attrs.update({"positions": "per-row", "index_input": 2, "index_bound": [0, 2]})
        if k.paged is not None:
            # the page table last; positions within max_pages * P (index_bound: the table's dim 1, in pages)
            inputs.append(k.paged.table)
            attrs.update({"page_size": k.paged.page_size, "page_table_input": len(inputs) - 1, "pool_input": 0})
            if rows is not None:
                attrs["index_bound"] = [len(inputs) - 1, 1]
        # a value passed twice (one scale weight for K and V) is two kernel inputs, in schema order
        outline(ops, "kv_write", attrs, inputs=inputs, outputs=[k.update.results[0], v.update.results[0]])
        count("fuse.kv_write")
        if k.rope is not None:
            count("fuse.kv_write.rope")
        if k.quantize is not None:
            count("fuse.kv_write.quantized")
        if rows is not None:
            count("fuse.kv_write.per_row")
        if k.paged is not None:
            count("fuse.kv_write.paged")


def _index_ops(write: _Write) -> list[Operation]:
    """A paged write's page arithmetic (and a shared write's permute): inside the region."""
    return list(write.paged.index_ops) if write.paged is not None else []


def _own_rows(k: _Write, v: _Write) -> Operation | None:
    """Per-row writes: a fresh arange(B) for the region's body (the batch index has no operands,
    so it belongs inside), used by both writes; the old one goes when nothing else reads it."""
    if k.rows is None:
        return None
    rows = k.rows.clone()
    first = min((op for w in (k, v) for op in (*_index_ops(w), w.update)), key=_position)
    Rewriter.insert_op(rows, InsertPoint.before(first))
    for write in (k, v):
        old = write.rows
        for user in (*_index_ops(write), write.update):  # the write, or a paged write's page lookup
            if old.results[0] in user.operands:
                user.operands = [rows.results[0] if o is old.results[0] else o for o in user.operands]
        write.rows = rows
        if not old.results[0].uses and old.parent is not None:
            old.detach()
            old.erase()
    return rows


def _position(op: Operation) -> int:
    return list(op.parent_block().ops).index(op)


def _normalize(write: _Write) -> list[Operation]:
    """Rewrite the write to the schema's form, cache.index_put_([None, None, positions],
    quantize(rope(source))) with a [B_max, Hkv, T, D] value (per row: select(..., 2, 0) of a
    [B, Hkv, 1, D] one; paged: through the page arithmetic), and return its ops.

    The views it bypasses only drop leading size-1 dims, which index_put_ broadcasts back: the
    write is the same. They go (they may carry symbolic sizes, which a region cannot take as
    inputs), and a quantize_fp8 behind one is rebuilt on the 4-D value."""
    value = write.rope.results[0] if write.rope is not None else write.source
    ops: list[Operation] = [write.rope] if write.rope is not None else []
    dead = list(write.views)
    if write.quantize is not None:
        old = write.quantize
        dead.append(old)
        element = old.results[0].type.element_type
        quantized_type = TensorType(element, value.type.get_shape(), value.type.encoding)
        new = QuantizeFp8Op(value, old.scale, old.granularity.data, quantized_type)
        Rewriter.insert_op(new, InsertPoint.before(write.update))
        write.quantize = new
        value = new.results[0]
        ops.append(new)
    if write.rows is not None:  # per row: each sequence's one [Hkv, D] row, select(x, 2, 0)
        batch, heads, _, head_dim = dims(value)
        select = AtenOp("aten.select.int", {"args": [{"$t": 0}, 2, 0], "kwargs": {}}, [value],
                        [TensorType(value.type.element_type, [batch, heads, head_dim])])
        Rewriter.insert_op(select, InsertPoint.before(write.update))
        value = select.results[0]
        ops.append(select)
    index_ops = [op for op in _index_ops(write) if aten_target(op) != "aten.permute.default"]
    if write.paged is not None and write.rows is None:  # a shared paged write stores [B, T, Hkv, D]
        old = write.paged.index_ops[-1]
        dead.append(old)
        permute = AtenOp(old.target.data, old.call, [value], [old.results[0].type])
        Rewriter.insert_op(permute, InsertPoint.before(write.update))
        value = permute.results[0]
        index_ops.append(permute)
    ops += index_ops  # (outline orders a region's ops as the block does)
    operands = list(write.update.operands)
    operands[write.update.call["args"][2]["$t"]] = value
    write.update.operands = operands
    while dead:  # consumers before producers: erase whatever nothing reads any more
        unused = [op for op in dead if not op.results[0].uses]
        for op in unused:
            dead.remove(op)
            op.detach()
            op.erase()
        if not unused:
            break
    return [*ops, write.update]
