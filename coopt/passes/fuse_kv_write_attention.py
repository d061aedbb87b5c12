"""fuse-kv-write-attention: a decode step's kv_write region and the decode attention reading the
caches it wrote become one decode_attention region (schema in coopt/templates/decode_attention.py,
"kv_write" attrs): one launch a layer less, and the new row no longer makes a round trip through
memory between the two kernels (bench/NOTES-decode.md: kv_write is 1.3 µs and a launch gap a
layer at batch 1 and 32).

Matched: a `coopt.kernel` of family decode_attention whose k and v inputs are the two results of
one kv_write kernel, directly or through batch views (`aten.slice` of dim 0 from 0: the cache's
first B rows, which the kernel indexes in the whole cache alike), nothing else reading those
results. The kv_write must be unpaged with one position for every sequence (not per row), and
quantize as the attention reads: plain caches (quant "none"), or fp8 ones with per-tensor /
per-head scales (fp8-kv-cache's calibrated form, values-only included) that are the attention's
own k_scale / v_scale values (else `scales_differ`: one value, one input); its smooth-k /
smooth-v offsets become the region's last inputs (attrs kv_write "k_offset_input",
"v_offset_input") and the kernel quantizes the row as the kv_write template does. Counted
`fuse.kv_write_attention.fp8`. Both kernels' bodies are inlined and outlined again
as one region: inputs the attention's (the caches before the write in place of the written
ones), then the write's positions, k, v and, with K's rope, its cos and sin unless they are the
query's (attrs kv_write's "rope_tables_input" says where they are); outputs the two
caches written in place (attrs "inplace" [1, 2]) and the attention's output. Its body is the two
bodies in order, so the reference writes then attends as before.

Rotary tables read whole: where every table the region takes (the query's cos, sin and K's own)
is a row gather `table[positions]` of a [S, D] table (S at least the cache's length) by the
write's own positions, as a Llama step gathers cos and sin once for all its layers, the region
takes the tables themselves with a clone of each gather in its body (attrs kv_write
"gathered_tables"); the kernel reads their row at the position, and the step's gathers, left
without readers, go (two launches a step). K's rows gathered from the query's tables apart
become the query's inputs (`rope_tables_input` 4). Counted `fuse.kv_write_attention.gathered_tables`.
Measured on the H200: -11 µs a b1 / 2048 step with the fold against the unfolded default
(bench/RESULTS.md session 14).

fp8-kv-cache's exact-recent: an attention that reads its newest rows unrounded folds where those
rows are exactly what the write computes before rounding (its `exact_outputs`, or its k / v
inputs where it rounds them as they are) and its rings are written at the write's position: the
region drops k_exact / v_exact (the body computes them: the write's ops come first) and takes the
rings last (attrs "exact_rows": "folded", "rings_input", the rings in place after the caches;
schema: templates/attention.py, folded_exact). Counted `fuse.kv_write_attention.exact_rows`.

Left alone, each with a counter `fuse.kv_write_attention.skipped.<why>`: a paged attention or
one with per-token fp8 scales, which the write computes and stores (`paged`, `fp8`), an exact one
whose rows or rings are not the write's (`exact_rows`), caches not
written by a kv_write just before (`no_write`), a write of another form (`write_form`) or
quantizing with other scale values (`scales_differ`), written caches read elsewhere too
(`read_elsewhere`), and a group that cannot be outlined in place (`order`).

In the default pipeline since session 13 (bench/RESULTS.md: -6 µs a step at b1 / 2048, -3.5 at
b32). Since session 18 the kernel's split whose keys hold the new row stores it before its key
loop, which reads it back as any row (the folded launch as fast as the plain attention on the
H200: bench/RESULTS.md session 18);
`registry.UNFOLDED_KV_WRITE_PIPELINE` is the default without it (bench/decode.py mode
coopt-unfolded).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.ir.dialect import AtenOp, KernelOp
from coopt.ir.outline import can_outline, inline, outline
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
    granularity = attrs.get("kv_scale")
    if granularity not in (None, "per-tensor", "per-head"):  # per-token: the write computes and stores scales
        return "fp8"
    if attrs.get("kv_write"):
        return "folded"
    (k_write, k_views), (v_write, v_views) = (_written_by(attention.inputs[i]) for i in (1, 2))
    write = k_write.owner if k_write is not None else None
    if not (isinstance(write, KernelOp) and write.family.data == "kv_write"
            and k_write is write.results[0] and v_write is not None and v_write is write.results[1]):
        return "no_write"
    write_attrs = write.family_attrs
    if (write_attrs.get("quant", "none") != (granularity or "none") or write_attrs.get("page_size")
            or write_attrs.get("positions")):
        return "write_form"
    exact = _exact_rows(attention, write)
    if isinstance(exact, str):
        return exact
    attrs, own_inputs, rings = exact
    rope = bool(write_attrs.get("rope"))
    # an fp8 write quantizes with the attention's own scales (values-only: V's alone), the same
    # values: the kernel has one k_scale and one v_scale input
    first_scale = 5 + 2 * rope
    scales = 0 if granularity is None else 1 if write_attrs.get("values_only") else 2
    if list(write.inputs[first_scale:first_scale + scales]) != list(own_inputs[len(own_inputs) - scales:]):
        return "scales_differ"
    offsets = list(write.inputs[first_scale + scales:])  # smooth-k's / smooth-v's, in that order
    views = k_views + v_views
    readers = {*views, attention}
    if any(use.operation not in readers for result in write.results for use in result.uses):
        return "read_elsewhere"
    if not can_outline([write, *views, attention]):
        return "order"
    caches, written_inputs = list(write.inputs[:2]), list(write.inputs[2:5])
    folded = {"positions_input": len(own_inputs), "rope": rope}
    if rope:
        # K's cos and sin: the query's own tables when they are the same values (a Llama layer
        # gathers them once), so that no value is two inputs (verification would draw two)
        tables = list(write.inputs[5:7])
        shared = attrs.get("rope") and tables == list(own_inputs[4:6])
        folded["rope_tables_input"] = 4 if shared else len(own_inputs) + 3
        written_inputs += [] if shared else tables
    inputs = [own_inputs[0], *caches, *own_inputs[3:], *written_inputs]
    gathers = _own_gathers(inputs, _table_indices(attrs, folded), written_inputs[0], (write, attention),
                           rows=caches[0].type.get_shape()[2])
    if gathers:  # the tables whole, read at the position in the kernel (their gathers in its body)
        folded["gathered_tables"] = True
        count("fuse.kv_write_attention.gathered_tables")
        own = folded.get("rope_tables_input")
        if own not in (None, 4) and attrs.get("rope") and inputs[own:own + 2] == inputs[4:6]:
            # K's rows were gathered from the query's tables apart: one table, one input (a value
            # as two inputs would be drawn apart by verification and read as one by the reference)
            del inputs[own:own + 2]
            folded["rope_tables_input"] = 4
    if granularity is not None:
        count("fuse.kv_write_attention.fp8")
    # the offsets last (after any table dropped above), K's before V's as the write has them
    named = [knob for knob in ("k_offset", "v_offset") if write_attrs.get(knob)]
    folded.update({f"{knob}_input": len(inputs) + i for i, knob in enumerate(named)})
    inputs += offsets
    inplace = [1, 2]
    if rings:  # exact-recent's rings last, written in place at the step's position
        attrs["rings_input"] = len(inputs)
        inplace += [len(inputs), len(inputs) + 1]
        inputs += rings
    write_ops, written = inline(write)
    attention_ops, (*ring_outputs, out) = inline(attention)
    # (an exact write's rows before rounding, which the attention read, are inside the region now)
    outline([*gathers, *write_ops, *views, *attention_ops], "decode_attention",
            {**attrs, "kv_write": folded, "inplace": inplace},
            inputs=inputs, outputs=[*written[:2], *ring_outputs, out])
    if "exact_rows" in attrs:
        count("fuse.kv_write_attention.exact_rows")
    return None


def _exact_rows(attention: KernelOp, write: KernelOp) -> tuple[dict, list[SSAValue], list[SSAValue]] | str:
    """(the folded region's attrs so far, the attention's inputs but its exact rows', its rings)
    where the attention reads exactly what `write` computes before rounding as its own rows and
    writes its rings at the write's position (fp8-kv-cache's exact-recent, one position for every
    sequence); the attention as it is where it reads no exact rows; else why not."""
    attrs = attention.family_attrs
    at = attrs.get("exact_rows_input")
    if at is None:
        return attrs, list(attention.inputs), []
    window, names = attrs["recent"], write.family_attrs.get("exact_outputs", [])
    # the rows before rounding: the write's output of them, or its k / v input where it rounds them as they are
    computed = [write.results[2 + names.index(name)] if name in names else write.inputs[3 + i] for i, name in enumerate("kv")]
    if list(attention.inputs[at:at + 2]) != computed:
        return "exact_rows"
    ring_write, rings = attrs.get("ring_write"), list(attention.inputs[at + 2:at + 4]) if window > 1 else []
    if "ring_slots_input" in attrs:
        return "exact_rows"  # (paged-kv's ring slots: the folded form indexes the rings by batch row)
    if rings and (not isinstance(ring_write, dict) or ring_write.get("per_row")
                  or attention.inputs[ring_write["positions_input"]] is not write.inputs[2]):
        return "exact_rows"  # (the rings written elsewhere, or at other positions)
    folded = {k: v for k, v in attrs.items() if k not in ("exact_rows_input", "ring_write", "inplace")}
    return {**folded, "exact_rows": "folded"}, list(attention.inputs[:at]), rings


def _table_indices(attrs: dict, folded: dict) -> list[int]:
    """Indices (in the folded region's inputs) of every rotary table: the query's cos, sin (4, 5)
    and K's own after v_new."""
    starts = {4} if attrs.get("rope") else set()
    if folded.get("rope"):
        starts.add(folded["rope_tables_input"])
    return [i for start in sorted(starts) for i in (start, start + 1)]


def _own_gathers(inputs: list[SSAValue], tables: list[int], positions: SSAValue,
                 kernels: tuple[KernelOp, ...], rows: int) -> list[Operation]:
    """Where every rotary table input is a row gather `table[positions]` of a [S, D] table by the
    write's own positions, S >= `rows` (the cache's: every position the write takes has its
    row; a Llama step gathers cos and sin once for all its layers): a clone of each gather,
    before the first kernel, that the kernels now read instead (the clones, to go into the
    region), and `inputs` holding the tables themselves; else [] and nothing changed. The region
    then reads the tables' row itself: the step's 2 gather launches go."""
    if not tables or not all(_row_gather_of(inputs[i], positions, rows) for i in tables):
        return []
    clones: dict[SSAValue, Operation] = {}
    for original in dict.fromkeys(inputs[i] for i in tables):
        clone = original.owner.clone()
        Rewriter.insert_op(clone, InsertPoint.before(kernels[0]))
        for kernel in kernels:
            kernel.operands = [clone.results[0] if v is original else v for v in kernel.operands]
        clones[original] = clone
        if not list(original.uses):  # the last layer's fold takes the step's own gather
            original.owner.detach()
            original.owner.erase()
    for i in tables:
        inputs[i] = clones[inputs[i]].inputs[0]  # the table the clone gathers from
    return list(clones.values())


def _row_gather_of(value: SSAValue, positions: SSAValue, rows: int) -> bool:
    """Whether `value` is aten.index(table, [positions]) of a [S, D] table, S >= rows."""
    op = value.owner
    if not (isinstance(op, AtenOp) and aten_target(op) == "aten.index.Tensor" and len(op.inputs) == 2):
        return False
    table = op.inputs[0]
    shape = table.type.get_shape()
    return (op.inputs[1] is positions and len(shape) == 2 and isinstance(shape[0], int) and shape[0] >= rows
            and literal_arg(op, 1, "indices", None) == [{"$t": 1}])


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
