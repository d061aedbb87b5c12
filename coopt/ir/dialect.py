"""The `coopt` dialect: tensor ops with value semantics, weights by name, explicit state writes.

Levels, from import to fusion:
  coopt.weight / coopt.aten / coopt.fallback / coopt.state_write   what the importer emits
  coopt.linear / coopt.ew / coopt.rms_norm / ...                    what raise-patterns makes
  coopt.kernel (+ coopt.yield)                                      what the fusion passes make

Non-tensor call arguments of `coopt.aten` / `coopt.fallback` live in the `args` property as JSON
(tensor operands appear there as {"$t": i}); that keeps one op class for the hundreds of ATen ops
while passes still match on `target`. Symbolic dims travel in the tensor type's encoding, an
array of dim names ("" for a static dim): `tensor<?x16xf32, ["s0", ""]>`.
"""

from __future__ import annotations

import json

from xdsl.dialects.builtin import (
    BoolAttr,
    FloatAttr,
    IntegerAttr,
    StringAttr,
    TensorType,
    f64,
    i64,
)
from xdsl.ir import Dialect
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    opt_prop_def,
    prop_def,
    region_def,
    result_def,
    traits_def,
    var_operand_def,
    var_result_def,
)
from xdsl.traits import IsTerminator, MemoryWriteEffect, Pure


def json_prop(value) -> StringAttr:
    return StringAttr(json.dumps(value, sort_keys=True))


@irdl_op_definition
class WeightOp(IRDLOperation):
    """A parameter or buffer of the model, by its state-dict name (never an inlined constant)."""

    name = "coopt.weight"
    ref = prop_def(StringAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, ref: str, type_: TensorType):
        super().__init__(properties={"ref": StringAttr(ref)}, result_types=[type_])


class _AtenCallBase(IRDLOperation):
    target = prop_def(StringAttr)  # "aten.linear.default"
    args = prop_def(StringAttr)  # JSON: {"args": [...], "kwargs": {...}} with {"$t": i} for values
    inputs = var_operand_def()  # tensors, and `index` values for symbolic sizes
    outs = var_result_def()

    def __init__(self, target: str, call: dict, inputs, result_types):
        super().__init__(
            operands=[inputs],
            properties={"target": StringAttr(target), "args": json_prop(call)},
            result_types=[result_types],
        )

    @property
    def call(self) -> dict:
        return json.loads(self.args.data)


@irdl_op_definition
class AtenOp(_AtenCallBase):
    """An ATen op coopt understands; raise-patterns turns the interesting ones into high-level ops."""

    name = "coopt.aten"
    traits = traits_def(Pure())


@irdl_op_definition
class FallbackOp(_AtenCallBase):
    """An ATen op the importer does not know: run as is by PyTorch, listed in the report."""

    name = "coopt.fallback"


@irdl_op_definition
class StateWriteOp(IRDLOperation):
    """Write a new value into a buffer (KV cache, running stats): the state-update of the model.

    Not Pure: it has a write effect, so dead-code elimination never removes it.
    """

    name = "coopt.state_write"
    ref = prop_def(StringAttr)
    value = operand_def(TensorType)
    traits = traits_def(MemoryWriteEffect())

    def __init__(self, ref: str, value):
        super().__init__(operands=[value], properties={"ref": StringAttr(ref)})


@irdl_op_definition
class StateUpdateOp(_AtenCallBase):
    """An in-place update of a buffer (a KV-cache write): `target` is the in-place ATen op
    ("aten.index_put_.default", "aten.index_copy_.default") or "coopt.slice_copy_" (write `src`
    into a slice), operand 0 the buffer, `ref` its state-dict name. The result is the buffer
    after the write (it aliases the buffer). Made by inplace-state-writes from a functional
    update + coopt.state_write, so a decode step writes one token instead of copying the cache.
    "coopt.ring_write_" (fp8-kv-cache's exact-recent) stores rows into a ring: args [ring,
    positions, rows [B, Hkv, T, D], N, per_row] writes row b's newest rows at slot p % N of
    ring[b]; paged-kv adds a sixth, ring_slots [B] int32, and row b's ring is ring[ring_slots[b]].
    """

    name = "coopt.state_update"
    ref = prop_def(StringAttr)
    traits = traits_def(MemoryWriteEffect())

    def __init__(self, ref: str, target: str, call: dict, inputs, result_type):
        IRDLOperation.__init__(
            self,
            operands=[inputs],
            properties={"target": StringAttr(target), "args": json_prop(call), "ref": StringAttr(ref)},
            result_types=[[result_type]],
        )


# -- high-level ops (made by raise-patterns) ------------------------------------------------


@irdl_op_definition
class LinearOp(IRDLOperation):
    """y = x @ W' (+ b); b_layout "nk" means W is [N, K] (nn.Linear), "kn" means [K, N]."""

    name = "coopt.linear"
    x = operand_def(TensorType)
    w = operand_def(TensorType)
    bias = opt_operand_def(TensorType)
    b_layout = prop_def(StringAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x, w, bias, b_layout: str, type_):
        super().__init__(
            operands=[x, w, [bias] if bias is not None else []],
            properties={"b_layout": StringAttr(b_layout)},
            result_types=[type_],
        )


@irdl_op_definition
class ElementwiseOp(IRDLOperation):
    """One elementwise fn (coopt.ir.region.ELEMENTWISE_FNS) of tensors and float literals.

    `args` is JSON: a list whose ints index the operands and whose {"$f": x} are literals.
    """

    name = "coopt.ew"
    fn = prop_def(StringAttr)
    args = prop_def(StringAttr)
    inputs = var_operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, fn: str, arg_refs: list, inputs, type_):
        super().__init__(
            operands=[inputs],
            properties={"fn": StringAttr(fn), "args": json_prop(arg_refs)},
            result_types=[type_],
        )

    @property
    def arg_refs(self) -> list:
        return json.loads(self.args.data)


class _NormBase(IRDLOperation):
    x = operand_def(TensorType)
    weight = opt_operand_def(TensorType)
    bias = opt_operand_def(TensorType)
    eps = prop_def(FloatAttr)
    result = result_def(TensorType)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)

    def __init__(self, x, weight, bias, eps: float, type_):
        super().__init__(
            operands=[x, [weight] if weight is not None else [], [bias] if bias is not None else []],
            properties={"eps": FloatAttr(float(eps), f64)},
            result_types=[type_],
        )


@irdl_op_definition
class RMSNormOp(_NormBase):
    name = "coopt.rms_norm"
    traits = traits_def(Pure())


@irdl_op_definition
class LayerNormOp(_NormBase):
    name = "coopt.layer_norm"
    traits = traits_def(Pure())


class _LastDimBase(IRDLOperation):
    """A function of each row over the last dim, no parameters."""

    x = operand_def(TensorType)
    result = result_def(TensorType)

    def __init__(self, x, type_):
        super().__init__(operands=[x], result_types=[type_])


@irdl_op_definition
class SoftmaxOp(_LastDimBase):
    """Softmax over the last dim."""

    name = "coopt.softmax"
    traits = traits_def(Pure())


@irdl_op_definition
class LogSoftmaxOp(_LastDimBase):
    """log(softmax(x)) over the last dim: x - max - log(sum(exp(x - max)))."""

    name = "coopt.log_softmax"
    traits = traits_def(Pure())


@irdl_op_definition
class AttentionOp(IRDLOperation):
    """softmax(q k^T * scale [+ causal mask]) v, q [B,H,Sq,D], k/v [B,Hkv,Sk,D] (GQA when Hkv < H)."""

    name = "coopt.attention"
    q = operand_def(TensorType)
    k = operand_def(TensorType)
    v = operand_def(TensorType)
    causal = prop_def(BoolAttr)
    scale = prop_def(FloatAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, q, k, v, causal: bool, scale: float, type_):
        super().__init__(
            operands=[q, k, v],
            properties={"causal": BoolAttr.from_bool(causal), "scale": FloatAttr(float(scale), f64)},
            result_types=[type_],
        )


class _CachedAttentionBase(IRDLOperation):
    """Attention of q over a static KV cache k/v [B,Hkv,S_max,D], each query reading only the
    first `lengths` positions (GQA when Hkv < H); subclasses say which queries a length is for.

    An fp8 cache (the fp8-kv-cache pass, docs/kv-cache.md) stores k/v as float8_e4m3fn and
    carries k_scale / v_scale with `kv_scale` naming their granularity ("per-tensor" [1],
    "per-head" [Hkv], "per-token" [B,Hkv,S_max]): attention reads k·k_scale and v·v_scale.

    With `recent` = N (fp8-kv-cache's exact-recent), query i, at position p = lengths[i] − 1,
    reads its newest N keys (positions p − d, d = 0 .. N − 1, those >= 0) unrounded: while
    i − d >= 0 from k_exact / v_exact [B,Hkv,T,D] at index i − d of dim 2 (this call's rows,
    counted back from the query's own: the row at position p − d where the call's positions are
    consecutive, as a prompt's and a decode step's are; a decode step: T = 1, sequence b's own
    row at [b, :, 0]), before that from the rings k_recent / v_recent ([B_max,Hkv,N,D], slot
    (p − d) % N: the row an earlier call wrote there, read before this call's ring write; absent
    for N = 1); all as the cache would store them before rounding (centred where the cache is,
    not scaled). Keys older than the window come from the cache."""

    q = operand_def(TensorType)
    k = operand_def(TensorType)
    v = operand_def(TensorType)
    lengths = operand_def(TensorType)
    k_scale = opt_operand_def(TensorType)
    v_scale = opt_operand_def(TensorType)
    k_exact = opt_operand_def(TensorType)
    v_exact = opt_operand_def(TensorType)
    k_recent = opt_operand_def(TensorType)
    v_recent = opt_operand_def(TensorType)
    scale = prop_def(FloatAttr)
    kv_scale = opt_prop_def(StringAttr)
    recent = opt_prop_def(IntegerAttr)
    result = result_def(TensorType)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)

    def __init__(self, q, k, v, lengths, scale: float, type_, k_scale=None, v_scale=None, kv_scale: str | None = None,
                 k_exact=None, v_exact=None, k_recent=None, v_recent=None, recent: int | None = None):
        if (k_scale is None) != (v_scale is None) or (k_scale is None) != (kv_scale is None):
            raise ValueError("k_scale, v_scale and kv_scale go together")
        if (k_exact is None) != (v_exact is None) or (k_exact is None) != (recent is None) \
                or (k_recent is None) != (v_recent is None) or (k_recent is None) != (recent in (None, 1)) \
                or (recent is not None and (kv_scale is None or recent < 1)):
            raise ValueError("k_exact, v_exact and recent >= 1 go together (with k_recent, v_recent where recent > 1), "
                             "with an fp8 cache's scales")
        properties = {"scale": FloatAttr(float(scale), f64)}
        if kv_scale is not None:
            properties["kv_scale"] = StringAttr(kv_scale)
        if recent is not None:
            properties["recent"] = IntegerAttr(recent, i64)
        super().__init__(
            operands=[q, k, v, lengths, *([] if x is None else [x] for x in (k_scale, v_scale, k_exact, v_exact, k_recent,
                                                                             v_recent))],
            properties=properties,
            result_types=[type_],
        )


@irdl_op_definition
class DecodeAttentionOp(_CachedAttentionBase):
    """One query token per sequence: q [B,H,1,D]; lengths [B] int32 or int64, one per sequence."""

    name = "coopt.decode_attention"
    traits = traits_def(Pure())


@irdl_op_definition
class CacheAttentionOp(_CachedAttentionBase):
    """Several query tokens (a prompt, or a chunk of one): query i of q [B,H,T,D] reads
    lengths[i] positions; lengths [T] int32 or int64 (the query's position + 1, the same for every
    sequence)."""

    name = "coopt.cache_attention"
    traits = traits_def(Pure())


# -- fusion ----------------------------------------------------------------------------------


@irdl_op_definition
class KernelOp(IRDLOperation):
    """A kernel region: one launch in the output. Its body is the reference computation.

    `family` names the template family that can implement it; `attrs` (JSON) are the family
    attributes of coopt.ir.region; `sym_name` names the region in reports and out/kernels/.
    """

    name = "coopt.kernel"
    sym_name = prop_def(StringAttr)
    family = prop_def(StringAttr)
    attrs = prop_def(StringAttr)
    inputs = var_operand_def(TensorType)
    outs = var_result_def(TensorType)
    body = region_def("single_block")

    @property
    def family_attrs(self) -> dict:
        return json.loads(self.attrs.data)


@irdl_op_definition
class YieldOp(IRDLOperation):
    name = "coopt.yield"
    values = var_operand_def(TensorType)
    traits = traits_def(IsTerminator())

    def __init__(self, values):
        super().__init__(operands=[values])


@irdl_op_definition
class RopeOp(IRDLOperation):
    """Rotary embedding, rotate-half form: x·cos + cat(-x[..., D/2:], x[..., :D/2])·sin;
    cos and sin broadcast to x."""

    name = "coopt.rope"
    x = operand_def(TensorType)
    cos = operand_def(TensorType)
    sin = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x, cos, sin, type_):
        super().__init__(operands=[x, cos, sin], result_types=[type_])


KV_SCALE_GRANULARITIES = ("per-tensor", "per-head", "per-token")


@irdl_op_definition
class QuantizeFp8Op(IRDLOperation):
    """x [B,Hkv,T,D] quantized to float8_e4m3fn for an fp8 KV cache (docs/kv-cache.md):
    clamp(x / s, -448, 448) rounded to nearest even, where s is `scale` broadcast by
    `granularity`: "per-tensor" scale [1], "per-head" scale [Hkv] (s[h] for head h),
    "per-token" scale [B,Hkv,T] (one per written row). Lossy by construction: only the
    fp8-kv-cache pass makes it."""

    name = "coopt.quantize_fp8"
    x = operand_def(TensorType)
    scale = operand_def(TensorType)
    granularity = prop_def(StringAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x, scale, granularity: str, type_):
        if granularity not in KV_SCALE_GRANULARITIES:
            raise ValueError(f"granularity {granularity!r} is not one of {KV_SCALE_GRANULARITIES}")
        super().__init__(operands=[x, scale], properties={"granularity": StringAttr(granularity)}, result_types=[type_])


HIGH_LEVEL_OPS = (LinearOp, ElementwiseOp, RMSNormOp, LayerNormOp, SoftmaxOp, LogSoftmaxOp, AttentionOp, DecodeAttentionOp,
                  CacheAttentionOp, RopeOp, QuantizeFp8Op)

Coopt = Dialect(
    "coopt",
    [WeightOp, AtenOp, FallbackOp, StateWriteOp, StateUpdateOp, *HIGH_LEVEL_OPS, KernelOp, YieldOp],
    [],
)
