"""fp8-kv-cache (lossy): KV caches stored as float8_e4m3fn, with scales (docs/kv-cache.md).

A decode step streams its whole KV cache every token: halving its bytes (bf16 → fp8) halves the
attention's memory traffic and doubles the context that fits. The pass finds each cache (a
`coopt.weight` state buffer written by index_put and read as k / v by decode_attention /
cache_attention), retypes it and every view of it to float8_e4m3fn, routes each write's value
through `coopt.quantize_fp8`, and gives each attention its `k_scale` / `v_scale`.

Where the scales come from (`scale-source`):
- calibration (granularity per-tensor | per-head): the build runs the original model on the
  calibration inputs before the passes and records, per cache buffer, the absmax of its contents
  per kv head, the mean of each (head, channel) and the largest distance from it, in the module
  attribute `coopt.kv_calibration` (JSON {buffer ref: {"absmax", "mean", "centred_absmax"}}:
  fp8_cache.calibrate_kv_absmax; `coopt opt` reads it from the IR text). Scale =
  max(absmax, SCALE_FLOOR) · headroom / FP8_MAX, one per head or the largest for the tensor; a
  weight `<buffer ref>.scale` (fp32, [Hkv] or [1]). With `smooth-k`, each key cache stores
  k - mean (a weight `<buffer ref>.offset`, fp32 [1, Hkv, 1, D], subtracted before the write's
  quantize_fp8) scaled by the centred range: attention reads it as it is, since a query's
  scores all move by q . mean, which softmax ignores.
- dynamic (granularity per-token): a state buffer `<buffer ref>.scale` [B_max, Hkv, S_max] fp32
  beside each cache, written at the same positions as the cache with each written row's scale:
  s = clamp_min(amax(abs(x), -1) as fp32, SCALE_FLOOR) · (headroom / FP8_MAX), a few ATen ops
  before the write (`row_scales`) that fuse-kv-write absorbs into its kv_write region
  (`read_row_scales` recognises them). A ragged step's per-row write (indices [arange(B), None,
  positions]) stores each row's [B, Hkv] scales the same way; paged-kv pages the scale buffers
  like their caches.

values-only (calibration only): only the caches read as V are retyped and quantized; each key
cache keeps its dtype and gets a scale weight of ones, so its attentions still take two scales
(k * 1.0 is exact) and fuse-kv-write pairs its plain write with the quantized V write.

The pass touches no data: it records in the module attribute `coopt.fp8_kv_cache` (JSON
{"granularity", "headroom", "caches": {cache ref: scale ref}, "scales": {scale ref: [values]}
(calibration only), with smooth-k "offsets": {cache ref: offset ref} and "offset_values":
{offset ref: [[mean per channel] per head]}, with values-only "unit_scales": {key cache ref:
scale ref}, key caches kept in their dtype whose scales are ones}, with exact-recent "recent":
{"window": N, "rings": {cache ref: ring ref}, "dtypes": {ring ref: dtype}}) what the emitter (`compile.program_weights`) materialises: scale weights
from those values, per-token scale buffers from the caches' existing contents, and each cache
quantized with its scale. Lossy: never in the default pipeline; `--kv-cache fp8` adds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ArrayAttr, Float8E4M3FNType, ModuleOp, StringAttr, TensorType, f32
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.errors import ConfigError
from coopt.ir.dialect import (
    KV_SCALE_GRANULARITIES,
    AtenOp,
    CacheAttentionOp,
    DecodeAttentionOp,
    KernelOp,
    QuantizeFp8Op,
    StateUpdateOp,
    WeightOp,
)
from coopt.ir.summary import dtype_name
from coopt.passes.base import CooptPass, aten_target, insert_aten, literal_arg
from coopt.passes.stats import count

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-12  # absmax floor: an all-zero head or row still gets a finite, nonzero scale
CALIBRATION_ATTR = "coopt.kv_calibration"  # set by the build (compile.py) before the passes
FP8_ATTR = "coopt.fp8_kv_cache"  # set by this pass, read by the emitter
SCALE_SOURCES = ("calibration", "dynamic")
LEGAL = {"calibration": ("per-tensor", "per-head"), "dynamic": ("per-token",)}

_SLICE = "aten.slice.Tensor"
MAX_EXACT_RECENT = 64  # rows of the exact window: past that the ring's bytes stop being small
RING_WRITE = "coopt.ring_write_"  # StateUpdateOp target of the exact-recent rings


def scale_ref(cache_ref: str) -> str:
    """The state name of a cache's scales (a weight, or a per-token state buffer)."""
    return cache_ref + ".scale"


def scale_buffers(module: ModuleOp) -> list[str]:
    """State names of the per-token scale buffers the pass made in `module` (fp32 state the
    program writes with fp32 scales: the built model keeps them fp32 through a dtype cast, as it
    keeps the fp8 caches fp8); [] without per-token scales."""
    attr = module.attributes.get(FP8_ATTR)
    record = json.loads(attr.data) if attr is not None else {}
    return sorted(record["caches"].values()) if record.get("granularity") == "per-token" else []


@dataclass(frozen=True)
class Fp8KvCache(CooptPass):
    name = "fp8-kv-cache"
    summary = "KV caches stored as float8_e4m3fn with per-tensor/per-head (calibrated) or per-token (dynamic) scales"
    lossy = True

    granularity: str = "per-head"  # per-tensor | per-head | per-token
    scale_source: str = "calibration"  # calibration | dynamic
    headroom: float = 1.0  # scale = absmax * headroom / 448: > 1 leaves room above the calibrated range
    # keys minus their calibrated per-(head, channel) mean before rounding, scaled by the centred
    # range: exact for attention (q . mean is the same for every key of a query; softmax ignores
    # it), and it shrinks the rounding error of channels with a large common offset
    # (bench/fp8_kv_probe.py: KL 1.75e-3 -> 1.00e-3, top-1 98.24 -> 98.78 % on the harness model)
    smooth_k: bool = False
    # values minus their calibrated per-(head, channel) mean before rounding, the mean added back
    # to the attention's output (exact: a query's probabilities sum to 1, so attention over
    # v - mean is attention over v, less the mean); one add after each attention
    smooth_v: bool = False
    # only the value caches in fp8, the keys kept in the model's dtype (their attentions read
    # them with a unit scale): 3/4 of the cache bytes, but on the harness model the keys'
    # rounding is most of fp8's top-1 cost (bench/RESULTS.md session 11's probe: V alone 99.13 %,
    # both 98.03-98.60 %)
    values_only: bool = False
    # each query reads its newest N keys unrounded (0: none): the rows its own call writes from
    # the values the writes store before rounding, older ones in the window from a ring of the
    # last N rows written (a state buffer `<cache>.recent` [B_max, Hkv, N, D] beside each cache,
    # written after the attention), the rest from the cache (KIVI's full-precision residual).
    # bench/fp8_kv_probe.py (session 43, CPU): newest 1 / 2 / 4 exact take the top-1 from 98.29 %
    # to 98.57 / 98.88 / 99.19 %. Needs each sequence's positions written in increasing order (a
    # ring slot holds the newest row of its residue). Where a write's positions are not provably
    # the attention's lengths - 1 the attention reads every row from the cache (counted skipped).
    exact_recent: int = 0

    def __post_init__(self):
        if self.granularity not in KV_SCALE_GRANULARITIES:
            raise ConfigError(f"fp8-kv-cache: knob granularity={self.granularity!r} is not one of {', '.join(KV_SCALE_GRANULARITIES)}")
        if self.scale_source not in SCALE_SOURCES:
            raise ConfigError(f"fp8-kv-cache: knob scale-source={self.scale_source!r} is not one of {', '.join(SCALE_SOURCES)}")
        if self.granularity not in LEGAL[self.scale_source]:
            raise ConfigError(
                f"fp8-kv-cache: knob granularity={self.granularity} does not go with scale-source={self.scale_source} "
                f"(calibration: per-tensor or per-head; dynamic: per-token)")
        if not float(self.headroom) >= 1.0:
            raise ConfigError(f"fp8-kv-cache: knob headroom={self.headroom} must be a number >= 1.0")
        if not (isinstance(self.exact_recent, int) and 0 <= self.exact_recent <= MAX_EXACT_RECENT):
            raise ConfigError(f"fp8-kv-cache: knob exact-recent={self.exact_recent!r} must be a whole number of rows "
                              f"from 0 to {MAX_EXACT_RECENT}")
        if self.values_only and (self.scale_source != "calibration" or self.smooth_k):
            raise ConfigError("fp8-kv-cache: knob values-only keeps the keys in the model's dtype: it goes with "
                              "calibrated scales (per-tensor or per-head), not with scale-source=dynamic or smooth-k")
        for knob, on, what in (("smooth-k", self.smooth_k, "keys'"), ("smooth-v", self.smooth_v, "values'")):
            if on and self.scale_source != "calibration":
                raise ConfigError(f"fp8-kv-cache: knob {knob} needs calibrated scales (scale-source=calibration: "
                                  f"per-tensor or per-head); the {what} means come from the calibration")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        caches = find_caches(op)
        if not caches:
            raise ConfigError(
                "fp8-kv-cache: the model has no KV cache to store in fp8 (no state buffer written by index_put "
                "and read as k/v by a decode or cache attention); drop --kv-cache fp8 / the fp8-kv-cache pass")
        record = {"granularity": self.granularity, "headroom": float(self.headroom), "caches": {}, "scales": {}}
        calibration = _calibration(op) if self.scale_source == "calibration" else {}
        value_refs = _value_refs(caches)
        scales: dict[SSAValue, SSAValue] = {}  # cache value (any view) -> its scale value
        if self.values_only:  # the key caches stay as they are, read with a unit scale
            keys = _caches_read_as(op, value_refs, "k")
            record["unit_scales"] = {}
            for ref in sorted(keys):
                scales.update(self._unit_scale(caches.pop(ref), record))
            value_refs = _value_refs(caches)
        smoothed_values = _caches_read_as(op, value_refs, "v") if self.smooth_v else set()
        smoothed = (_caches_read_as(op, value_refs, "k") if self.smooth_k else set()) | smoothed_values
        if smoothed:
            record["offsets"], record["offset_values"] = {}, {}
        for ref, cache in caches.items():
            weight = cache.weight
            shape = weight.results[0].type.get_shape()
            offset = None
            if self.scale_source == "calibration":
                values = self._calibrated_scales(ref, calibration, shape[1], centred=ref in smoothed)
                scale = WeightOp(scale_ref(ref), TensorType(f32, [len(values)]))
                record["scales"][scale_ref(ref)] = values
                if ref in smoothed:
                    offset = WeightOp(offset_ref(ref), TensorType(f32, [1, shape[1], 1, shape[3]]))
                    Rewriter.insert_op(offset, InsertPoint.after(weight))
                    record["offsets"][ref] = offset_ref(ref)
                    record["offset_values"][offset_ref(ref)] = _entry(calibration, ref)["mean"]
                    count("fp8_kv_cache.smoothed_values" if ref in smoothed_values else "fp8_kv_cache.smoothed_keys")
            else:
                scale = WeightOp(scale_ref(ref), TensorType(f32, list(shape[:3])))
            Rewriter.insert_op(scale, InsertPoint.after(weight))
            record["caches"][ref] = scale_ref(ref)
            scales.update(self._quantize_writes(cache, scale.results[0], offset.results[0] if offset is not None else None))
            count("fp8_kv_cache.buffers")
        value_refs = _value_refs(caches)  # again: the writes above replaced the caches' views
        exact = 0  # attentions reading their newest keys unrounded (exact-recent)
        if self.exact_recent:
            record["recent"] = {"window": self.exact_recent, "rings": {}, "dtypes": {}}
        for attention in _attentions(op):
            if attention.k in scales and attention.v in scales:
                attention = _give_scales(attention, scales[attention.k], scales[attention.v], self.granularity)
                if value_refs.get(attention.v) in smoothed_values:
                    _add_value_offset(attention, value_refs[attention.v], record)
                if self.exact_recent:
                    exact += _read_recent_rows_exact(attention, self.exact_recent, record)
        if self.exact_recent and not exact:
            raise ConfigError(
                "fp8-kv-cache: knob exact-recent found no attention whose queries' own rows it can tell (each "
                "cache written at a user input's positions, read with that input + 1 as lengths); drop the knob")
        op.attributes[FP8_ATTR] = StringAttr(json.dumps(record, sort_keys=True))

    def _unit_scale(self, cache: _Cache, record: dict) -> dict[SSAValue, SSAValue]:
        """values-only: a key cache left in its dtype gets a scale weight of ones (one per head,
        or one), so that its attentions read fp8 values beside it with the same op; returns every
        value of the cache -> that scale."""
        ref = cache.weight.ref.data
        heads = cache.weight.results[0].type.get_shape()[1] if self.granularity == "per-head" else 1
        scale = WeightOp(scale_ref(ref), TensorType(f32, [heads]))
        Rewriter.insert_op(scale, InsertPoint.after(cache.weight))
        record["unit_scales"][ref] = scale_ref(ref)
        record["scales"][scale_ref(ref)] = [1.0] * heads
        count("fp8_kv_cache.unit_scales")
        return {v: scale.results[0] for member in [cache.weight, *cache.ops] for v in member.results}

    def _calibrated_scales(self, ref: str, calibration: dict, heads: int, centred: bool = False) -> list[float]:
        entry = _entry(calibration, ref)
        absmax = entry.get("centred_absmax" if centred else "absmax") if entry is not None else None
        if absmax is None or len(absmax) != heads:
            raise ConfigError(
                f"fp8-kv-cache{{scale-source=calibration}}: no calibration absmax for the {heads} heads of buffer '{ref}' "
                f"(the build records it in the module attribute {CALIBRATION_ATTR} before the passes run)")
        per_head = [max(float(a), SCALE_FLOOR) * self.headroom / FP8_MAX for a in absmax]
        return per_head if self.granularity == "per-head" else [max(per_head)]

    def _quantize_writes(self, cache: _Cache, scale: SSAValue, offset: SSAValue | None = None) -> dict[SSAValue, SSAValue]:
        """Retype the cache and its views to fp8, quantize what each write stores (minus `offset`,
        smoothed keys); returns cache value -> scale value (the weight itself, or per-token the
        scale buffer's matching view)."""
        per_token = self.granularity == "per-token"
        mirror: dict[SSAValue, SSAValue] = {cache.weight.results[0]: scale}
        for member in cache.ops:  # block order: writes, state updates and slices of the cache
            x = None
            if _is_write(member) and _per_row(member):
                if per_token:  # each row's scales, from the row it writes, into the scale buffer alike
                    x = _row_as_rank4(member)
                    scales = row_scales(x, self.headroom, member)  # [B, Hkv, 1]
                    b, heads, _ = scales.type.get_shape()
                    rows = insert_aten("aten.select.int", [{"$t": 0}, 2, 0], [scales], _tensor(f32, [b, heads], None),
                                       before=member)
                    self._mirror(member, rows, mirror)
                    _quantize_per_row(member, scales, self.granularity, x)
                else:
                    _quantize_per_row(member, scale, self.granularity, offset=offset)
                continue
            if _is_write(member):
                x = _rank4(member.operands[_write_value_index(member)], member)
            if per_token:
                self._mirror(member, None if x is None else row_scales(x, self.headroom, member), mirror)
            if x is not None:
                row_scale = mirror[member.operands[_write_value_index(member)]] if per_token else scale
                x = _centred(x, offset, member)
                quantized = QuantizeFp8Op(x, row_scale, self.granularity, _fp8(x.type))
                Rewriter.insert_op(quantized, InsertPoint.before(member))
                member.operands[_write_value_index(member)] = quantized.result
                count("fp8_kv_cache.quantized_writes")
        for value in [cache.weight.results[0], *(r for member in cache.ops for r in member.results)]:
            new = Rewriter.replace_value_with_new_type(value, _fp8(value.type))
            mirror[new] = mirror.pop(value, scale)
        return mirror if per_token else {v: scale for v in mirror}

    def _mirror(self, member: Operation, rows: SSAValue | None, mirror: dict) -> None:
        """Per-token: the same op on the scale buffer (the shape without D, fp32), inserted before
        `member`; a write stores `rows`, the scales of the rows it writes ([B, Hkv, T], or [B, Hkv]
        for a per-row write)."""
        operands = [mirror.get(v, v) for v in member.operands]
        if rows is not None:
            mirror[member.operands[_write_value_index(member)]] = rows
            operands[_write_value_index(member)] = rows
        result = member.results[0]
        if isinstance(member, StateUpdateOp):
            clone = StateUpdateOp(scale_ref(member.ref.data), member.target.data, member.call, operands, _scale_type(result.type))
        else:
            clone = AtenOp(member.target.data, member.call, operands, [_scale_type(result.type)])
        Rewriter.insert_op(clone, InsertPoint.before(member))
        mirror[result] = clone.results[0]


class _Cache:
    """A cache buffer's weight op and the ops that write or view it (block order)."""

    def __init__(self, weight: WeightOp, ops: list[Operation]):
        self.weight, self.ops = weight, ops


def find_caches(module: ModuleOp) -> dict[str, _Cache]:
    """{ref: _Cache} of every buffer that is only written by index_put (indices [None, None,
    positions]) and read as k or v by cache attentions, each of which reads two such buffers."""
    candidates: dict[str, _Cache] = {}
    for op in module.walk():
        if isinstance(op, WeightOp) and not isinstance(op.parent_op(), KernelOp) and len(op.results[0].type.get_shape()) == 4:
            ops = _cache_ops(op)
            if ops is not None and any(_attention_reads(v) for member in [op, *ops] for v in member.results):
                candidates[op.ref.data] = _Cache(op, ops)
    changed = True
    while changed:  # an attention converts only with both of its caches
        changed = False
        values = {v: ref for ref, c in candidates.items() for member in [c.weight, *c.ops] for v in member.results}
        for attention in _attentions(module):
            k_ref, v_ref = values.get(attention.k), values.get(attention.v)
            if (k_ref is None) != (v_ref is None) or attention.k_scale is not None:
                for ref in (k_ref, v_ref):
                    if ref is not None and ref in candidates:
                        del candidates[ref]
                        changed = True
    return candidates


def _cache_ops(weight: WeightOp) -> list[Operation] | None:
    """Ops reaching the buffer (views, writes) in block order, or None when something else
    reads it (that reader would see fp8 bytes)."""
    ref = weight.ref.data
    block = weight.parent_block()
    members: list[Operation] = []
    frontier = [weight.results[0]]
    seen: set[SSAValue] = set()
    writes = 0
    while frontier:
        value = frontier.pop()
        if value in seen:
            continue
        seen.add(value)
        for use in value.uses:
            user = use.operation
            if isinstance(user, (DecodeAttentionOp, CacheAttentionOp)) and use.index in (1, 2):
                continue
            if user.parent_block() is not block:
                return None
            target = aten_target(user)
            if target == _SLICE and use.index == 0 and literal_arg(user, 1) in (0, 1, 2):
                pass
            elif (target == "aten.index_put.default" or _is_index_put_(user)) and use.index == 0 and _row_indices(user):
                writes += 1
            elif isinstance(user, StateUpdateOp) and user.ref.data == ref and user.target.data == "coopt.slice_copy_" \
                    and use.index in (0, 1):
                pass
            else:
                return None
            if user not in members:
                members.append(user)
            frontier.extend(user.results)
    if not writes:
        return None
    order = {op: i for i, op in enumerate(block.ops)}
    return sorted(members, key=order.__getitem__)


def _is_index_put_(op: Operation) -> bool:
    return isinstance(op, StateUpdateOp) and op.target.data == "aten.index_put_.default"


def _is_write(op: Operation) -> bool:
    """index_put, functional or in place (its operand 0 is a cache view, `_cache_ops` checked)."""
    return aten_target(op) == "aten.index_put.default" or _is_index_put_(op)


def _row_indices(op) -> bool:
    """index_put(buffer, [None, None, positions], value): whole rows at some positions; or
    [arange(B), None, positions] (a ragged step: one row per sequence, at its own position)."""
    indices = literal_arg(op, 1)
    return (isinstance(indices, list) and len(indices) == 3 and (indices[0] is None or _per_row(op))
            and indices[1] is None and isinstance(indices[2], dict) and literal_arg(op, 3, "accumulate", False) is False)


def _per_row(op) -> bool:
    """A per-row write: indices [arange(B), None, positions]."""
    indices = literal_arg(op, 1)
    if not (isinstance(indices, list) and len(indices) == 3 and isinstance(indices[0], dict)):
        return False
    rows = op.inputs[indices[0]["$t"]].owner
    return aten_target(rows) in ("aten.arange.default", "aten.arange.start", "aten.arange.start_step") and not rows.inputs


def _row_as_rank4(write: Operation) -> SSAValue:
    """The [B, Hkv, 1, D] value whose select(., 2, 0) a per-row write stores ([B, Hkv, D] from
    elsewhere: unsqueezed to it)."""
    value = write.operands[_write_value_index(write)]
    select = value.owner
    if aten_target(select) == "aten.select.int" and literal_arg(select, 1) == 2 and literal_arg(select, 2) == 0:
        return select.inputs[0]
    b, heads, head_dim = value.type.get_shape()
    return insert_aten("aten.unsqueeze.default", [{"$t": 0}, 2], [value], TensorType(value.type.element_type, [b, heads, 1, head_dim]),
                       before=write)


def _quantize_per_row(write: Operation, scale: SSAValue, granularity: str, x: SSAValue | None = None,
                      offset: SSAValue | None = None) -> None:
    """A per-row write stores [B, Hkv, D] rows, select(x, 2, 0) of x [B, Hkv, 1, D]: quantize x
    (rank 4, heads on dim 1 as quantize_fp8 wants; per-token: `scale` [B, Hkv, 1]) and store
    select(quantize(x), 2, 0)."""
    index = _write_value_index(write)
    value = write.operands[index]
    select = value.owner
    x = _centred(x if x is not None else _row_as_rank4(write), offset, write)
    quantized = QuantizeFp8Op(x, scale, granularity, _fp8(x.type))
    Rewriter.insert_op(quantized, InsertPoint.before(write))
    rows = insert_aten("aten.select.int", [{"$t": 0}, 2, 0], [quantized.result], _fp8(value.type), before=write)
    write.operands[index] = rows
    if select is not None and isinstance(select, Operation) and not select.results[0].uses \
            and aten_target(select) == "aten.select.int":
        select.detach()
        select.erase()
    count("fp8_kv_cache.quantized_writes")


def offset_ref(cache_ref: str) -> str:
    """The state name of a smoothed key cache's per-(head, channel) offset, [1, Hkv, 1, D] fp32."""
    return cache_ref + ".offset"


def _centred(x: SSAValue, offset: SSAValue | None, before: Operation) -> SSAValue:
    """x - offset (fp32, x's shape) for smoothed keys, else x."""
    if offset is None:
        return x
    return insert_aten("aten.sub.Tensor", [{"$t": 0}, {"$t": 1}], [x, offset],
                       _tensor(f32, x.type.get_shape(), _names(x.type)), before=before)


def output_offset_ref(cache_ref: str) -> str:
    """The state name of what a smoothed value cache's attentions add to their output: its
    offset with each kv head repeated for its query heads, [1, H, 1, D] in the output's dtype."""
    return cache_ref + ".output_offset"


def _value_refs(caches: dict) -> dict[SSAValue, str]:
    """Every value of the caches (the buffer, its views and writes) -> its cache's ref."""
    return {v: ref for ref, c in caches.items() for member in [c.weight, *c.ops] for v in member.results}


def _caches_read_as(module: ModuleOp, value_refs: dict[SSAValue, str], operand: str) -> set[str]:
    """Refs of the caches the attentions read as `operand` ("k" or "v": the ones smooth-k /
    smooth-v centre); `value_refs` from _value_refs."""
    return {value_refs[getattr(a, operand)] for a in _attentions(module) if getattr(a, operand) in value_refs}


def _add_value_offset(attention, cache_ref: str, record: dict) -> None:
    """smooth-v: attention's output + the cache's offset (its heads repeated for the query heads
    they serve), replacing every use of the output."""
    out = attention.result
    shape, heads = out.type.get_shape(), attention.q.type.get_shape()[1]
    kv_heads = len(record["offset_values"][offset_ref(cache_ref)])
    offset = WeightOp(output_offset_ref(cache_ref), _tensor(out.type.element_type, [1, heads, 1, shape[3]], None))
    Rewriter.insert_op(offset, InsertPoint.after(attention))
    add = AtenOp("aten.add.Tensor", {"args": [{"$t": 0}, {"$t": 1}], "kwargs": {}}, [out, offset.results[0]], [out.type])
    Rewriter.insert_op(add, InsertPoint.after(offset))
    out.replace_uses_with_if(add.results[0], lambda use: use.operation is not add)
    record.setdefault("output_offsets", {})[output_offset_ref(cache_ref)] = {
        "offset": offset_ref(cache_ref), "repeat": heads // kv_heads, "dtype": dtype_name(out)}
    count("fp8_kv_cache.output_offsets")


def _entry(calibration: dict, ref: str) -> dict | None:
    """A buffer's calibration record ({"absmax", "mean", "centred_absmax"}: fp8_cache.calibrate_kv_absmax);
    a bare list is an absmax per head (IR written before the means were recorded)."""
    entry = calibration.get(ref)
    return {"absmax": entry} if isinstance(entry, list) else entry


def _write_value_index(op) -> int:
    return op.call["args"][2]["$t"]


def _attentions(module: ModuleOp) -> list:
    return [o for o in module.walk() if isinstance(o, (DecodeAttentionOp, CacheAttentionOp)) and not isinstance(o.parent_op(), KernelOp)]


def _attention_reads(value: SSAValue) -> bool:
    return any(isinstance(u.operation, (DecodeAttentionOp, CacheAttentionOp)) and u.index in (1, 2) for u in value.uses)


def _calibration(module: ModuleOp) -> dict:
    attr = module.attributes.get(CALIBRATION_ATTR)
    return json.loads(attr.data) if attr is not None else {}


def _names(type_: TensorType) -> list[str] | None:
    """The symbolic dim names of a tensor type's encoding, or None."""
    return [a.data for a in type_.encoding.data] if isinstance(type_.encoding, ArrayAttr) else None


def _tensor(element, shape, names: list[str] | None) -> TensorType:
    if names and any(names):
        return TensorType(element, list(shape), ArrayAttr([StringAttr(n) for n in names]))
    return TensorType(element, list(shape))


def _fp8(type_: TensorType) -> TensorType:
    return _tensor(Float8E4M3FNType(), type_.get_shape(), _names(type_))


def _scale_type(type_: TensorType) -> TensorType:
    """[B, Hkv, S, D] -> fp32 [B, Hkv, S]: the scales of a cache view, one per row."""
    names = _names(type_)
    return _tensor(f32, type_.get_shape()[:-1], names[:-1] if names else None)


def _rank4(value: SSAValue, before: Operation) -> SSAValue:
    """The written value as [B, Hkv, T, D]: index_put broadcasts a value without the batch dim
    (export drops a size-1 batch), quantize_fp8 and the kv_write family take rank 4."""
    while len(value.type.get_shape()) < 4:
        t = value.type
        names = _names(t)
        new_type = _tensor(t.element_type, [1, *t.get_shape()], ["", *names] if names else None)
        value = insert_aten("aten.unsqueeze.default", [{"$t": 0}, 0], [value], new_type, before=before)
    return value


def row_scales(x: SSAValue, headroom: float, before: Operation) -> SSAValue:
    """s = clamp_min(amax(|x|, -1) in fp32, SCALE_FLOOR) * headroom / FP8_MAX, [B, Hkv, T] (the
    cast to fp32 only for 16-bit x); `read_row_scales` recognises it."""
    rows = _scale_type(x.type)
    same_dtype = _tensor(x.type.element_type, rows.get_shape(), _names(rows))
    magnitude = insert_aten("aten.abs.default", [{"$t": 0}], [x], x.type, before=before)
    absmax = insert_aten("aten.amax.default", [{"$t": 0}, [-1]], [magnitude], same_dtype, before=before)
    as_fp32 = absmax if x.type.element_type == f32 else \
        insert_aten("aten._to_copy.default", [{"$t": 0}], [absmax], rows, before=before, kwargs={"dtype": {"$dtype": "float32"}})
    floored = insert_aten("aten.clamp_min.default", [{"$t": 0}, SCALE_FLOOR], [as_fp32], rows, before=before)
    return insert_aten("aten.mul.Tensor", [{"$t": 0}, float(headroom) / FP8_MAX], [floored], rows, before=before)


@dataclass
class RowScales:
    """A per-token scale computation `row_scales` built: its rows, headroom and ops."""

    x: SSAValue  # the rows [B, Hkv, T, D] whose scales these are
    headroom: float
    ops: list  # abs, amax, [_to_copy], clamp_min, mul (in order; the mul's result is the scales)


def read_row_scales(scales: SSAValue) -> RowScales | None:
    """The computation when `scales` is what `row_scales` builds (every op but the last read by
    its successor alone), else None. fuse-kv-write absorbs it into a kv_write region."""
    mul = scales.owner
    factor = literal_arg(mul, 1) if aten_target(mul) == "aten.mul.Tensor" else None
    if not isinstance(factor, float) or float(factor * FP8_MAX) / FP8_MAX != factor:
        return None
    ops = [mul]
    floored = mul.inputs[0].owner
    if aten_target(floored) != "aten.clamp_min.default" or literal_arg(floored, 1) != SCALE_FLOOR:
        return None
    ops.insert(0, floored)
    absmax = floored.inputs[0].owner
    if aten_target(absmax) == "aten._to_copy.default" and literal_arg(absmax, 1, "dtype") == {"$dtype": "float32"} \
            and len(absmax.call["kwargs"]) == 1:
        ops.insert(0, absmax)
        absmax = absmax.inputs[0].owner
    elif floored.inputs[0].type.element_type != f32:
        return None
    if aten_target(absmax) != "aten.amax.default" or literal_arg(absmax, 1) != [-1] \
            or literal_arg(absmax, 2, "keepdim", False) is not False:
        return None
    magnitude = absmax.inputs[0].owner
    if aten_target(magnitude) != "aten.abs.default":
        return None
    ops[:0] = [magnitude, absmax]
    if any(len(list(op.results[0].uses)) != 1 for op in ops[:-1]):
        return None
    return RowScales(magnitude.inputs[0], factor * FP8_MAX, ops)


def _read_recent_rows_exact(attention, window: int, record: dict) -> bool:
    """exact-recent: the attention, replaced by one that reads each query's newest `window` keys
    from the values its caches' writes store before rounding (this call's rows) and from a ring
    per cache of the rows earlier calls wrote (window > 1: made here, with its write after the
    attention); left as it is (counted) where a write's positions are not provably the
    attention's lengths - 1 (both from one user input, the lengths that input + 1: raise-patterns'
    form) or its rows do not line up with the queries."""
    from coopt.passes.raise_decode_attention import lengths_source

    lengths = lengths_source(attention.lengths)
    writes = []
    for cache in (attention.k, attention.v):
        write = _writer(cache)
        if write is None:
            count("fp8_kv_cache.exact_recent.skipped.no_write")
            return False
        positions = write.inputs[literal_arg(write, 1)[2]["$t"]]
        if lengths is None or lengths_source(positions) != (lengths[0], lengths[1] - 1):
            count("fp8_kv_cache.exact_recent.skipped.positions")
            return False
        rows = _stored_before_rounding(write)
        q_shape, rows_shape = attention.q.type.get_shape(), rows.type.get_shape()
        q_names, rows_names = _names(attention.q.type) or [None] * 4, _names(rows.type) or [None] * 4
        if any(q_shape[d] != rows_shape[d] or (q_shape[d] < 0 and q_names[d] != rows_names[d]) for d in (0, 2)):
            count("fp8_kv_cache.exact_recent.skipped.rows")
            return False
        writes.append((write, positions, rows))
    rings = [_ring(write, rows, window, record) if window > 1 else None for write, _, rows in writes]
    new = type(attention)(attention.q, attention.k, attention.v, attention.lengths, attention.scale.value.data,
                          attention.result.type, k_scale=attention.k_scale, v_scale=attention.v_scale,
                          kv_scale=attention.kv_scale.data, k_exact=writes[0][2], v_exact=writes[1][2],
                          k_recent=rings[0], v_recent=rings[1], recent=window)
    Rewriter.replace_op(attention, new)
    for ring, (write, positions, rows) in zip(rings, writes):
        if ring is not None:  # after the attention, which reads the earlier calls' rows
            ref = ring.owner.ref.data
            update = StateUpdateOp(ref, RING_WRITE, {"args": [{"$t": 0}, {"$t": 1}, {"$t": 2}, window, _per_row(write)],
                                                     "kwargs": {}}, [ring, positions, rows], ring.type)
            Rewriter.insert_op(update, InsertPoint.after(new))
    count("fp8_kv_cache.exact_recent")
    return True


def _ring(write: Operation, rows: SSAValue, window: int, record: dict) -> SSAValue:
    """The ring of the cache `write` writes: a state buffer `<cache>.recent` [B_max, Hkv, window,
    D] in the dtype of the rows it keeps (made once; recorded in record["recent"] for
    fp8_cache.fp8_weights, which fills it from the cache's newest rows at build time)."""
    buffer = write.operands[0]
    while not isinstance(buffer.owner, WeightOp):
        buffer = buffer.owner.operands[0]  # (through the batch view and earlier writes)
    weight = buffer.owner
    ref = ring_ref(weight.ref.data)
    block = weight.parent_block()
    for op in block.ops:
        if isinstance(op, WeightOp) and op.ref.data == ref:
            return op.results[0]
    b_max, heads, _, head_dim = weight.results[0].type.get_shape()
    ring = WeightOp(ref, TensorType(rows.type.element_type, [b_max, heads, window, head_dim]))
    Rewriter.insert_op(ring, InsertPoint.after(weight))
    record["recent"]["rings"][weight.ref.data] = ref
    record["recent"]["dtypes"][ref] = dtype_name(ring.results[0])
    return ring.results[0]


def ring_ref(cache_ref: str) -> str:
    """The state name of a cache's exact-recent ring."""
    return cache_ref + ".recent"


def _writer(cache: SSAValue) -> Operation | None:
    """The cache write whose result `cache` is, through batch views (slices of dim 0 from 0)."""
    while aten_target(cache.owner) == _SLICE and literal_arg(cache.owner, 1, "dim", 0) == 0 \
            and literal_arg(cache.owner, 2, "start", 0) in (0, None):
        cache = cache.owner.inputs[0]
    return cache.owner if isinstance(cache.owner, Operation) and _is_write(cache.owner) else None


def _stored_before_rounding(write: Operation) -> SSAValue:
    """What `write` stores as [B, Hkv, T, D], before its quantize_fp8 (centred where the cache
    is; a values-only key cache's write stores its value as it is)."""
    value = write.operands[_write_value_index(write)]
    if aten_target(value.owner) == "aten.select.int" and isinstance(value.owner.inputs[0].owner, QuantizeFp8Op):
        value = value.owner.inputs[0]  # a per-row write stores select(quantize(x), 2, 0)
    if isinstance(value.owner, QuantizeFp8Op):
        return value.owner.x
    return _row_as_rank4(write) if _per_row(write) else _rank4(value, write)


def _give_scales(attention, k_scale: SSAValue, v_scale: SSAValue, granularity: str):
    """The attention, replaced by one that reads fp8 k / v with these scales (returned)."""
    new = type(attention)(attention.q, attention.k, attention.v, attention.lengths, attention.scale.value.data,
                          attention.result.type, k_scale=k_scale, v_scale=v_scale, kv_scale=granularity)
    Rewriter.replace_op(attention, new)
    count("fp8_kv_cache.attentions")
    return new

