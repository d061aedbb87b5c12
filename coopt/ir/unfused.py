"""What a built program still runs through PyTorch between its kernels, for the report.

After fusion, every op outside a `coopt.kernel` region runs as the original ATen call (codegen's
torch lines). Most of them are views, which launch nothing; the rest (an embedding, a gather of
rotary rows, a dtype cast, an unfused linear, ...) each launch a PyTorch kernel of their own
between coopt's kernels. At batch 1 a decode step is mostly launch latency, so a demanding user
wants to see them: the report lists them by target, views left out.
"""

from __future__ import annotations

from collections import Counter

from xdsl.dialects.builtin import ModuleOp

from coopt.ir.dialect import AtenOp, FallbackOp, KernelOp, StateUpdateOp, StateWriteOp, WeightOp

# ATen ops that return a view of their input (or only its metadata): no kernel runs.
# reshape counts as one: in an exported decode graph it reshapes contiguous tensors.
VIEW_TARGETS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.alias.default",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default",
    "aten.permute.default", "aten.transpose.int", "aten.t.default", "aten.expand.default",
    "aten.slice.Tensor", "aten.select.int", "aten.narrow.default", "aten.detach.default",
    "aten.as_strided.default", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int",
    "aten.sym_size.int",
})
# not counted: weights are loaded, not run; kernels are coopt's; unknown ops (fallbacks) have
# the report's list of their own
_NOT_COUNTED = (WeightOp, KernelOp, FallbackOp)
# ops without results that still run: a state_write left functional copies its value into the
# buffer (copy_), a state_update writes part of it in place
_WRITES = (StateWriteOp, StateUpdateOp)


def unfused_ops(module: ModuleOp) -> dict[str, int]:
    """Target (ATen name, or the IR op's name for a raised op no region took) -> count, for every
    known op outside the kernel regions that launches work of its own; views are left out."""
    inside = {id(op) for kernel in module.walk() if isinstance(kernel, KernelOp) for op in kernel.walk()}
    counts: Counter[str] = Counter()
    for op in module.walk():
        if id(op) in inside or isinstance(op, (ModuleOp, *_NOT_COUNTED)):
            continue
        if not op.results and not isinstance(op, _WRITES):
            continue  # functions, returns: nothing to launch
        target = op.target.data if isinstance(op, (AtenOp, StateUpdateOp)) else op.name
        if target.startswith(("aten.", "coopt.")) and target not in VIEW_TARGETS:
            counts[target] += 1
    return dict(sorted(counts.items()))
