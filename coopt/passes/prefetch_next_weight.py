"""prefetch-next-weight: a decode GEMV region takes the weight of the GEMV launched right after it
as one more input, so that its kernel can pull that weight's first bytes into L2 once its own
weight is streamed.

Why: at 32 rows each GEMV of a decode step is 4-7 µs over its bytes (bench/NOTES-decode.md,
sessions 46-47), spent where HBM is not busy: the programs that finished wait for the last ones,
o's and down's split-K meeting, the next launch's ramp. Weights are no kernel's output, so the
next GEMV's first bytes can already move then (templates/matmul_epilogue: the "tail_prefetch"
form; how many bytes, if any, the build decides by timing the whole step: off until it does).

Matched: a matmul_epilogue region P of at most `max_rows` rows and at least `min_rows` (batch 1
runs the CUDA GEMV, which has no such form), without a tail prefetch yet, whose next op in its
block that launches work is another matmul_epilogue region C whose weight (input 1) is a model
weight (WeightOp). Anything else that runs between them (an attention, an ATen op) would use the
L2 or the time first: left alone. Rewritten in place: P takes C's weight as its last input, attrs
"tail_prefetch" {"input": that index, "layout": C's b_layout}; its body does not read it (the
region's reference and results are unchanged).
Counted `prefetch.next_weight`; left alone, `prefetch.next_weight.skipped.<why>`: rows out of
range (`rows`), the next op that launches work not a GEMV region on a weight (`next`).
Runs after every fusion pass (the regions and their order are final then).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation

from coopt.ir.dialect import FallbackOp, KernelOp, WeightOp
from coopt.ir.outline import inline, outline
from coopt.ir.summary import symbol_table
from coopt.ir.unfused import pytorch_target
from coopt.passes.base import CooptPass, make_available
from coopt.passes.fuse_decode_gemv import row_bound
from coopt.passes.stats import count


@dataclass(frozen=True)
class PrefetchNextWeight(CooptPass):
    name = "prefetch-next-weight"
    summary = "a decode GEMV region takes the next GEMV's weight, to pull its first bytes into L2"

    min_rows: int = 2  # batch 1: the CUDA GEMV, which does not prefetch
    max_rows: int = 64  # the GEMV kernel's range (matmul_epilogue's GEMV_MAX_M)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        highs = {name: bounds[1] for name, bounds in symbol_table(op).items()}
        for producer in [k for k in op.walk() if _gemv_region(k)]:
            why = self._link(producer, highs)
            count("prefetch.next_weight" if why is None else f"prefetch.next_weight.skipped.{why}")

    def _link(self, producer: KernelOp, highs: dict[str, int]) -> str | None:
        """Give `producer` the next GEMV's weight; None when done, else why not."""
        rows = row_bound(producer.inputs[0], highs)
        if rows is None or not self.min_rows <= rows <= self.max_rows:
            return "rows"
        consumer = _next_launch(producer)
        if not (_matmul_region(consumer) and isinstance(consumer.inputs[1].owner, WeightOp)):
            return "next"
        weight = consumer.inputs[1]
        if weight in producer.inputs or not make_available(weight, producer):
            return "next"
        attrs, inputs = producer.family_attrs, list(producer.inputs)
        ops, yielded = inline(producer)
        prefetch = {"input": len(inputs), "layout": consumer.family_attrs["b_layout"]}
        outline(ops, "matmul_epilogue", {**attrs, "tail_prefetch": prefetch}, inputs=[*inputs, weight],
                outputs=list(yielded), unread=(weight,))
        return None


def _matmul_region(op) -> bool:
    return isinstance(op, KernelOp) and op.family.data == "matmul_epilogue"


def _gemv_region(op) -> bool:
    """A matmul_epilogue region without a tail prefetch yet."""
    return _matmul_region(op) and "tail_prefetch" not in op.family_attrs


def _next_launch(op: Operation) -> Operation | None:
    """The next op after `op` in its block that launches work (a region, a fallback, an ATen op
    other than a view); None at the block's end."""
    at = op.next_op
    while at is not None and not isinstance(at, (KernelOp, FallbackOp)) and pytorch_target(at) is None:
        at = at.next_op
    return at
