"""fuse-norm-statistics: a decode GEMV's RMSNorm prologue takes its rows' sums of squares from the
GEMV region that produced its input, instead of normalizing the rows itself.

Why: at 32 rows the RMSNorm prologue runs ahead of the GEMV in a row kernel of its own
(NORM_FIRST: in the tl.dot loop it measured 2x slower), 17 of them a Llama step, ~28 µs of kernel
time and ~10 µs of launch gaps in a 1.81 ms b32 step (bench/NOTES-decode.md). Their input h is
the output of the previous GEMV region (o or down projection + residual), whose programs hold h
tile by tile anyway: they can store h * g (the norm weight applied) and the sums of h^2 over
`chunk`-column chunks of each row. The norm's GEMV then streams h * g and scales its fp32
accumulator by rsqrt(sum of the chunk sums / K + eps), which it loads once at its start:
rms_norm(h) * g @ W = (h * g @ W) / rms(h). Every chunk sum has one writer (a program's tile
holds whole chunks), so nothing meets and nothing is atomic.

Matched: a matmul_epilogue region C with an RMSNorm prologue (kind "rms_norm", with a weight g)
of at least `min_rows` rows (at batch 1 the in-loop norm of the multiply-and-sum GEMV costs
nothing: left as it is), whose a is an output h of another matmul_epilogue region P (without
row statistics yet), h's width a static multiple of `chunk`. Rewritten in place (both bodies
inlined and outlined again, coopt/ir/outline.py):
- P: attrs "row_squares" {"chunk", "weight_input" (g, appended to its inputs), "output" (which of
  its outputs is h)}; two more outputs, hg = h * g in h's dtype and sq [N / chunk, M] fp32 (the
  chunk sums of h as rounded to its dtype, squared in fp32); its body computes them after its ops.
  h's other readers (the next residual add) keep reading h.
- C: prologue {"kind": "rms_norm_stats", "eps", "squares_input": j}; inputs hg, b, [bias], sq (at
  j, where g was), extras; its body is linear(hg) * rsqrt(sum(sq, 0) / K + eps) per row (in fp32,
  back to the linear's dtype), then the ops after the linear as before.
With `embedding` (default on), P may also be the embedding gather before the first layer,
aten.embedding(table, ids) of a weight table: it and the statistics' ops become one region of
family "embedding_rows" (inputs table, ids, g; outputs h, hg, sq; coopt/templates/embedding_rows.py),
so that the first layer's norm reads statistics as every later one does, one launch instead of
ATen's gather and a norm row kernel (NORM_FIRST).
Counted `fuse.norm_statistics`; left alone, `fuse.norm_statistics.skipped.<why>`: too few rows
(`rows`), a's producer neither a matmul_epilogue region nor (with `embedding`) such an embedding
(`producer`), a width that is no multiple of the chunk or leading dims whose row count is not a
single symbol (`shape`), a norm without weight (`no_weight`), a g of another dtype than h
(`dtype`), a g that is already an input of P or not defined before it (`order`).
Templates: coopt/templates/matmul_epilogue.py (GEMV points only).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import Float32Type, ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.ir.dialect import AtenOp, ElementwiseOp, KernelOp, LinearOp, RMSNormOp, WeightOp
from coopt.ir.outline import inline, outline
from coopt.ir.summary import dtype_name, symbol_table
from coopt.passes.base import CooptPass, aten_op, aten_target, make_available, tensor_arg
from coopt.passes.fuse_decode_gemv import row_bound
from coopt.passes.shapes import dims, typed
from coopt.passes.stats import count


@dataclass(frozen=True)
class FuseNormStatistics(CooptPass):
    name = "fuse-norm-statistics"
    summary = "a GEMV's RMSNorm prologue takes its rows' sums of squares from the GEMV region that produced its input"

    min_rows: int = 2  # fewer rows (batch 1): the in-loop norm of the multiply-and-sum GEMV stays
    chunk: int = 64  # columns per partial sum of squares: a producer's BLOCK_N must be a multiple
    embedding: bool = True  # the first norm's input gathered by an embedding: gather and statistics in one region

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        highs = {name: bounds[1] for name, bounds in symbol_table(op).items()}
        seen: set[KernelOp] = set()
        # A worklist, not one walk: a producer may itself have a norm prologue, and rewriting it
        # replaces its kernel by a new one, still to be looked at as a consumer.
        while (consumer := next((o for o in op.walk() if _norm_consumer(o) and o not in seen), None)) is not None:
            seen.add(consumer)
            why = self._fuse(consumer, highs)
            count("fuse.norm_statistics" if why is None else f"fuse.norm_statistics.skipped.{why}")

    def _fuse(self, consumer: KernelOp, highs: dict[str, int]) -> str | None:
        """Rewrite `consumer` and the region producing its a; None when done, else why not."""
        attrs = consumer.family_attrs
        h = consumer.inputs[0]
        rows = row_bound(h, highs)
        if rows is None or rows < self.min_rows:
            return "rows"
        producer = h.owner
        gather = self.embedding and _embedding_of_a_weight(producer)
        if not gather and not (isinstance(producer, KernelOp) and producer.family.data == "matmul_epilogue"
                               and "row_squares" not in producer.family_attrs):
            return "producer"
        width, row_dim = dims(h)[-1], _row_dim(dims(h)[:-1])
        if not isinstance(width, int) or width % self.chunk or row_dim is None:
            return "shape"
        if not attrs["prologue"].get("has_weight"):
            return "no_weight"
        g = consumer.inputs[2 + int(bool(attrs.get("has_bias")))]
        if g.type.element_type != h.type.element_type:
            return "dtype"  # hg = h * g is kept in h's dtype, as the norm's output was in g's
        if g in producer.inputs or not make_available(g, producer):
            return "order"
        if gather:
            hg, sq = self._gather_rows(producer, g, row_dim)
        else:
            hg, sq = self._add_row_squares(producer, h, g, row_dim)
        _scale_by_statistics(consumer, hg, sq)
        return None

    def _gather_rows(self, embedding: AtenOp, g: SSAValue, row_dim) -> tuple[SSAValue, SSAValue]:
        """The embedding and the statistics of its rows as one embedding_rows region; its (hg, sq)."""
        table, ids, h = tensor_arg(embedding, 0), tensor_arg(embedding, 1), embedding.results[0]
        stats = _row_squares_ops(h, g, self.chunk, row_dim)
        at = embedding
        for new in stats:
            Rewriter.insert_op(new, InsertPoint.after(at))
            at = new
        attrs = {"row_squares": {"chunk": self.chunk, "weight_input": 2, "output": 0},
                 "index_input": 1, "index_bound": [0, 0]}
        kernel = outline([embedding, *stats], "embedding_rows", attrs, inputs=[table, ids, g],
                         outputs=[h, stats[0].results[0], stats[-1].results[0]])
        return kernel.results[1], kernel.results[2]

    def _add_row_squares(self, producer: KernelOp, h: SSAValue, g: SSAValue, row_dim) -> tuple[SSAValue, SSAValue]:
        """P with g as its last input and (hg, sq) as its last outputs; returns them."""
        attrs, inputs, which = producer.family_attrs, list(producer.inputs), list(producer.results).index(h)
        ops, yielded = inline(producer)
        h = yielded[which]
        stats = _row_squares_ops(h, g, self.chunk, row_dim)
        for new in stats:
            Rewriter.insert_op(new, InsertPoint.after(ops[-1]))
            ops.append(new)
        row_squares = {"chunk": self.chunk, "weight_input": len(inputs), "output": which}
        kernel = outline(ops, "matmul_epilogue", {**attrs, "row_squares": row_squares},
                         inputs=[*inputs, g], outputs=[*yielded, stats[0].results[0], stats[-1].results[0]])
        return kernel.results[-2], kernel.results[-1]


def _embedding_of_a_weight(op) -> bool:
    """aten.embedding(table, ids) of a model weight's 2-D table (the gather before the first layer)."""
    if aten_target(op) != "aten.embedding.default":
        return False
    table, ids = tensor_arg(op, 0), tensor_arg(op, 1)
    return (table is not None and ids is not None and isinstance(table.owner, WeightOp)
            and len(dims(table)) == 2 and dims(ids) == dims(op.results[0])[:-1])


def _norm_consumer(op: Operation) -> bool:
    """A matmul_epilogue region that normalizes its rows itself (fuse-decode-gemv's prologue)."""
    return (isinstance(op, KernelOp) and op.family.data == "matmul_epilogue"
            and (op.family_attrs.get("prologue") or {}).get("kind") == "rms_norm")


def _row_dim(lead: list):
    """The row count M of leading dims as one dim: an int, or the one symbol among 1s; else None."""
    symbols = [d for d in lead if not isinstance(d, int)]
    if not symbols:
        rows = 1
        for d in lead:
            rows *= d
        return rows
    return symbols[0] if len(symbols) == 1 and all(d == 1 for d in lead if isinstance(d, int)) else None


def _row_squares_ops(h: SSAValue, g: SSAValue, chunk: int, row_dim) -> list[Operation]:
    """hg = h * g, then sq = (h.float() ** 2) summed over chunks of columns, as [N / chunk, M]."""
    shape, f32 = dims(h), Float32Type()
    chunks = shape[-1] // chunk  # a whole number: _fuse checked the width
    hg = ElementwiseOp("mul", [0, 1], [h, g], h.type)
    h32 = aten_op("aten._to_copy.default", [{"$t": 0}], [h], typed(f32, shape), {"dtype": {"$dtype": "float32"}})
    squares = aten_op("aten.mul.Tensor", [{"$t": 0}, {"$t": 0}], [h32.results[0]], typed(f32, shape))
    chunked = aten_op("aten.reshape.default", [{"$t": 0}, [-1, chunks, chunk]], [squares.results[0]],
                    typed(f32, [row_dim, chunks, chunk]))
    sums = aten_op("aten.sum.dim_IntList", [{"$t": 0}, [-1]], [chunked.results[0]], typed(f32, [row_dim, chunks]))
    sq = aten_op("aten.permute.default", [{"$t": 0}, [1, 0]], [sums.results[0]], typed(f32, [chunks, row_dim]))
    return [hg, h32, squares, chunked, sums, sq]


def _scale_by_statistics(consumer: KernelOp, hg: SSAValue, sq: SSAValue) -> None:
    """C reads hg and sq: its body's norm goes, the linear reads hg and its result is scaled by
    rsqrt(sum(sq, 0) / K + eps) per row."""
    attrs, inputs = consumer.family_attrs, list(consumer.inputs)
    squares_at = 2 + int(bool(attrs.get("has_bias")))
    ops, yielded = inline(consumer)
    norm = next(o for o in ops if isinstance(o, RMSNormOp))
    linear = next(o for o in ops if isinstance(o, LinearOp) and o.x is norm.result)
    lead, width = dims(linear.x)[:-1], dims(linear.x)[-1]
    scale_ops = _rstd_ops(sq, lead, width, norm.eps.value.data)
    for new in scale_ops:
        Rewriter.insert_op(new, InsertPoint.before(linear))
    linear.operands = [hg, *linear.operands[1:]]
    out = linear.result
    scaled = ElementwiseOp("mul", [0, 1], [out, scale_ops[-1].results[0]], typed(Float32Type(), dims(out)))
    back = aten_op("aten._to_copy.default", [{"$t": 0}], [scaled.results[0]], out.type,
                 {"dtype": {"$dtype": dtype_name(out)}})
    Rewriter.insert_op(scaled, InsertPoint.after(linear))
    Rewriter.insert_op(back, InsertPoint.after(scaled))
    out.replace_uses_with_if(back.results[0], lambda use: use.operation is not scaled)
    yielded = [back.results[0] if v is out else v for v in yielded]
    ops.remove(norm)
    norm.detach()
    norm.erase()
    ops = [*scale_ops, *ops]
    at = ops.index(linear) + 1
    ops[at:at] = [scaled, back]
    prologue = {"kind": "rms_norm_stats", "eps": attrs["prologue"]["eps"], "squares_input": squares_at}
    new_inputs = [hg, *inputs[1:squares_at], sq, *inputs[squares_at + 1:]]
    outline(ops, "matmul_epilogue", {**attrs, "prologue": prologue}, inputs=new_inputs, outputs=yielded)


def _rstd_ops(sq: SSAValue, lead: list, width: int, eps: float) -> list[Operation]:
    """rsqrt(sum(sq, 0) / K + eps), shaped [*lead, 1] to scale the linear's rows."""
    f32, rows = Float32Type(), dims(sq)[1]
    total = aten_op("aten.sum.dim_IntList", [{"$t": 0}, [0]], [sq], typed(f32, [rows]))
    mean = ElementwiseOp("div", [0, {"$f": float(width)}], [total.results[0]], typed(f32, [rows]))
    shifted = ElementwiseOp("add", [0, {"$f": float(eps)}], [mean.results[0]], typed(f32, [rows]))
    rstd = ElementwiseOp("rsqrt", [0], [shifted.results[0]], typed(f32, [rows]))
    view = [d if isinstance(d, int) else -1 for d in lead]
    shaped = aten_op("aten.reshape.default", [{"$t": 0}, [*view, 1]], [rstd.results[0]], typed(f32, [*lead, 1]))
    return [total, mean, shifted, rstd, shaped]
