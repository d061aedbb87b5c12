"""fuse-kv-write-attention: a decode step's kv_write region and the decode attention reading the
caches it wrote become one decode_attention region (schema in coopt/templates/decode_attention.py,
"kv_write" attrs): one launch a layer less, and the new row no longer makes a round trip through
memory between the two kernels (bench/NOTES-decode.md: kv_write is 1.3 µs and a launch gap a
layer at batch 1 and 32).

Matched: a `coopt.kernel` of family decode_attention whose k and v inputs are the two results of
one kv_write kernel, directly or through batch views (`aten.slice` of dim 0 from 0: the cache's
first B rows, which the kernel indexes in the whole cache alike), nothing else reading those
results. The kv_write must be the plain form: unpaged, no fp8 (quant "none", no offsets), one
position for every sequence (not per row). Both kernels' bodies are inlined and outlined again
as one region: inputs the attention's (the caches before the write in place of the written
ones), then the write's positions, k, v and, with K's rope, its cos and sin unless they are the
query's (attrs kv_write's "rope_tables_input" says where they are); outputs the two
caches written in place (attrs "inplace" [1, 2]) and the attention's output. Its body is the two
bodies in order, so the reference writes then attends as before.

Left alone, each with a counter `fuse.kv_write_attention.skipped.<why>`: a paged or fp8
attention (`paged`, `fp8`), caches not written by a kv_write just before (`no_write`), a write
of another form (`write_form`), written caches read elsewhere too (`read_elsewhere`), and a
group that cannot be outlined in place (`order`).

Not in the default pipeline until measured on the GPU: `registry.FOLDED_KV_WRITE_PIPELINE` is the
default with it after fuse-kv-write (bench/decode.py mode coopt-fold).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.ir.dialect import AtenOp, KernelOp, YieldOp
from coopt.ir.outline import can_outline, outline
from coopt.passes.base import CooptPass, aten_target, literal_arg
from coopt.passes.stats import count

_SLICE = "aten.slice.Tensor"


@dataclass(frozen=True)
class FuseKvWriteAttention(CooptPass):
    name = "fuse-kv-write-attention"
    summary = "a decode step's kv_write and the decode attention reading its caches → one decode_attention region"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for attention in [o for o in op.walk() if isinstance(o, KernelOp) and o.family.data == "decode_attention"]:
            why = _fold(attention)
            count("fuse.kv_write_attention" if why is None else f"fuse.kv_write_attention.skipped.{why}")


def _fold(attention: KernelOp) -> str | None:
    """Fold the kv_write feeding `attention` into it; None when done, else why not."""
    attrs = attention.family_attrs
    if attrs.get("page_size"):
        return "paged"
    if attrs.get("kv_scale"):
        return "fp8"
    if attrs.get("kv_write"):
        return "folded"
    (k_write, k_views), (v_write, v_views) = (_written_by(attention.inputs[i]) for i in (1, 2))
    write = k_write.owner if k_write is not None else None
    if not (isinstance(write, KernelOp) and write.family.data == "kv_write"
            and k_write is write.results[0] and v_write is not None and v_write is write.results[1]):
        return "no_write"
    write_attrs = write.family_attrs
    if (write_attrs.get("quant", "none") != "none" or write_attrs.get("page_size") or write_attrs.get("positions")
            or write_attrs.get("k_offset") or write_attrs.get("v_offset")):
        return "write_form"
    views = k_views + v_views
    readers = {*views, attention}
    if any(use.operation not in readers for result in write.results for use in result.uses):
        return "read_elsewhere"
    if not can_outline([write, *views, attention]):
        return "order"
    rope = bool(write_attrs.get("rope"))
    caches, written_inputs = list(write.inputs[:2]), list(write.inputs[2:5])
    folded = {"positions_input": len(attention.inputs), "rope": rope}
    if rope:
        # K's cos and sin: the query's own tables when they are the same values (a Llama layer
        # gathers them once), so that no value is two inputs (verification would draw two)
        tables = list(write.inputs[5:7])
        shared = attrs.get("rope") and tables == list(attention.inputs[4:6])
        folded["rope_tables_input"] = 4 if shared else len(attention.inputs) + 3
        written_inputs += [] if shared else tables
    inputs = [attention.inputs[0], *caches, *attention.inputs[3:], *written_inputs]
    write_ops, written = _inline(write)
    attention_ops, (out,) = _inline(attention)
    outline([*write_ops, *views, *attention_ops], "decode_attention",
            {**attrs, "kv_write": folded, "inplace": [1, 2]},
            inputs=inputs, outputs=[*written, out])
    return None


def _written_by(value: SSAValue) -> tuple[SSAValue | None, list[Operation]]:
    """(the value `value` is a batch view of, the views in between): through slices of dim 0
    from 0 with no other reader."""
    views: list[Operation] = []
    while isinstance(value.owner, AtenOp) and aten_target(value.owner) == _SLICE:
        view = value.owner
        dim = literal_arg(view, 1, "dim", 0)
        start = literal_arg(view, 2, "start", 0)
        step = literal_arg(view, 4, "step", 1)
        if dim != 0 or start not in (0, None) or step != 1 or len(list(view.results[0].uses)) != 1:
            return None, views
        views.append(view)
        value = view.inputs[0]
    return value, views


def _inline(kernel: KernelOp) -> tuple[list[Operation], list[SSAValue]]:
    """Replace `kernel` by clones of its body's ops in its place; (the clones, what it yielded)."""
    mapping: dict[SSAValue, SSAValue] = dict(zip(kernel.body.block.args, kernel.inputs))
    clones: list[Operation] = []
    yielded: list[SSAValue] = []
    for inner in kernel.body.block.ops:
        if isinstance(inner, YieldOp):
            yielded = [mapping[v] for v in inner.values]
            continue
        clone = inner.clone(value_mapper=mapping)
        Rewriter.insert_op(clone, InsertPoint.before(kernel))
        mapping.update(zip(inner.results, clone.results))
        clones.append(clone)
    for old, new in zip(kernel.results, yielded):
        old.replace_all_uses_with(new)
    kernel.detach()
    kernel.erase()
    return clones, yielded
