"""fuse-attention: each coopt.attention → an attention region (flash-attention candidates)."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp

from coopt.ir.dialect import AttentionOp, CacheAttentionOp, DecodeAttentionOp, KernelOp
from coopt.ir.outline import outline
from coopt.passes.base import CooptPass, static_shape
from coopt.passes.stats import count


@dataclass(frozen=True)
class FuseAttention(CooptPass):
    name = "fuse-attention"
    summary = "attention (SDPA or the explicit pattern, MHA or GQA) → attention region; decode steps → decode_attention"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for attn in [o for o in op.walk() if isinstance(o, AttentionOp)]:
            if isinstance(attn.parent_op(), KernelOp):
                continue
            heads, kv_heads = static_shape(attn.q)[1], static_shape(attn.k)[1]
            attrs = {
                "causal": bool(attn.causal.value.data),
                "scale": attn.scale.value.data,
                "num_heads": heads,
                "num_kv_heads": kv_heads,
            }
            outline([attn], "attention", attrs, inputs=[attn.q, attn.k, attn.v], outputs=[attn.result])
            count("fuse.attention" + (".gqa" if kv_heads != heads else ""))
        for attn in [o for o in op.walk() if isinstance(o, (DecodeAttentionOp, CacheAttentionOp))]:
            if isinstance(attn.parent_op(), KernelOp):
                continue
            decode = isinstance(attn, DecodeAttentionOp)
            attrs = {
                **({} if decode else {"causal": False}),
                "scale": attn.scale.value.data,
                "num_heads": static_shape(attn.q)[1],
                "num_kv_heads": static_shape(attn.k)[1],
                # input 3 holds lengths (per sequence in decode, per query position in a prompt),
                # each within [1, size of dim 2 of input 1] (the cache)
                "lengths_input": 3,
                "lengths_bound": [1, 2],
            }
            inputs = [attn.q, attn.k, attn.v, attn.lengths]
            if attn.kv_scale is not None:  # an fp8 cache (fp8-kv-cache): k_scale, v_scale follow lengths
                attrs["kv_scale"] = attn.kv_scale.data
                inputs += [attn.k_scale, attn.v_scale]
                count("fuse.attention.fp8_cache")
            family = "decode_attention" if decode else "attention"
            outline([attn], family, attrs, inputs=inputs, outputs=[attn.result])
            count("fuse.decode_attention" if decode else "fuse.attention.prompt_over_cache")
