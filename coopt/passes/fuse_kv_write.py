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

from coopt.ir.dialect import KernelOp, QuantizeFp8Op, RopeOp, StateUpdateOp, WeightOp
from coopt.ir.outline import can_outline, outline
from coopt.passes.base import CooptPass, literal_arg, tensor_arg
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
    source: SSAValue  # the [B_max, Hkv, T, D] value the region reads
    views: list[Operation]  # leading-1 views between source and the write: bypassed, erased
    rope: RopeOp | None
    quantize: QuantizeFp8Op | None


def _strip_leading_ones(shape: list) -> list:
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def _cache_write(update: StateUpdateOp) -> tuple[SSAValue, SSAValue, SSAValue] | str:
    """(cache, positions, value) of `cache.index_put_([None, None, positions], value)`, or why not."""
    if isinstance(update.parent_op(), KernelOp):
        return "not_index_put"
    if update.target.data == "coopt.slice_copy_":
        source = tensor_arg(update, 1)
        if source is not None and getattr(source.owner, "target", None) is not None \
                and source.owner.target.data == "aten.index_put.default":
            return "sliced_cache"  # cache[:B, :, pos] = k with B < B_max: index_put of a slice, copied back
    if update.target.data != "aten.index_put_.default":
        return "not_index_put"
    indices = literal_arg(update, 1)
    accumulate = literal_arg(update, 3, "accumulate", False)
    if not (isinstance(indices, list) and len(indices) == 3 and indices[:2] == [None, None]) or accumulate:
        return "indices"
    cache, value = tensor_arg(update, 0), tensor_arg(update, 2)
    positions = update.inputs[indices[2]["$t"]] if isinstance(indices[2], dict) and "$t" in indices[2] else None
    if cache is None or value is None or positions is None:
        return "indices"
    if not isinstance(cache.owner, WeightOp):
        return "sliced_cache"  # slice(cache, 0, 0, B): a dynamic batch, not fused yet
    if len(dims(cache)) != 4 or len(dims(positions)) != 1:
        return "shape"
    return cache, positions, value


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
    cache, positions, value = found
    source, views, rope, quantize = _value_chain(update, value, absorb_rope)
    if quantize is not None and not absorb_quantize:
        return "quantized"
    b_max, heads, _, head_dim = dims(cache)
    if dims(source) != [b_max, heads, dims(positions)[0], head_dim]:
        return "shape"  # not the whole indexed shape: index_put_ would broadcast it
    if quantize is not None and quantize.granularity.data not in _FUSED_GRANULARITIES:
        return "per_token"
    return _Write(update, cache, positions, source, views, rope, quantize)


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
        group = [op for w in (k, v) for op in (w.rope, *w.views, w.quantize, w.update) if op is not None]
        if not can_outline(group):
            count("fuse.kv_write.skipped.order")
            return
        ops = [*_normalize(k), *_normalize(v)]
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
        # a value passed twice (one scale weight for K and V) is two kernel inputs, in schema order
        outline(ops, "kv_write", attrs, inputs=inputs, outputs=[k.update.results[0], v.update.results[0]])
        count("fuse.kv_write")
        if k.rope is not None:
            count("fuse.kv_write.rope")
        if k.quantize is not None:
            count("fuse.kv_write.quantized")


def _normalize(write: _Write) -> list[Operation]:
    """Rewrite the write to the schema's form, cache.index_put_([None, None, positions],
    quantize(rope(source))) with a [B_max, Hkv, T, D] value, and return its ops in order.

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
