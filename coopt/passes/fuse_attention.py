"""fuse-attention: each coopt.attention → an attention region (flash-attention candidates); each
decode / prompt-over-cache attention → a decode_attention / attention region (with lengths), a
decode attention taking in the rope of its query when only it reads that (knob `rope`) and the
`+ 1` that makes its lengths from the step's positions (knob `lengths_add`); either reads a paged
cache (paged-kv) through its page table, gathering nothing."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.ir.dialect import (
    AtenOp,
    AttentionOp,
    CacheAttentionOp,
    DecodeAttentionOp,
    KernelOp,
    RopeOp,
    StateUpdateOp,
)
from coopt.ir.outline import outline
from coopt.passes.base import (
    CooptPass,
    aten_target,
    literal_arg,
    static_shape,
    tensor_arg,
)
from coopt.passes.fp8_kv_cache import RING_WRITE
from coopt.passes.fusion_common import only_user
from coopt.passes.paged_kv import read_paged_attention, read_ring_view
from coopt.passes.stats import count


@dataclass(frozen=True)
class FuseAttention(CooptPass):
    name = "fuse-attention"
    summary = "attention (SDPA or the explicit pattern, MHA or GQA) → attention region; decode steps → decode_attention"

    # absorb the rope producing a decode attention's q (when only the attention reads it)
    rope: bool = True
    # read a decode attention's lengths as positions + offset inside the kernel (attrs
    # lengths_offset) where raise-patterns built them as `positions + 1`: the add is one ATen
    # launch a step, ~1.5 µs and the gap around it in a b32 step (session 46's profile)
    lengths_add: bool = True

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        position_views: dict[tuple, SSAValue] = {}  # the positions' one view a shape, shared by every layer
        replaced = []  # the shared `+ 1` chains, erased once no attention reads them
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
            scales = [attn.k_scale, attn.v_scale] if attn.kv_scale is not None else []
            ops = [attn]
            paged = read_paged_attention(attn)
            if paged is not None:  # paged-kv: the kernel reads through the page table, nothing is gathered
                inputs = [attn.q, *paged.pools, attn.lengths, paged.table]
                scales = paged.scales or scales  # per-token scales are paged like their caches
                ops = [*paged.ops, attn]
                attrs.update({"page_size": paged.page_size, "page_table_input": 4, "pool_input": 1})
                count("fuse.decode_attention.paged" if decode else "fuse.attention.paged")
            plus = _lengths_plus(attn) if decode and self.lengths_add else None
            if plus is not None:  # the region's input 3 holds positions; its body adds the offset
                chain, positions, offset = plus
                add = _absorb_lengths_add(attn, positions, offset, position_views)
                inputs[3] = add.inputs[0]
                ops = [add, *ops]
                attrs["lengths_offset"] = offset
                replaced += [o for o in chain if o not in replaced]
                count("fuse.decode_attention.lengths_add")
            rope = _query_rope(attn) if decode and self.rope else None
            if rope is not None:  # q's rotary embedding in the kernel's q load: one launch less a layer
                inputs = [rope.x, *inputs[1:], rope.cos, rope.sin]
                ops = [rope, *ops]
                attrs["rope"] = True
                count("fuse.decode_attention.rope")
            if attn.kv_scale is not None:  # an fp8 cache (fp8-kv-cache): k_scale, v_scale follow lengths
                attrs["kv_scale"] = attn.kv_scale.data
                inputs += scales
                count("fuse.attention.fp8_cache")
            outputs = [attn.result]
            if attn.recent is not None:  # exact-recent: the newest keys unrounded, the region's last inputs
                attrs.update({"exact_rows_input": len(inputs), "recent": attn.recent.value.data})
                rings = [attn.k_recent, attn.v_recent] if attn.k_recent is not None else []
                views = [read_ring_view(r) for r in rings]
                paged_rings = bool(rings) and None not in views and views[0][1] is views[1][1]
                if paged_rings:  # paged-kv: the kernel reads each row's ring through ring_slots
                    rings = [pool for pool, _ in views]
                    ops = [r.owner for r in (attn.k_recent, attn.v_recent)] + ops
                inputs += [attn.k_exact, attn.v_exact] + rings
                writes = _ring_writes(attn, rings) if decode else None
                if writes is not None:  # the step's one row a sequence into the rings, by the attention
                    attrs.update({"ring_write": {"positions_input": len(inputs), "per_row": writes[0].call["args"][4]},
                                  "inplace": [len(inputs) - 2, len(inputs) - 1]})
                    inputs.append(writes[0].inputs[1])
                    ops += writes
                    outputs = [w.results[0] for w in writes] + outputs
                    count("fuse.decode_attention.ring_write")
                if paged_rings:  # ring_slots last
                    attrs["ring_slots_input"] = len(inputs)
                    inputs.append(views[0][1])
                    count("fuse.decode_attention.paged_rings" if decode else "fuse.attention.paged_rings")
            family = "decode_attention" if decode else "attention"
            outline(ops, family, attrs, inputs=inputs, outputs=outputs)
            count("fuse.decode_attention" if decode else "fuse.attention.prompt_over_cache")
        for chain_op in replaced:  # consumers first: the expand, then the add
            if not any(r.uses for r in chain_op.results):
                Rewriter.erase_op(chain_op)


def _lengths_plus(attn: DecodeAttentionOp) -> tuple[list[AtenOp], SSAValue, int] | None:
    """(the chain, positions, offset) when a decode attention's lengths are raise-patterns'
    `positions + offset` ([B] int, or one position expanded over the batch), else None."""
    chain, value = [], attn.lengths
    if aten_target(value.owner) == "aten.expand.default":
        chain.append(value.owner)
        value = tensor_arg(value.owner, 0)
    add = value.owner if value is not None else None
    offset = literal_arg(add, 1) if aten_target(add) == "aten.add.Tensor" else None
    positions = tensor_arg(add, 0) if offset is not None else None
    if not isinstance(offset, int) or isinstance(offset, bool) or positions is None or len(add.call["args"]) != 2 \
            or add.call["kwargs"] or len(static_shape(positions)) != 1:
        return None
    return [*chain, add], positions, offset


def _absorb_lengths_add(attn: DecodeAttentionOp, positions: SSAValue, offset: int, views: dict) -> AtenOp:
    """A fresh `view + offset` giving `attn` its lengths, where view is positions expanded to the
    lengths' shape: one view a shape, shared by every attention. Always a view, even of the same
    shape, so that the region's lengths input is never the value fuse-kv-write-attention adds as
    the write's positions: outline maps one value to one block argument, so the body would read
    one of two inputs that verification draws apart."""
    lengths_type = attn.lengths.type
    shape = static_shape(attn.lengths)
    key = (positions, tuple(shape))
    if key not in views:
        expand = AtenOp("aten.expand.default", {"args": [{"$t": 0}, shape], "kwargs": {}},
                        [positions], [TensorType(positions.type.element_type, shape)])
        owner = positions.owner  # an op, or (a user input) the block whose argument it is
        Rewriter.insert_op(expand, InsertPoint.after(owner) if isinstance(owner, Operation) else InsertPoint.at_start(owner))
        views[key] = expand.results[0]
    add = AtenOp("aten.add.Tensor", {"args": [{"$t": 0}, offset], "kwargs": {}}, [views[key]], [lengths_type])
    Rewriter.insert_op(add, InsertPoint.before(attn))
    attn.operands[3] = add.results[0]
    return add


def _ring_writes(attn: DecodeAttentionOp, rings: list) -> list[StateUpdateOp] | None:
    """The two ring writes right after a decode attention (fp8-kv-cache's exact-recent), K's then
    V's, when they store its own rows (k_exact / v_exact) at one positions value into `rings`
    (its k_recent / v_recent, or with paged-kv the pools they select from, at the same
    ring_slots): one row a sequence, whose slot no query of this step reads (its position is N
    before the own row's), so the attention's kernel may store it; else None."""
    block = attn.parent_block()
    index = block.get_operation_index(attn)
    following = list(block.ops)[index + 1:index + 3]
    if len(following) != 2 or not all(isinstance(w, StateUpdateOp) and w.target.data == RING_WRITE for w in following):
        return None
    by_ring = {w.inputs[0]: w for w in following}
    writes = [by_ring.get(r) for r in rings] if len(rings) == 2 else [None]
    slots = [w.inputs[3:] for w in writes if w is not None]
    paged = rings and rings[0] is not attn.k_recent  # (the pools of ring views: written at their slots)
    if None in writes or [w.inputs[2] for w in writes] != [attn.k_exact, attn.v_exact] \
            or any(list(s) != ([attn.k_recent.owner.inputs[1]] if paged else []) for s in slots) \
            or writes[0].inputs[1] is not writes[1].inputs[1] or writes[0].call["args"][4] != writes[1].call["args"][4] \
            or any(len(list(w.results[0].uses)) for w in writes):
        return None
    return writes


def _query_rope(attn):
    """The coopt.rope producing a decode attention's q when nothing else reads it, else None."""
    rope = attn.q.owner
    if not isinstance(rope, RopeOp) or only_user(attn.q) is not attn or isinstance(rope.parent_op(), KernelOp):
        return None
    return rope
