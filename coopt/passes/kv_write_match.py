"""What fuse-kv-write recognises: a KV-cache write and the chain that produces its value.

`read_write(update)` reads one `coopt.state_update` as a cache write (shared positions [T], one
position per row, or through a page table) together with what may go into the kv_write region
with it: leading-1 views, K's rope, an fp8 quantize and, per-token, the scales' computation and
their write beside the rows; or says why not (the counter's name). `pair` pairs K's and V's
writes of one step. coopt/passes/fuse_kv_write.py outlines the pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects.builtin import f32
from xdsl.ir import Operation, SSAValue

from coopt.ir.dialect import KernelOp, QuantizeFp8Op, RopeOp, StateUpdateOp, WeightOp
from coopt.passes.base import aten_arange, aten_target, literal_arg, tensor_arg
from coopt.passes.fp8_kv_cache import RING_WRITE, RowScales, read_row_scales
from coopt.passes.fusion_common import only_user
from coopt.passes.paged_kv import PagedWrite, read_paged_write
from coopt.passes.shapes import dims

_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default",
          "aten.squeeze.dim")
# why a state_update is not a cache write at all (not counted): no index_put_, or the write of a
# per-token scale buffer (taken with its cache's write)
NOT_CACHE_WRITES = ("not_index_put", "scale_buffer")


@dataclass
class ScaleWrite:
    """A per-token quantize's scales: their computation from the quantized rows, and their write
    into the scale buffer at the same positions (and page table) as the rows' write."""

    scales: RowScales
    update: StateUpdateOp
    buffer: SSAValue  # [B_max, Hkv, S_max] (paged: a pool [N, Hkv, P])
    views: list[Operation]  # per row: the select(s, 2, 0) it stores
    paged: PagedWrite | None
    batch_view: Operation | None = None  # a dynamic batch's write through slice(buffer, 0, 0, B)


@dataclass
class Write:
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
    scales: ScaleWrite | None = None  # per-token fp8: the scales' computation and write
    batch_view: Operation | None = None  # a dynamic batch's write through slice(cache, 0, 0, B)
    centre: Operation | None = None  # smooth-k / smooth-v: the sub of the cache's offset weight between rope and quantize
    # the rows before rounding where attentions read them unrounded too (fp8-kv-cache's
    # exact-recent): computed inside the region, which outputs them
    exact_rows: SSAValue | None = None

    def updates(self) -> list[tuple[StateUpdateOp, PagedWrite | None]]:
        """The writes of the region: the cache's, and its scale buffer's (per-token)."""
        scale = [(self.scales.update, self.scales.paged)] if self.scales is not None else []
        return [(self.update, self.paged), *scale]


def _strip_leading_ones(shape: list) -> list:
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def _paged_cache_write(update: StateUpdateOp, rank: int):
    """(pool, positions, value, rows, paged) of a write through a page table, else None."""
    paged = read_paged_write(update)
    pool = tensor_arg(update, 0)
    if paged is None or pool is None or not isinstance(pool.owner, WeightOp) or len(dims(pool)) != rank:
        return None
    return pool, paged.positions, paged.value, paged.rows, paged


def _cache_write(update: StateUpdateOp, rank: int = 4):
    """(cache, positions, value, rows, paged) of `cache.index_put_([None, None, positions],
    value)` (rows None), of a per-row write `cache.index_put_([arange(B), None, positions],
    value)`, or of a write through a page table (paged: a PagedWrite), or why not. `rank` 3: the
    same writes of a per-token scale buffer (no D)."""
    if update.parent is None or isinstance(update.parent_op(), KernelOp):
        return "not_index_put"  # (or already taken into a region with its cache's write)
    buffer = tensor_arg(update, 0)
    if rank == 4 and buffer is not None and len(dims(buffer)) == 3:
        return "scale_buffer"
    paged = _paged_cache_write(update, rank)
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
        rows = aten_arange(update.inputs[indices[0]["$t"]]) if isinstance(indices[0], dict) and "$t" in indices[0] else None
        if rows is None:
            return "indices"
    cache, value = tensor_arg(update, 0), tensor_arg(update, 2)
    positions = update.inputs[indices[2]["$t"]] if isinstance(indices[2], dict) and "$t" in indices[2] else None
    if cache is None or value is None or positions is None:
        return "indices"
    if not isinstance(cache.owner, WeightOp) and (rows is not None or batch_view(cache, update) is None):
        return "sliced_cache"  # a slice written otherwise than a shared write of the first B rows
    if len(dims(cache)) != rank or len(dims(positions)) != 1:
        return "shape"
    if rows is not None and dims(rows.results[0]) != dims(positions):
        return "shape"
    return cache, positions, value, rows, None


def batch_view(cache: SSAValue, update: StateUpdateOp) -> Operation | None:
    """The slice(buffer, 0, 0, B) that `update` writes through, read by nothing else, when the
    buffer is a state weight (a dynamic batch's rows, after inplace-state-writes); else None."""
    view = cache.owner
    if aten_target(view) != "aten.slice.Tensor" or only_user(cache) is not update:
        return None
    buffer = tensor_arg(view, 0)
    dim, start = literal_arg(view, 1, default=0), literal_arg(view, 2, default=0)
    step = literal_arg(view, 4, default=1)
    if buffer is None or not isinstance(buffer.owner, WeightOp) or dim != 0 or start not in (0, None) or step not in (1, None):
        return None
    return view


def _whole_buffer(written: SSAValue) -> tuple[SSAValue, Operation | None]:
    """(the state buffer, the batch view) of what a write `_cache_write` accepted goes into: the
    buffer itself (no view), or a dynamic batch's slice(buffer, 0, 0, B)."""
    if isinstance(written.owner, WeightOp):
        return written, None
    return tensor_arg(written.owner, 0), written.owner


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


def _read_only_by(value: SSAValue, user: Operation, scales: RowScales | None) -> bool:
    """Whether `user` is the one reader of `value`, but for the abs of per-token scales computed
    from it."""
    others = [scales.ops[0]] if scales is not None and value is scales.x else []
    return {use.operation for use in value.uses} == {user, *others}


def _read_exactly(value: SSAValue, user: Operation) -> bool:
    """Whether `user` reads `value` as rows it keeps unrounded (fp8-kv-cache's exact-recent): an
    attention's k_exact / v_exact (raised or a region's), or a ring write's rows."""
    if isinstance(user, KernelOp):
        at = user.family_attrs.get("exact_rows_input")
        return at is not None and value in tuple(user.operands[at:at + 2])
    if isinstance(user, StateUpdateOp):
        return user.target.data == RING_WRITE and user.operands[2] is value
    return value in (getattr(user, "k_exact", None), getattr(user, "v_exact", None))


def _value_chain(update: StateUpdateOp, value: SSAValue, absorb_rope: bool):
    """(source, views, rope, quantize, scales, centre, exact_rows): walk back from the written
    value through single-use views that only drop or add leading size-1 dims, one quantize_fp8,
    the sub of a smoothed cache's offset before it (`centre`) and (when `absorb_rope`) one rope.
    `source` is the value before all of them (the region's k or v input). Per-token `scales`
    computed from the quantized rows (else None): their abs is the rows' other reader. The
    quantize's input may also be read unrounded (exact-recent's attentions and ring writes):
    `exact_rows`, which the region then outputs (None where that is `source` itself)."""
    views: list[Operation] = []
    rope = quantize = scales = centre = exact_rows = None
    stop_at_exact = None  # the walk's result had it stopped at the exact rows
    user: Operation = update
    while True:
        if not _read_only_by(value, user, scales):
            exact = quantize is not None and user is quantize and exact_rows is None
            others = {use.operation for use in value.uses} - {user}
            if not (exact and others and all(_read_exactly(value, other) for other in others)):
                break
            exact_rows, stop_at_exact = value, (value, list(views), rope, quantize, scales, centre, None)
        producer = value.owner
        target = getattr(producer, "target", None)
        # (views are bypassed, not in the region: the exact rows must be what the region computes,
        # its centring, rebuilt on the 4-D value below)
        if target is not None and not isinstance(producer, StateUpdateOp) and target.data in _VIEWS \
                and (exact_rows is None or centre is not None):
            source = producer.inputs[0]
            if _strip_leading_ones(dims(source)) != _strip_leading_ones(dims(value)):
                break
            views.append(producer)
        elif isinstance(producer, QuantizeFp8Op) and quantize is None:
            quantize, source = producer, producer.x
            if producer.granularity.data == "per-token":
                scales = read_row_scales(producer.scale)
                scales = scales if scales is not None and scales.x is source else None
        elif quantize is not None and centre is None and rope is None and _cache_offset(producer) is not None:
            centre, source = producer, producer.inputs[0]
        elif isinstance(producer, RopeOp) and absorb_rope:
            rope, source = producer, producer.x
        else:
            break
        user, value = producer, source
        if rope is not None:
            break
    if exact_rows is not None and centre is not None \
            and dims(rope.results[0] if rope is not None else value) != dims(exact_rows):
        return stop_at_exact  # (the centring rebuilt on the 4-D value would not be the rows read)
    return value, views, rope, quantize, scales, centre, None if exact_rows is value else exact_rows


def _cache_offset(op) -> SSAValue | None:
    """The offset weight when `op` is fp8-kv-cache's smooth-k / smooth-v centring, sub(x, offset)
    with offset a `<cache>.offset` weight [1, Hkv, 1, D] fp32 of x's heads and channels; else None."""
    if aten_target(op) != "aten.sub.Tensor" or len(op.inputs) != 2 or op.call["args"] != [{"$t": 0}, {"$t": 1}] \
            or op.call["kwargs"]:
        return None
    x, offset = op.inputs
    weight = offset.owner
    if not (isinstance(weight, WeightOp) and weight.ref.data.endswith(".offset") and offset.type.element_type == f32):
        return None
    shape, x_shape = dims(offset), dims(x)
    return offset if len(x_shape) == 4 and shape == [1, x_shape[1], 1, x_shape[3]] else None


def read_write(update: StateUpdateOp, absorb_rope: bool, absorb_quantize: bool) -> Write | str:
    """`update` as a cache write with its value's chain, or why not (a counter's last part)."""
    found = _cache_write(update)
    if isinstance(found, str):
        return found
    cache, positions, value, rows, paged = found
    b_max, heads, _, head_dim = dims(cache)  # (a batch view: the B rows it writes)
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
    source, chain_views, rope, quantize, scales, centre, exact_rows = _value_chain(user, value, absorb_rope)
    views += chain_views
    if quantize is not None and not absorb_quantize:
        return "quantized"
    if rows is not None:
        batch = dims(positions)[0]
        if not (isinstance(batch, int) and batch <= b_max) or dims(source) != [batch, heads, 1, head_dim]:
            return "shape"  # one [Hkv, D] row per sequence, at most the cache's batch
    elif dims(source) != [b_max, heads, dims(positions)[0], head_dim]:
        return "shape"  # not the whole indexed shape: index_put_ would broadcast it
    # the first B rows of a dynamic batch: the region takes the whole buffer
    whole, view = _whole_buffer(cache)
    write = Write(update, whole, positions, source, views, rope, quantize, rows, paged, batch_view=view, centre=centre,
                  exact_rows=exact_rows)
    if quantize is not None and quantize.granularity.data == "per-token":
        write.scales = _scale_write(write, scales)
        if write.scales is None:
            return "per_token"
    return write


def _scale_write(write: Write, scales: RowScales | None) -> ScaleWrite | None:
    """The write of a per-token quantize's scales, `scales` computed from its rows, when nothing
    else reads them and they go into a scale buffer [B_max, Hkv, S_max] (pool [N, Hkv, P]) at the
    rows' positions in the rows' form (per row, shared, paged through the same table); else None."""
    if scales is None:
        return None
    s = write.quantize.scale
    readers = {use.operation for use in s.uses} - {write.quantize}
    reader = readers.pop() if len(readers) == 1 else None
    update = reader if isinstance(reader, StateUpdateOp) else only_user(reader.results[0]) if reader else None
    found = _cache_write(update, rank=3) if isinstance(update, StateUpdateOp) else "not_index_put"
    if isinstance(found, str):
        return None
    written, positions, stored, rows, paged = found
    buffer, view = _whole_buffer(written)  # (a dynamic batch's first B rows, as the cache's write)
    if (view is None) != (write.batch_view is None):
        return None
    if positions is not write.positions or (rows is None) != (write.rows is None) or dims(buffer) != dims(write.cache)[:3]:
        return None
    if (paged is None) != (write.paged is None) or (paged is not None and (
            paged.table is not write.paged.table or paged.page_size != write.paged.page_size)):
        return None
    if rows is not None:  # stores select(s, 2, 0): each sequence's [Hkv] scales
        if aten_target(reader) != "aten.select.int" or stored is not reader.results[0] \
                or literal_arg(reader, 1) != 2 or literal_arg(reader, 2) != 0:
            return None
        return ScaleWrite(scales, update, buffer, [reader], paged)
    # shared: stores s [B, Hkv, T] (paged: permuted, the permute among the page arithmetic)
    expected = paged.index_ops[-1] if paged is not None else update
    return ScaleWrite(scales, update, buffer, [], paged, view) if stored is s and reader is expected else None


def pair(first: Write, second: Write) -> tuple[Write, Write] | str:
    """(k, v) of two writes of one step, or why they are not one."""
    if first.cache is second.cache or dims(first.cache) != dims(second.cache):
        return "pair"
    k, v = (second, first) if second.rope is not None else (first, second)
    # fp8-kv-cache{values-only}: the keys kept in their dtype, the values quantized (calibrated scales)
    values_only = (k.quantize is None and v.quantize is not None and v.scales is None
                   and v.quantize.granularity.data in ("per-tensor", "per-head"))
    if first.cache.type.element_type != second.cache.type.element_type and not values_only:
        return "pair"
    if not values_only and ((first.quantize is None) != (second.quantize is None) or (
        first.quantize is not None and first.quantize.granularity.data != second.quantize.granularity.data
    )):
        return "quant_mismatch"
    if first.rope is not None and second.rope is not None:
        return "two_ropes"
    if first.scales is not None and first.scales.scales.headroom != second.scales.scales.headroom:
        return "quant_mismatch"
    if (first.rows is None) != (second.rows is None) or (first.paged is None) != (second.paged is None):
        return "pair"
    if first.paged is not None and (first.paged.table is not second.paged.table
                                    or first.paged.page_size != second.paged.page_size):
        return "pair"
    return k, v
