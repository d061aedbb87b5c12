"""fold-constants: an ATen expression of weights alone is computed once, at build time, and read
as a weight of its own.

A model may compute from its parameters and buffers on every call what no input changes:
transformers' rotary tables start from cat(inv_freq, inv_freq) once simplify-aten has moved the
cat onto the buffer, Gemma's RMSNorm multiplies by (1 + weight). Left in the program each is a
kernel launch a step, and it hides a plain weight from the patterns that would take it into a
region. Here such an expression becomes a `coopt.weight` whose ref (`coopt.const:...`) names a
recipe recorded in the module attribute `coopt.constants` ({ref: {"lines", "result"}}: eager
lines over `state[name]`, the emitter's own); the emitter (`compile.program_weights`) runs it on
the model's state and stores the result like any weight. The pass touches no data.

Folded: calls of `FOLDABLE` (views, cat, +, -, *, /, negation, dtype casts: each one IEEE
operation, so the build's device computes what the target's would) whose tensor operands are all
weights the program never writes, or such calls; static shapes only; an expression of views alone
stays (a view costs nothing); one whose result is larger than both `max_growth` times its
weights and `max_elements` stays (a broadcast materialised would cost more memory than its
launch). Counter `fold.constants`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr, TensorType
from xdsl.dialects.func import FuncOp
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.codegen.torch_lines import Names, aten_call
from coopt.ir.dialect import AtenOp, WeightOp
from coopt.passes.base import VIEW_OPS, CooptPass, static_shape, written_refs
from coopt.passes.stats import count

CONSTANTS_ATTR = "coopt.constants"
CONST_PREFIX = "coopt.const:"
FOLDABLE = VIEW_OPS | {
    "aten.cat.default", "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor",
    "aten.neg.default", "aten._to_copy.default", "aten.clone.default",
}


def constants_record(module: ModuleOp) -> dict:
    """{ref: {"lines": [...], "result": name}} of the weights this pass made ({} when none)."""
    attr = module.attributes.get(CONSTANTS_ATTR)
    return json.loads(attr.data) if attr is not None else {}


def compute_constant(recipe: dict, resolve):
    """A folded weight's value: the recipe's lines run over `resolve(name)` (a state tensor)."""
    import torch

    class State:
        def __getitem__(self, name):
            return resolve(name)

    scope = {"torch": torch, "state": State(), "_device": None}
    exec("\n".join(recipe["lines"]), scope)  # noqa: S102 - the pass's own eager lines
    return scope[recipe["result"]]


def _numel(value) -> int:
    size = 1
    for d in static_shape(value):
        size *= d
    return size


def _read_outside(value, constant: dict) -> bool:
    """Whether some op that is not itself a constant expression reads `value`."""
    return any(not op.results or any(r not in constant for r in op.results)
               for op in (use.operation for use in value.uses))


def _foldable_call(op) -> bool:
    if not isinstance(op, AtenOp) or op.target.data not in FOLDABLE or len(op.results) != 1:
        return False
    if op.target.data == "aten._to_copy.default" and set(op.call["kwargs"]) != {"dtype"}:
        return False  # a device or layout change is not a value
    return all(isinstance(v.type, TensorType) and None not in static_shape(v) for v in (*op.inputs, op.results[0]))


@dataclass(frozen=True)
class FoldConstants(CooptPass):
    name = "fold-constants"
    summary = "ATen expressions of weights alone → weights computed once at build time"

    # a folded result holds at most max_growth times its weights' elements (cat(w, w): 2), or at
    # most max_elements (transformers' tables: cat(inv_freq, inv_freq) expanded to the batch)
    max_growth: int = 2
    max_elements: int = 1 << 16

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        written = written_refs(op)
        record = constants_record(op)
        for func in [o for o in op.walk() if isinstance(o, FuncOp)]:
            self._fold_block(func.body.block, written, record)
        if record:
            op.attributes[CONSTANTS_ATTR] = StringAttr(json.dumps(record, sort_keys=True))

    def _fold_block(self, block, written: set[str], record: dict) -> None:
        constant: dict = {}  # value -> computed (some call on the way, not views alone)
        for inner in block.ops:
            if isinstance(inner, WeightOp) and inner.ref.data not in written:
                constant[inner.results[0]] = False
            elif _foldable_call(inner) and inner.inputs and all(v in constant for v in inner.inputs):
                constant[inner.results[0]] = inner.target.data not in VIEW_OPS or any(constant[v] for v in inner.inputs)
        roots = [v for v, computed in constant.items() if computed and _read_outside(v, constant)]
        members: set = set()
        for root in roots:
            members |= self._fold(root, record)
        for dead in reversed(list(block.ops)):  # what only the folded expressions read
            if dead in members and not any(r.uses for r in dead.results):
                Rewriter.erase_op(dead)

    def _fold(self, root, record: dict) -> set:
        """Replace `root` by a folded weight; the ops its recipe computes (and its weights), or
        nothing where it grows too much."""
        chain, seen, weights = [], set(), []

        def visit(value) -> None:  # post-order: operands first
            if value in seen:
                return
            seen.add(value)
            if isinstance(value.owner, WeightOp):
                weights.append(value)
                return
            for v in value.owner.inputs:
                visit(v)
            chain.append(value.owner)

        visit(root)
        if _numel(root) > max(self.max_growth * sum(_numel(w) for w in weights), self.max_elements):
            return set()
        names = Names()
        for w in weights:
            names.bind(w, f"state[{w.owner.ref.data!r}]")
        lines = [line for call in chain for line in aten_call(call, names)]
        recipe = {"lines": lines, "result": names[root]}
        digest = hashlib.sha1(json.dumps(recipe).encode()).hexdigest()[:10]
        # (weights joined by "+": a concatenation's ref joins its parts by "|", and may hold this one)
        ref = f"{CONST_PREFIX}{'+'.join(sorted({w.owner.ref.data for w in weights}))}:{digest}"
        record[ref] = recipe
        weight = WeightOp(ref, root.type)
        Rewriter.insert_op(weight, InsertPoint.before(root.owner))
        root.replace_all_uses_with(weight.results[0])
        count("fold.constants")
        return {*chain, *(w.owner for w in weights)}
