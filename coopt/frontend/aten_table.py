"""The ATen ops the importer knows (imported as coopt.aten); all others become coopt.fallback.

"Known" means coopt can reason about the op: raise-patterns may rewrite it, fusion may take it
into a region, and its shape behaviour is understood. Unknown ops still run (through PyTorch) —
the build never fails because of one exotic op — and the report lists them.
"""

from __future__ import annotations

# aten elementwise op -> coopt elementwise fn (coopt.ir.region.ELEMENTWISE_FNS)
ELEMENTWISE = {
    "aten.add.Tensor": "add",
    "aten.add.Scalar": "add",
    "aten.sub.Tensor": "sub",
    "aten.sub.Scalar": "sub",
    "aten.mul.Tensor": "mul",
    "aten.mul.Scalar": "mul",
    "aten.div.Tensor": "div",
    "aten.div.Scalar": "div",
    "aten.maximum.default": "maximum",
    "aten.minimum.default": "minimum",
    "aten.pow.Tensor_Scalar": "pow",
    "aten.neg.default": "neg",
    "aten.relu.default": "relu",
    "aten.silu.default": "silu",
    "aten.sigmoid.default": "sigmoid",
    "aten.gelu.default": "gelu",  # approximate='tanh' is read from kwargs -> gelu_tanh
    "aten.tanh.default": "tanh",
    "aten.exp.default": "exp",
    "aten.log.default": "log",
    "aten.sqrt.default": "sqrt",
    "aten.rsqrt.default": "rsqrt",
    "aten.abs.default": "abs",
    "aten.reciprocal.default": "reciprocal",
    "aten.sin.default": "sin",
    "aten.cos.default": "cos",
    "aten.erf.default": "erf",
    "aten.hardsigmoid.default": "hardsigmoid",
    "aten.hardswish.default": "hardswish",
    "aten.rsub.Scalar": "sub",  # other - x: raise-patterns swaps the operands
    "aten.rsub.Tensor": "sub",
    # a bool condition (a mask made outside) choosing between float operands; comparisons stay
    # ATen: in a kernel's fp32 they could flip where the model's own dtype rounds to a tie
    "aten.where.self": "where",
    "aten.where.ScalarOther": "where",
    "aten.where.ScalarSelf": "where",
    "aten.clamp_min.default": "maximum",  # (a number bound; clamp and hardtanh: raise-patterns)
    "aten.clamp_max.default": "minimum",
}

MATMUL = {"aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.matmul.default", "aten.bmm.default"}

NORMS = {"aten.layer_norm.default", "aten.rms_norm.default", "aten.softmax.int", "aten._softmax.default",
         "aten.log_softmax.int", "aten._log_softmax.default"}

ATTENTION = {"aten.scaled_dot_product_attention.default"}

VIEWS_AND_DATA = {
    "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.transpose.int",
    "aten.permute.default", "aten.t.default", "aten.expand.default", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.squeeze.dims", "aten.contiguous.default", "aten.clone.default",
    "aten.slice.Tensor", "aten.select.int", "aten.cat.default", "aten.stack.default",
    "aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default",
    "aten.unbind.int", "aten.flatten.using_ints", "aten.repeat_interleave.self_int",
    "aten.embedding.default", "aten.index.Tensor", "aten.index_select.default",
    "aten.to.dtype", "aten._to_copy.default", "aten.type_as.default", "aten.alias.default",
    "aten.copy.default", "aten.slice_scatter.default", "aten.index_put.default", "aten.index_copy.default",
    "aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.full.default",
    "aten.zeros.default", "aten.ones.default", "aten.zeros_like.default", "aten.ones_like.default",
    "aten.triu.default", "aten.tril.default", "aten.where.self", "aten.masked_fill.Scalar",
    "aten.masked_fill.Tensor", "aten.dropout.default", "aten.scalar_tensor.default",
    "aten.lift_fresh_copy.default", "aten.detach.default",
    "aten.new_ones.default", "aten.new_zeros.default", "aten.new_full.default", "aten.full_like.default",
}

REDUCTIONS = {
    "aten.mean.dim", "aten.sum.dim_IntList", "aten.amax.default", "aten.max.dim",
    "aten.var.correction", "aten.var_mean.correction", "aten.cumsum.default",
}

KNOWN = set(ELEMENTWISE) | MATMUL | NORMS | ATTENTION | VIEWS_AND_DATA | REDUCTIONS | {
    "aten.eq.Scalar", "aten.eq.Tensor", "aten.lt.Scalar", "aten.gt.Scalar", "aten.ge.Scalar",
    "aten.le.Scalar", "aten.lt.Tensor", "aten.gt.Tensor", "aten.ge.Tensor", "aten.le.Tensor",
    "aten.ne.Scalar", "aten.ne.Tensor", "aten.logical_and.default", "aten.logical_or.default", "aten.logical_not.default",
    # how transformers 5 combines its mask functions (a causal mask and a sliding window: `a & b`)
    "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
    "aten.bitwise_not.default",
    "aten.clamp.default", "aten.hardtanh.default", "aten.relu6.default", "aten.sym_size.int",
}

# Checks torch.export writes into the graph that compute nothing: `.to(dtype)` of a tensor that
# already has that dtype leaves an assertion of its metadata. The importer drops them (the built
# program's own input checks guard what a caller passes; these are about intermediates whose
# dtypes the capture fixed), so they neither run at every call nor read as unknown ops.
EXPORT_METADATA_CHECKS = {"aten._assert_tensor_metadata.default"}
