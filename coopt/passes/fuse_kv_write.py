"""fuse-kv-write: a layer's two KV-cache writes (plus K's rotary embedding and the fp8
quantization of both values) become one `kv_write` region (schema in coopt/ir/region.py and
docs/kv-cache.md): one launch per layer and step instead of a rope kernel, two index_put_ and,
with an fp8 cache, two quantize kernels.

Matched: two `coopt.state_update` (aten.index_put_, indices [None, None, positions]) of two
cache buffers [B_max, Hkv, S_max, D] (`coopt.weight` state buffers) in one block, with the same
positions operand and values of the indexed shape [B_max, Hkv, T, D]. Walking back from each
written value through producers whose only user is the chain: views that only drop or add
leading size-1 dims (a batch-1 export writes k as [Hkv, T, D]), one `coopt.quantize_fp8`
(the same granularity on K and V; per-token below), and on K one `coopt.rope` (kept
outside when anything else reads it: fuse-rope then gives it its own region). The region's
outputs are the caches after the write; they replace the state_update results, so the attention
that follows reads the written caches. The region body is the original ops, so the reference
module does the same index_put_ on its input (an in-place region: "inplace" [0, 1]).

The matching (which writes, which chains) is coopt/passes/kv_write_match.py's.

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

Per-token fp8 (fp8-kv-cache{granularity=per-token}): the quantize's scales are computed from the
rows it quantizes (abs -> amax -> fp32 -> clamp_min -> mul, `fp8_kv_cache.read_row_scales`) and
written into a scale buffer [B_max, Hkv, S_max] (a pool [N, Hkv, P] when paged) at the rows'
positions, in the same form as the cache write (per row: select(s, 2, 0); paged: through the same
page table). The region takes both: inputs k_scale, v_scale are the scale buffers, written in
place ("inplace" [0, 1, i, i + 1], outputs the caches and the scale buffers after the write),
attrs "quant": "per-token", "headroom"; the kernel computes each row's scale itself. Counted
`fuse.kv_write.per_token`.

A dynamic batch's write of its B rows (`index_put_` through `slice(cache, 0, 0, B)`, as
inplace-state-writes leaves it) takes the whole cache as the region's input and slices it inside,
B from the written value's batch (`sym_size(value, 0)`: the outer B is a size from outside the
region): the kernel writes rows [0, B) (per-token: of the scale buffers too). Counted
`fuse.kv_write.batch_view`.

exact-recent (fp8-kv-cache): where attentions (and ring writes) also read a quantized write's
rows before rounding, those rows no longer stop the walk at the quantize: the region takes K's
rope and centring as ever and outputs the rows it computes before rounding (attrs
"exact_outputs": ["k"] / ["k", "v"], after the written buffers), which those readers then read.
One launch where a rope kernel, a sub and the write were three (bench/RESULTS.md session 44).
Counted `fuse.kv_write.exact_rows`.

Left unfused, each with a counter `fuse.kv_write.skipped.<why>`: a write into another slice of the
cache (`sliced_cache`), a value that is not the whole indexed shape
(index_put_ would broadcast it over the batch), per-token fp8 whose scales are not that
computation written once beside the cache (`per_token`), and a write with no partner. Writes of
scale buffers are taken with their cache's write, never on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import IndexType, ModuleOp, TensorType
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.ir.dialect import AtenOp, QuantizeFp8Op, StateUpdateOp
from coopt.ir.outline import can_outline, outline
from coopt.passes.base import CooptPass, aten_target
from coopt.passes.fp8_kv_cache import read_row_scales, row_scales
from coopt.passes.kv_write_match import NOT_CACHE_WRITES, Write, pair, read_write
from coopt.passes.paged_kv import PagedWrite
from coopt.passes.shapes import dims
from coopt.passes.stats import count


@dataclass(frozen=True)
class FuseKvWrite(CooptPass):
    name = "fuse-kv-write"
    summary = "a step's K and V cache writes (+ K's rope, + fp8 quantization) → one kv_write region"

    # absorb the rope producing K (when only the write reads it)
    rope: bool = True
    # absorb the coopt.quantize_fp8 of the written values (fp8-kv-cache); off: leave such writes
    quantize: bool = True

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        pending: dict[tuple, Write] = {}  # (block, positions) -> an unpaired write
        for update in [o for o in op.walk() if isinstance(o, StateUpdateOp)]:
            write = read_write(update, self.rope, self.quantize)
            if isinstance(write, str):
                if write not in NOT_CACHE_WRITES:
                    count(f"fuse.kv_write.skipped.{write}")
                continue
            key = (update.parent_block(), write.positions)
            partner = pending.pop(key, None)
            if partner is None:
                pending[key] = write
                continue
            k_and_v = pair(partner, write)
            if isinstance(k_and_v, str):
                count(f"fuse.kv_write.skipped.{k_and_v}")
                pending[key] = write  # the later one may pair with a write still to come
                continue
            self._fuse(*k_and_v)
        for _ in pending.values():
            count("fuse.kv_write.skipped.unpaired")

    @staticmethod
    def _fuse(k: Write, v: Write) -> None:
        # the group as it stands (views and quantize included): nothing outside it may read it
        # between its first op and the write the region replaces
        group = [op for w in (k, v) for op in (w.rope, w.centre, *w.views, w.quantize, *_scale_ops(w),
                                               *_index_ops(w), w.batch_view, w.update) if op is not None]
        if not can_outline(group):
            count("fuse.kv_write.skipped.order")
            return
        rows = _own_rows(k, v)
        ops = [*([rows] if rows is not None else []), *_normalize(k), *_normalize(v)]
        inputs = [k.cache, v.cache, k.positions, k.source, v.source]
        outputs = [k.update.results[0], v.update.results[0]]
        if k.rope is not None:
            inputs += [k.rope.cos, k.rope.sin]
        attrs = {
            "rope": k.rope is not None,
            "quant": v.quantize.granularity.data if v.quantize is not None else "none",
            "inplace": [0, 1],
        }
        if k.quantize is None and v.quantize is not None:  # values-only: V's scale alone
            attrs["values_only"] = True
            inputs.append(v.quantize.scale)
            count("fuse.kv_write.values_only")
        if k.scales is not None:  # per-token: the scale buffers, written in place beside the caches
            inputs += [k.scales.buffer, v.scales.buffer]
            outputs += [k.scales.update.results[0], v.scales.update.results[0]]
            attrs.update({"inplace": [0, 1, len(inputs) - 2, len(inputs) - 1], "headroom": k.scales.scales.headroom})
        elif k.quantize is not None:
            inputs += [k.quantize.scale, v.quantize.scale]
        for write, knob in ((k, "k_offset"), (v, "v_offset")):  # smooth-k / smooth-v: the offsets, after the scales
            if write.centre is not None:
                inputs.append(write.centre.inputs[1])
                attrs[knob] = True
        if rows is not None:
            # positions [B], one per row, each within the cache's dim 2 (what verification draws)
            attrs.update({"positions": "per-row", "index_input": 2, "index_bound": [0, 2]})
        if k.paged is not None:
            # the page table last; positions within max_pages * P (index_bound: the table's dim 1, in pages)
            inputs.append(k.paged.table)
            attrs.update({"page_size": k.paged.page_size, "page_table_input": len(inputs) - 1, "pool_input": 0})
            if rows is not None:
                attrs["index_bound"] = [len(inputs) - 1, 1]
        # exact-recent: the rows before rounding that attentions also read unrounded (K's rope and
        # centring now inside), after the written buffers
        exact = [(name, w.exact_rows) for name, w in (("k", k), ("v", v)) if w.exact_rows is not None]
        if exact:
            attrs["exact_outputs"] = [name for name, _ in exact]
            outputs += [rows_value for _, rows_value in exact]
            count("fuse.kv_write.exact_rows")
        # a value passed twice (one scale weight for K and V) is two kernel inputs, in schema order
        outline(ops, "kv_write", attrs, inputs=inputs, outputs=outputs)
        count("fuse.kv_write")
        if k.rope is not None:
            count("fuse.kv_write.rope")
        if k.quantize is not None:
            count("fuse.kv_write.quantized")
        if k.scales is not None:
            count("fuse.kv_write.per_token")
        if rows is not None:
            count("fuse.kv_write.per_row")
        if k.paged is not None:
            count("fuse.kv_write.paged")
        if k.batch_view is not None:
            count("fuse.kv_write.batch_view")
        if k.centre is not None:
            count("fuse.kv_write.smooth_k")
        if v.centre is not None:
            count("fuse.kv_write.smooth_v")


def _index_ops(write: Write) -> list[Operation]:
    """A paged write's page arithmetic (and a shared write's permute), the scale write's too:
    inside the region."""
    return [op for _, paged in write.updates() if paged is not None for op in paged.index_ops]


def _scale_ops(write: Write) -> list[Operation]:
    """Per-token: the scales' computation, the select a per-row write stores, the scale write."""
    scales = write.scales
    if scales is None:
        return []
    return [*scales.scales.ops, *scales.views, *([scales.batch_view] if scales.batch_view else []), scales.update]


def _own_rows(k: Write, v: Write) -> Operation | None:
    """Per-row writes: a fresh arange(B) for the region's body (the batch index has no operands,
    so it belongs inside), used by both writes; the old one goes when nothing else reads it."""
    if k.rows is None:
        return None
    rows = k.rows.clone()
    writers = [[*_index_ops(w), *(update for update, _ in w.updates())] for w in (k, v)]
    first = min((op for ops in writers for op in ops), key=_position)
    Rewriter.insert_op(rows, InsertPoint.before(first))
    for write, users in zip((k, v), writers):
        old = write.rows
        for user in users:  # the writes, or a paged write's page lookup
            if old.results[0] in user.operands:
                user.operands = [rows.results[0] if o is old.results[0] else o for o in user.operands]
        write.rows = rows
        if not old.results[0].uses and old.parent is not None:
            old.detach()
            old.erase()
    return rows


def _position(op: Operation) -> int:
    return list(op.parent_block().ops).index(op)


def _normalize(write: Write) -> list[Operation]:
    """Rewrite the write to the schema's form, cache.index_put_([None, None, positions],
    quantize(rope(source))) with a [B_max, Hkv, T, D] value (per row: select(..., 2, 0) of a
    [B, Hkv, 1, D] one; paged: through the page arithmetic), and return its ops.

    The views it bypasses only drop leading size-1 dims, which index_put_ broadcasts back: the
    write is the same. They go (they may carry symbolic sizes, which a region cannot take as
    inputs), and a quantize_fp8 behind one is rebuilt on the 4-D value, per-token with its
    scales' computation and their write."""
    value = write.rope.results[0] if write.rope is not None else write.source
    ops: list[Operation] = [write.rope] if write.rope is not None else []
    dead = list(write.views)
    if write.scales is not None:
        old = write.scales
        dead += [*old.scales.ops, *old.views]
        # the same computation on the 4-D rows, where the old one started (before its write)
        scales = read_row_scales(row_scales(value, old.scales.headroom, before=old.scales.ops[0]))
        ops += scales.ops
        if old.batch_view is not None:  # the scale buffer's first B rows, as the cache's below
            ops += _through_rows_view(old.update, old.buffer, value, old.batch_view)
            dead.append(old.batch_view)
        stored, gone = _store(old.update, old.paged, write.rows, scales.ops[-1].results[0])
        ops += stored
        dead += gone
    if write.centre is not None:  # smooth-k: K less its offset, between rope and quantize
        old = write.centre
        dead.append(old)
        centre = AtenOp(old.target.data, old.call, [value, old.inputs[1]],
                        [TensorType(old.results[0].type.element_type, value.type.get_shape(), value.type.encoding)])
        Rewriter.insert_op(centre, InsertPoint.before(write.update))
        if write.exact_rows is old.results[0]:  # exact-recent's readers read the region's output of it
            old.results[0].replace_all_uses_with(centre.results[0])
            write.exact_rows = centre.results[0]
        write.centre = centre
        value = centre.results[0]
        ops.append(centre)
    if write.quantize is not None:
        old = write.quantize
        dead.append(old)
        element = old.results[0].type.element_type
        quantized_type = TensorType(element, value.type.get_shape(), value.type.encoding)
        scale = scales.ops[-1].results[0] if write.scales is not None else old.scale
        new = QuantizeFp8Op(value, scale, old.granularity.data, quantized_type)
        Rewriter.insert_op(new, InsertPoint.before(write.update))
        write.quantize = new
        value = new.results[0]
        ops.append(new)
    if write.batch_view is not None:  # the first B rows of the whole buffer, B from the value
        view = _through_rows_view(write.update, write.cache, value, write.batch_view)
        ops += view
        dead.append(write.batch_view)
        write.batch_view = view[-1]
    stored, gone = _store(write.update, write.paged, write.rows, value)
    ops += stored  # (outline orders a region's ops as the block does)
    dead += gone
    while dead:  # consumers before producers: erase whatever nothing reads any more
        unused = [op for op in dead if not op.results[0].uses]
        for op in unused:
            dead.remove(op)
            op.detach()
            op.erase()
        if not unused:
            break
    return ops


def _through_rows_view(update: StateUpdateOp, buffer: SSAValue, value: SSAValue, old: Operation) -> list[Operation]:
    """Make `update` write through the region's own slice(buffer, 0, 0, B), B the written value's
    batch, instead of the `old` view (whose B is a size from outside, which a region cannot take
    as an input; the value's batch is the same size); returns the view's ops, inserted before
    `update`."""
    batch = dims(value)[0]
    ops: list[Operation] = []
    if isinstance(batch, int):
        end, operands = batch, [buffer]
    else:
        size = AtenOp("aten.sym_size.int", {"args": [{"$t": 0}, 0], "kwargs": {}}, [value], [IndexType()])
        ops.append(size)
        end, operands = {"$t": 1}, [buffer, size.results[0]]
    view = AtenOp("aten.slice.Tensor", {"args": [{"$t": 0}, 0, 0, end], "kwargs": {}}, operands, [old.results[0].type])
    ops.append(view)
    Rewriter.insert_op(ops, InsertPoint.before(update))
    operands = list(update.operands)
    operands[update.call["args"][0]["$t"]] = view.results[0]
    update.operands = operands
    return ops


def _store(update: StateUpdateOp, paged: PagedWrite | None, rows: Operation | None, value: SSAValue):
    """(ops, old ops): make `update` store `value` ([B, Hkv, T, ...]) in the schema's form:
    select(value, 2, 0) per row, permuted into a shared paged write, else as it is; the ops are
    those and a paged write's page arithmetic, then the write."""
    ops, dead = [], []
    if rows is not None:  # per row: each sequence's one row (T = 1), select(x, 2, 0)
        batch, heads, _, *rest = dims(value)
        select = AtenOp("aten.select.int", {"args": [{"$t": 0}, 2, 0], "kwargs": {}}, [value],
                        [TensorType(value.type.element_type, [batch, heads, *rest])])
        Rewriter.insert_op(select, InsertPoint.before(update))
        value = select.results[0]
        ops.append(select)
    ops += [op for op in (paged.index_ops if paged is not None else []) if aten_target(op) != "aten.permute.default"]
    if paged is not None and rows is None:  # a shared paged write stores [B, T, Hkv, ...]
        old = paged.index_ops[-1]
        dead.append(old)
        permute = AtenOp(old.target.data, old.call, [value], [old.results[0].type])
        Rewriter.insert_op(permute, InsertPoint.before(update))
        value = permute.results[0]
        ops.append(permute)
    operands = list(update.operands)
    operands[update.call["args"][2]["$t"]] = value
    update.operands = operands
    return [*ops, update], dead
