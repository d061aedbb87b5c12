"""raise-patterns: recognise linear, elementwise fns, norms, softmax, attention and SwiGLU.

Each pattern does one rewrite, from `coopt.aten` (or already raised ops) to a high-level op,
and counts itself. Anything not matched stays as it was and still runs (unfused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from coopt.frontend.aten_table import ELEMENTWISE
from coopt.ir.dialect import (
    AtenOp,
    AttentionOp,
    ElementwiseOp,
    LayerNormOp,
    LinearOp,
    LogSoftmaxOp,
    RMSNormOp,
    SoftmaxOp,
    WeightOp,
)
from coopt.ir.region import ELEMENTWISE_FNS
from coopt.passes.base import (
    CooptPass,
    aten_target,
    is_bool_tensor,
    is_float_tensor,
    literal_arg,
    static_shape,
    tensor_arg,
)
from coopt.passes.stats import count

_SOFTMAXES = {"aten.softmax.int": SoftmaxOp, "aten._softmax.default": SoftmaxOp,
              "aten.log_softmax.int": LogSoftmaxOp, "aten._log_softmax.default": LogSoftmaxOp}
_DTYPE_EPS = {"f32": 1.1920928955078125e-07, "bf16": 0.0078125, "f16": 0.0009765625}


def _transposed_weight(value):
    """If `value` is W^T of a 2-D tensor W (t / permute(1,0) / transpose(0,1)), return W."""
    op = value.owner
    target = aten_target(op)
    if target == "aten.t.default":
        return tensor_arg(op, 0)
    if target == "aten.permute.default" and literal_arg(op, 1) in ([1, 0], [-1, -2]):
        return tensor_arg(op, 0)
    if target == "aten.transpose.int" and len(static_shape(value)) == 2:
        if {literal_arg(op, 1) % 2, literal_arg(op, 2) % 2} == {0, 1}:
            return tensor_arg(op, 0)
    return None


class RaiseLinear(RewritePattern):
    """linear / mm / addmm / matmul with a 2-D right operand → coopt.linear."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        target = op.target.data
        if target == "aten.linear.default":
            x, w, b = tensor_arg(op, 0), tensor_arg(op, 1), tensor_arg(op, 2, "bias")
            layout = "nk"
        elif target in ("aten.mm.default", "aten.matmul.default"):
            x, w, b = tensor_arg(op, 0), tensor_arg(op, 1), None
            layout = "kn"
        elif target == "aten.addmm.default" and literal_arg(op, 3, "beta", 1) == 1 and literal_arg(op, 4, "alpha", 1) == 1:
            b, x, w = tensor_arg(op, 0), tensor_arg(op, 1), tensor_arg(op, 2)
            layout = "kn"
        else:
            return
        if x is None or w is None or len(static_shape(w)) != 2 or not is_float_tensor(x):
            return
        if b is not None and len(static_shape(b)) != 1:
            return
        if layout == "kn" and (inner := _transposed_weight(w)) is not None:
            w, layout = inner, "nk"  # read W [N, K] through strides instead of materialising W^T
        rewriter.replace_matched_op(LinearOp(x, w, b, layout, op.results[0].type))
        count("raise.linear")


# a float cast's result type -> its fn (a cast that only changes the dtype: x.to(dtype), x.float());
# a 16-bit source widened to fp32 -> its own fn (_cast_fn)
_CASTS = {"f32": "to_f32", "bf16": "to_bf16", "f16": "to_f16"}
_WIDENINGS = {"bf16": "bf16_to_f32", "f16": "f16_to_f32"}
_INTEGERS = ("i64", "i32")


def _cast_fn(op: AtenOp) -> str | None:
    """The fn of a float cast. Widening a 16-bit value to fp32 is exact, but inside a fused fp32
    program that value may not have been rounded to its 16-bit dtype yet (an add's sum, a GEMV's
    accumulator): the widening rounds to the source dtype (bf16_to_f32, f16_to_f32), so x.float()
    is what eager gives. A cast between the two 16-bit dtypes (two roundings) stays ATen."""
    source, target = (str(v.type.element_type) for v in (op.inputs[0], op.results[0]))
    if source in _INTEGERS:  # positions.float(): the program loads integers into fp32 exactly as
        return "to_f32" if target == "f32" else None  # a cast does (to 16 bits it would round twice)
    if source in _WIDENINGS and target in _WIDENINGS and source != target:
        return None
    return _WIDENINGS[source] if target == "f32" and source in _WIDENINGS else _CASTS.get(target)


class RaiseElementwise(RewritePattern):
    """Float elementwise ATen ops → coopt.ew (gelu with approximate='tanh' → gelu_tanh; a cast to
    a float dtype, from a float or to fp32 from an integer → a cast fn: _cast_fn)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        cast = op.target.data == "aten._to_copy.default" and set(op.call["kwargs"]) == {"dtype"}
        fn = _cast_fn(op) if cast else ELEMENTWISE.get(op.target.data)
        if fn is None or not is_float_tensor(op.results[0]):
            return
        floats = op.inputs[1:] if fn == "where" else op.inputs  # where's condition: a bool tensor
        if cast:  # (an integer cast's source: _cast_fn)
            floats = [v for v in floats if str(v.type.element_type) not in _INTEGERS]
        if not all(is_float_tensor(v) for v in floats) or (fn == "where" and not is_bool_tensor(op.inputs[0])):
            return
        call = op.call
        if call["kwargs"].get("alpha", 1) != 1 or call["kwargs"].get("rounding_mode") is not None:
            return
        if fn == "gelu":
            if call["kwargs"].get("approximate", "none") == "tanh":
                fn = "gelu_tanh"
            elif call["kwargs"].get("approximate", "none") != "none":
                return
        refs = []
        for arg in call["args"]:
            if isinstance(arg, dict) and "$t" in arg:
                refs.append(arg["$t"])
            elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
                refs.append({"$f": float(arg)})
            else:
                return
        if fn == "pow" and refs[1] == {"$f": 2.0}:
            fn, refs = "square", refs[:1]
        if len(refs) != ELEMENTWISE_FNS[fn]:
            return  # a positional alpha, or an overload this table does not spell out
        if op.target.data.startswith("aten.rsub."):
            refs = [refs[1], refs[0]]  # rsub(x, other) = other - x
        rewriter.replace_matched_op(ElementwiseOp(fn, refs, list(op.inputs), op.results[0].type))
        count(f"raise.ew.{fn}")


# clamp-like op -> (keyword of the lower bound, of the upper bound, their defaults)
_CLAMP_BOUNDS = {
    "aten.clamp.default": ("min", "max", None, None),
    "aten.hardtanh.default": ("min_val", "max_val", -1.0, 1.0),
    "aten.relu6.default": (None, None, 0.0, 6.0),
}


class RaiseClamp(RewritePattern):
    """clamp(x, lo, hi) / hardtanh(x, lo, hi) / relu6(x) with number bounds → maximum(x, lo) then
    minimum(·, hi), either left out where its bound is None (clamp_min / clamp_max are in the
    elementwise table as they are)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        names = _CLAMP_BOUNDS.get(op.target.data)
        x = tensor_arg(op, 0)
        if names is None or x is None or len(op.inputs) != 1 or not is_float_tensor(x) \
                or not is_float_tensor(op.results[0]):
            return
        lo, hi = literal_arg(op, 1, names[0], names[2]), literal_arg(op, 2, names[1], names[3])
        bounds = [(fn, b) for fn, b in (("maximum", lo), ("minimum", hi)) if b is not None]
        if not bounds or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for _, b in bounds):
            return
        ops, value = [], x
        for fn, bound in bounds:
            ops.append(ElementwiseOp(fn, [0, {"$f": float(bound)}], [value], op.results[0].type))
            value = ops[-1].result
        rewriter.replace_matched_op(ops, [value])
        count("raise.ew.clamp")


class RaiseNorms(RewritePattern):
    """layer_norm / rms_norm over the last dim and softmax over the last dim."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        target = op.target.data
        x = tensor_arg(op, 0)
        if x is None or not is_float_tensor(x):
            return
        shape = static_shape(x)
        out_type = op.results[0].type
        if target in ("aten.layer_norm.default", "aten.rms_norm.default"):
            if literal_arg(op, 1) != [shape[-1]]:
                return
            w = tensor_arg(op, 2, "weight")
            if target == "aten.layer_norm.default":
                b = tensor_arg(op, 3, "bias")
                eps = literal_arg(op, 4, "eps", 1e-5)
                rewriter.replace_matched_op(LayerNormOp(x, w, b, eps, out_type))
                count("raise.layer_norm")
            else:
                eps = literal_arg(op, 3, "eps", None)
                eps = _DTYPE_EPS[str(x.type.element_type)] if eps is None else eps
                rewriter.replace_matched_op(RMSNormOp(x, w, None, eps, out_type))
                count("raise.rms_norm")
        elif target in _SOFTMAXES:
            dim = literal_arg(op, 1)
            # (softmax.int's third argument is a dtype, _softmax's half_to_float: neither asked for)
            if dim not in (-1, len(shape) - 1) or literal_arg(op, 2, "dtype") not in (None, False):
                return
            op_class = _SOFTMAXES[target]
            rewriter.replace_matched_op(op_class(x, out_type))
            count("raise.softmax" if op_class is SoftmaxOp else "raise.log_softmax")


class RaiseSDPA(RewritePattern):
    """scaled_dot_product_attention without mask/dropout → coopt.attention (MHA or GQA)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        if op.target.data != "aten.scaled_dot_product_attention.default":
            return
        q, k, v = tensor_arg(op, 0), tensor_arg(op, 1), tensor_arg(op, 2)
        if tensor_arg(op, 3, "attn_mask") is not None or literal_arg(op, 3, "attn_mask") is not None:
            return
        if literal_arg(op, 4, "dropout_p", 0.0) != 0.0:
            return
        causal = bool(literal_arg(op, 5, "is_causal", False))
        qs, ks = static_shape(q), static_shape(k)
        if len(qs) != 4 or len(ks) != 4:
            return
        # SDPA's causal mask is top-left aligned; raise only when that equals bottom-right (Sq == Sk)
        if causal and (qs[2] != ks[2] or q.type.encoding != k.type.encoding and qs[2] is None):
            return
        if qs[1] is None or ks[1] is None or qs[1] % ks[1] != 0:
            return
        scale = literal_arg(op, 6, "scale", None)
        scale = 1.0 / math.sqrt(qs[3]) if scale is None else scale
        rewriter.replace_matched_op(AttentionOp(q, k, v, causal, scale, op.results[0].type))
        count("raise.attention.sdpa")


def _ew(value, fn):
    op = value.owner
    return op if isinstance(op, ElementwiseOp) and op.fn.data == fn else None


class RaiseExplicitRMSNorm(RewritePattern):
    """x * rsqrt(mean(x², -1, keepdim) + eps) * w (either multiplication order) → coopt.rms_norm.

    Also transformers' form for 16-bit models (LlamaRMSNorm, Mistral's, Qwen2's): the statistics
    and the scaling in fp32 (x.to(float32) ... ).to(x's dtype) * w, w in x's dtype. The raised
    norm (F.rms_norm's numerics) rounds once, after the weight; that code rounds before it too:
    the two differ by at most a rounding of the model dtype, which the build's end-to-end check
    measures like any other difference."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ElementwiseOp, rewriter: PatternRewriter) -> None:
        if op.fn.data != "mul" or len(op.inputs) != 2:
            return
        for scaled, w in (tuple(op.inputs), tuple(reversed(op.inputs))):
            source = _cast_back_from_fp32(scaled)  # transformers' form: (x, the fp32 product)
            inner = _ew(source[1] if source else scaled, "mul")
            if inner is None or len(inner.inputs) != 2:
                continue
            for x, r in (tuple(inner.inputs), tuple(reversed(inner.inputs))):
                eps = _match_rsqrt_mean_square(r, x)
                if eps is None or static_shape(w) != [static_shape(x)[-1]]:
                    continue
                if source is not None:
                    if x is not source[2] or w.type.element_type != source[0].type.element_type:
                        continue
                    x = source[0]
                rewriter.replace_matched_op(RMSNormOp(x, w, None, eps, op.results[0].type))
                count("raise.rms_norm.explicit" + (".fp32_statistics" if source else ""))
                return


class RaiseNarrowedRMSNorm(RewritePattern):
    """An fp32 rms_norm of a widened 16-bit x whose only reader casts it back to x's dtype →
    one rms_norm of x with that result dtype. Gemma's RMSNorm, `(norm(x.float()) * (1 +
    w.float())).type_as(x)` (the weight folded by fold-constants, type_as a cast by
    simplify-aten), is F.rms_norm's own numerics for a 16-bit input with an fp32 weight: fp32
    throughout, the weight applied in fp32, one rounding at the end: exact. Raised, it is one norm
    a GEMV can take as its prologue instead of three kernels."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ElementwiseOp, rewriter: PatternRewriter) -> None:
        if op.fn.data not in ("to_bf16", "to_f16") or len(op.inputs) != 1:
            return
        norm = op.inputs[0].owner
        if not isinstance(norm, RMSNormOp) or norm.bias is not None or len(list(op.inputs[0].uses)) != 1:
            return
        widen = norm.x.owner
        if not isinstance(widen, ElementwiseOp) or widen.fn.data not in _WIDENINGS.values():
            return
        x = widen.inputs[0]
        if x.type.element_type != op.results[0].type.element_type:
            return
        rewriter.replace_matched_op(RMSNormOp(x, norm.weight, None, norm.eps.value.data, op.results[0].type))
        count("raise.rms_norm.narrowed")


def _cast_back_from_fp32(value):
    """(x, product, x32) where `value` is product.to(x's 16-bit dtype) and x32 = x.to(float32)
    feeds the product (both casts raised to coopt.ew): transformers' RMSNorm body in fp32 between
    two casts; else None. The product's own form (x32 * rsqrt(...)) is the caller's to check."""
    dtype = str(value.type.element_type)
    cast = _ew(value, _CASTS[dtype]) if dtype in _WIDENINGS else None
    if cast is None:
        return None
    product = cast.inputs[0]
    if str(product.type.element_type) != "f32" or not isinstance(product.owner, ElementwiseOp):
        return None
    for x32 in product.owner.inputs:
        widen = x32.owner  # x.to(float32) of a 16-bit x (_cast_fn)
        if (isinstance(widen, ElementwiseOp) and widen.fn.data in _WIDENINGS.values()
                and str(x32.type.element_type) == "f32" and widen.inputs[0].type.element_type == value.type.element_type):
            return widen.inputs[0], product, x32
    return None


def _match_rsqrt_mean_square(r, x) -> float | None:
    rsqrt = _ew(r, "rsqrt")
    add = _ew(rsqrt.inputs[0], "add") if rsqrt else None
    if add is None or len(add.inputs) != 1:
        return None
    eps = next((a["$f"] for a in add.arg_refs if isinstance(a, dict)), None)
    mean = add.inputs[0].owner
    if eps is None or aten_target(mean) != "aten.mean.dim" or literal_arg(mean, 1) not in ([-1], [len(static_shape(x)) - 1]):
        return None
    if literal_arg(mean, 2, "keepdim", False) is not True:
        return None
    square = tensor_arg(mean, 0)
    sq = _ew(square, "square")
    if sq is None or sq.inputs[0] is not x:
        return None
    return float(eps)


def _causal_mask_source(mask) -> bool:
    """mask == eq(M, 0) with M a causal-mask weight seen through alias / leading slices."""
    eq = mask.owner
    if aten_target(eq) != "aten.eq.Scalar" or literal_arg(eq, 1) != 0:
        return False
    value = tensor_arg(eq, 0)
    while aten_target(value.owner) in ("aten.alias.default", "aten.slice.Tensor"):
        op = value.owner
        if aten_target(op) == "aten.slice.Tensor" and literal_arg(op, 2, "start", 0) not in (0, None):
            return False  # a slice that does not start at 0 shifts the diagonal
        value = tensor_arg(op, 0)
    return isinstance(value.owner, WeightOp) and "coopt.causal_mask" in value.owner.attributes


class RaiseExplicitAttention(RewritePattern):
    """softmax((q @ k^T) * scale [masked_fill(causal == 0, -inf)]) @ v → coopt.attention.

    The form written out in minGPT-style models; scale may be a multiplication or a division
    by a literal, the causal mask a lower-triangular buffer (checked on its values at import).
    """

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: AtenOp, rewriter: PatternRewriter) -> None:
        if op.target.data != "aten.matmul.default":
            return
        probs, v = tensor_arg(op, 0), tensor_arg(op, 1)
        if probs is None or v is None or not isinstance(probs.owner, SoftmaxOp) or len(static_shape(v)) != 4:
            return
        scores = probs.owner.x
        causal = False
        if aten_target(scores.owner) == "aten.masked_fill.Scalar":
            fill = scores.owner
            if literal_arg(fill, 2) != {"$f": "-inf"} or not _causal_mask_source(tensor_arg(fill, 1)):
                return
            causal, scores = True, tensor_arg(fill, 0)
        scale = 1.0
        scaled = scores.owner
        if isinstance(scaled, ElementwiseOp) and scaled.fn.data in ("mul", "div") and len(scaled.inputs) == 1:
            literal = next(a["$f"] for a in scaled.arg_refs if isinstance(a, dict))
            scale = literal if scaled.fn.data == "mul" else 1.0 / literal
            scores = scaled.inputs[0]
        qk = scores.owner
        if aten_target(qk) != "aten.matmul.default":
            return
        q, k_t = tensor_arg(qk, 0), tensor_arg(qk, 1)
        transpose = k_t.owner
        if aten_target(transpose) != "aten.transpose.int" or {literal_arg(transpose, 1) % 4, literal_arg(transpose, 2) % 4} != {2, 3}:
            return
        k = tensor_arg(transpose, 0)
        qs, ks = static_shape(q), static_shape(k)
        if len(qs) != 4 or qs[1] != ks[1] or (causal and qs[2] != ks[2]):
            return
        rewriter.replace_matched_op(AttentionOp(q, k, v, causal, float(scale), op.results[0].type))
        count("raise.attention.explicit" + (".causal" if causal else ""))


class RecognizeSwiGLU(RewritePattern):
    """silu(x Wg) * (x Wu): counted so the report can say the MLP was recognised; fusion then
    makes it two GEMMs with epilogues (silu, then ·gate) — no separate kernel needed yet."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ElementwiseOp, rewriter: PatternRewriter) -> None:
        if op.fn.data != "mul" or len(op.inputs) != 2 or "coopt.swiglu" in op.attributes:
            return
        a, b = op.inputs
        for gate, up in ((a, b), (b, a)):
            silu = _ew(gate, "silu")
            if silu and isinstance(silu.inputs[0].owner, LinearOp) and isinstance(up.owner, LinearOp):
                if silu.inputs[0].owner.x is up.owner.x:
                    from xdsl.dialects.builtin import UnitAttr

                    op.attributes["coopt.swiglu"] = UnitAttr()
                    rewriter.handle_operation_modification(op)
                    count("raise.swiglu")
                    return


@dataclass(frozen=True)
class RaisePatterns(CooptPass):
    name = "raise-patterns"
    summary = "recognise linear, elementwise, norms, softmax, attention, SwiGLU in the ATen graph"

    explicit_rms_norm: bool = True
    rope: bool = True  # the rotate-half rotary embedding → coopt.rope
    repeated_kv: bool = True  # keys / values repeated per query head → SDPA with enable_gqa (lossless)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        if self.repeated_kv:  # first: the attention patterns below then see grouped heads, as with enable_gqa
            from coopt.passes.fold_repeated_kv import FoldRepeatedKVHeads

            PatternRewriteWalker(FoldRepeatedKVHeads(), apply_recursively=False).rewrite_module(op)
        PatternRewriteWalker(
            GreedyRewritePatternApplier([RaiseLinear(), RaiseElementwise(), RaiseClamp(), RaiseNorms(), RaiseSDPA()]),
            apply_recursively=False,
        ).rewrite_module(op)
        from coopt.passes.raise_decode_attention import RaiseDecodeSDPA
        from coopt.passes.raise_rope import RaiseRope

        later = [RecognizeSwiGLU(), RaiseExplicitAttention(), RaiseDecodeSDPA()]
        if self.repeated_kv:  # the explicit attention over repeated heads, once raised
            from coopt.passes.fold_repeated_kv import FoldRepeatedKVIntoAttention

            later.append(FoldRepeatedKVIntoAttention())
        later += [RaiseRope()] if self.rope else []
        later += [RaiseExplicitRMSNorm(), RaiseNarrowedRMSNorm()] if self.explicit_rms_norm else []
        PatternRewriteWalker(GreedyRewritePatternApplier(later)).rewrite_module(op)
        # the explicit RMSNorm and RoPE leave their old chains dead: drop them (all pure)
        from xdsl.transforms.dead_code_elimination import region_dce

        for region in op.regions:
            region_dce(region)
