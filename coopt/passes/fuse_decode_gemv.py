"""fuse-decode-gemv: a decode-sized linear takes the RMSNorm before it (prologue) and the gated
product of its halves after it (GLU epilogue, SwiGLU's silu(gate) * up) into its own GEMV region.

Why: at M = 1..64 rows every linear is a weight stream and every small kernel around it costs its
own time plus ~1 µs of launch gap, even graph-replayed with PDL (bench/RESULTS.md: rms_norm
1.1 µs, silu·mul 0.75 µs per layer beside 14-56 µs GEMVs). The GEMV kernel streams each row of
the activation anyway, so it can sum its squares on the way and scale the accumulator by
1/rms afterwards; and the merged gate|up weight (fuse-parallel-linears) can be read as two slabs
per program, whose products meet in the epilogue. A Llama decode layer loses both norm kernels
and the silu·mul kernel: its residual adds, no longer taken by fuse-norm-residual, become
epilogues of the o and down GEMVs (fuse-linear-epilogue).

Matches (only where the GEMV kernel runs: the linear's rows, x's leading dims, at most
`max_rows` for every value of their symbols):
- norm: `coopt.rms_norm` (no bias; weight [K] or none) whose only consumer is the linear's x.
  A norm whose output is also read elsewhere stays a kernel of its own (fuse-norm-residual).
- glu: a bias-free linear whose output's only consumers are two slices of the last dim,
  [0, N) and [N, 2N), each read once, by `act(slice)` (silu, gelu, gelu_tanh, sigmoid, relu)
  and by the product of that activation with the other slice.
The region is a matmul_epilogue with attrs "prologue" and / or "glu" (coopt/ir/region.py), its
body the ops it replaced (the reference). Regions without either are left to
fuse-linear-epilogue. Its template points are the GEMV kernel's only: larger M (prefill) is
never fused here.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import SSAValue

from coopt.ir.dialect import AtenOp, ElementwiseOp, KernelOp, LinearOp, RMSNormOp
from coopt.ir.region import eval_dim
from coopt.ir.summary import symbol_table
from coopt.passes.base import CooptPass
from coopt.passes.fuse_linear_epilogue import GatedHalves, outline_linear
from coopt.passes.fusion_common import only_user
from coopt.passes.shapes import dims
from coopt.passes.stats import count

# Activations of a gated linear unit (SwiGLU, GeGLU, ReGLU, ...): unary fns of the region schema.
GATE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "sigmoid", "relu")


def row_bound(x: SSAValue, highs: dict[str, int]) -> int | None:
    """The most rows (product of x's leading dims) any call can have; None when unbounded."""
    rows = 1
    for d in dims(x)[:-1]:
        try:
            rows *= eval_dim(d, highs)
        except Exception:  # a symbol without a known range
            return None
    return rows


def norm_prologue(linear: LinearOp) -> RMSNormOp | None:
    """The RMSNorm whose result is the linear's x and nothing else's."""
    norm = linear.x.owner
    if not isinstance(norm, RMSNormOp) or isinstance(norm.parent_op(), KernelOp):
        return None
    if norm.bias is not None or only_user(norm.result) is not linear or linear.w is norm.result:
        return None
    if norm.weight is not None and len(dims(norm.weight)) != 1:
        return None
    return norm


def _half(op, out: SSAValue, width: int) -> int | None:
    """0 or 1 when `op` is the slice [0, N) or [N, 2N) of `out`'s last dim (N = width), else None."""
    if not (isinstance(op, AtenOp) and op.target.data == "aten.slice.Tensor"):
        return None
    args = op.call["args"]
    if len(args) < 4 or args[0] != {"$t": 0} or op.inputs[0] is not out or (len(args) > 4 and args[4] != 1):
        return None
    rank = len(dims(out))
    dim, start, end = args[1], args[2], args[3]
    if not all(isinstance(v, int) for v in (dim, start, end)) or dim % rank != rank - 1:
        return None
    end = min(end, 2 * width)
    return {(0, width): 0, (width, 2 * width): 1}.get((start, end))


def gated_halves(linear: LinearOp) -> GatedHalves | None:
    """act(one half) * other half of the linear's output, each half read by exactly that."""
    out = linear.result
    n_total = dims(out)[-1]
    if linear.bias is not None or not isinstance(n_total, int) or n_total % 2:
        return None
    slices = {use.operation for use in out.uses}
    halves = {_half(op, out, n_total // 2): op for op in slices}
    if len(slices) != 2 or set(halves) != {0, 1}:
        return None
    low, high = halves[0].results[0], halves[1].results[0]
    for gate, other in ((low, high), (high, low)):
        act = only_user(gate)
        if not (isinstance(act, ElementwiseOp) and act.fn.data in GATE_ACTIVATIONS and len(act.inputs) == 1):
            continue
        product = only_user(act.results[0])
        if not (isinstance(product, ElementwiseOp) and product.fn.data == "mul" and only_user(other) is product):
            continue
        if set(product.inputs) != {act.results[0], other} or product.arg_refs not in ([0, 1], [1, 0]):
            continue
        if not dims(low) == dims(high) == dims(product.results[0]):
            continue
        return GatedHalves(low, high, (halves[0], halves[1], act, product), (act, product), product.results[0])
    return None


@dataclass(frozen=True)
class FuseDecodeGemv(CooptPass):
    name = "fuse-decode-gemv"
    summary = "decode-sized linear (M <= max-rows) + the RMSNorm before it / act(gate)·up after it → one GEMV region"

    max_rows: int = 64  # the GEMV kernel's range (matmul_epilogue GEMV_MAX_M); beyond it, no fusion
    norm: bool = True  # take an RMSNorm prologue
    glu: bool = True  # take a gated-linear-unit epilogue
    max_ops: int = 8  # elementwise ops after the linear (or its GLU product), as fuse-linear-epilogue

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        highs = {name: bounds[1] for name, bounds in symbol_table(op).items()}
        for linear in [o for o in op.walk() if isinstance(o, LinearOp)]:
            if isinstance(linear.parent_op(), KernelOp):
                continue
            rows = row_bound(linear.x, highs)
            if rows is None or rows > self.max_rows:
                continue
            norm = norm_prologue(linear) if self.norm else None
            gated = gated_halves(linear) if self.glu else None
            if norm is None and gated is None:
                continue
            if outline_linear(linear, self.max_ops, norm=norm, gated=gated) is None:
                count("fuse.decode_gemv.blocked")  # an op in between reads the norm or a half
                continue
            count("fuse.decode_gemv")
            if norm is not None:
                count("fuse.decode_gemv.norm_prologue")
            if gated is not None:
                count(f"fuse.decode_gemv.glu.{gated.gate_ops[0].fn.data}")
