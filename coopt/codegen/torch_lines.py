"""IR ops → lines of eager PyTorch code. One table serves the emitted program and the reference
module of every kernel region, so what is verified is exactly what would run unfused.
"""

from __future__ import annotations

import re

from xdsl.dialects import func
from xdsl.ir import Block, SSAValue

from coopt.ir.dialect import (
    AtenOp,
    AttentionOp,
    CacheAttentionOp,
    DecodeAttentionOp,
    ElementwiseOp,
    FallbackOp,
    KernelOp,
    LayerNormOp,
    LinearOp,
    LogSoftmaxOp,
    QuantizeFp8Op,
    RMSNormOp,
    RopeOp,
    SoftmaxOp,
    StateUpdateOp,
    StateWriteOp,
    WeightOp,
    YieldOp,
)
from coopt.templates.ewprogram import render_program

# header every generated module starts with: all the names emitted lines may use
PRELUDE = "import math\nimport operator\n\nimport torch\n"


class Names:
    """SSA value → Python local name (v0, v1, ...)."""

    def __init__(self):
        self._names: dict[SSAValue, str] = {}

    def bind(self, value: SSAValue, name: str) -> None:
        self._names[value] = name

    def __getitem__(self, value: SSAValue) -> str:
        if value not in self._names:
            self._names[value] = f"v{len(self._names)}"
        return self._names[value]

    def new(self, value: SSAValue) -> str:
        return self[value]


def _literal(value) -> str:
    if isinstance(value, dict):
        if "$f" in value:
            return f"float({value['$f']!r})"
        if "$dtype" in value:
            return f"torch.{value['$dtype']}"
        if "$device" in value:
            return "_device"  # the device the program runs on, not the one it was captured on
        if "$memory_format" in value:
            return f"torch.{value['$memory_format']}"
        if "$layout" in value:
            return f"torch.{value['$layout']}"
        raise ValueError(f"unknown encoded literal {value}")
    return repr(value)


def _decode(arg, operands: list[str]) -> str:
    if isinstance(arg, dict) and "$t" in arg:
        return operands[arg["$t"]]
    if isinstance(arg, list):
        inner = ", ".join(_decode(a, operands) for a in arg)
        return f"[{inner}]"
    return _literal(arg)


# In the functional graph a view only differs from a reshape by aliasing, which nothing can
# observe any more; but a kernel may return other strides than the op it replaced (SDPA's
# output is not contiguous on every backend), and `view` would then refuse them.
_STRIDE_TOLERANT = {"aten.view.default": "aten.reshape.default", "aten._unsafe_view.default": "aten.reshape.default"}


def _ring_write_lines(op: StateUpdateOp, names: Names) -> list[str]:
    """ring[b, :, p % N] = row of x for each position p written (the last N of a call's: older
    ones would land in the same slots and are never read again); per row, sequence b's one row
    at its own position. With a fourth input (paged-kv's ring_slots [B]) row b's ring is
    ring[ring_slots[b]] instead of ring[b]."""
    ring, positions, x, *slots = (names[v] for v in op.inputs)
    window, per_row = op.call["args"][3], op.call["args"][4]
    if slots:
        rows = f"{slots[0]}.long()" if per_row else f"{slots[0]}.long()[:, None]"
        newest = f"{x}[:, :, 0]" if per_row else f"{x}[:, :, -{window}:].transpose(1, 2)"  # [B, N', Hkv, D]
        where = f"{positions} % {window}" if per_row else f"({positions}[-{window}:] % {window})[None, :]"
        write = f"{ring}[{rows}, :, {where}] = {newest}"
    elif per_row:
        write = f"{ring}[torch.arange({x}.shape[0], device={x}.device), :, {positions} % {window}] = {x}[:, :, 0]"
    else:
        write = f"{ring}[:{x}.shape[0], :, {positions}[-{window}:] % {window}] = {x}[:, :, -{window}:]"
    return [write, f"{names.new(op.results[0])} = {ring}"]


def callable_expr(target: str) -> str:
    """'aten.mm.default' → 'torch.ops.aten.mm.default'; 'operator.mul' stays as is."""
    target = _STRIDE_TOLERANT.get(target, target)
    namespace = target.split(".", 1)[0]
    if namespace in ("operator", "math", "builtins"):
        return target.removeprefix("builtins.")
    return f"torch.ops.{target}"


def aten_call(op: AtenOp | FallbackOp | StateUpdateOp, names: Names) -> list[str]:
    call = op.call
    operands = [names[v] for v in op.inputs]
    parts = [_decode(a, operands) for a in call["args"]]
    parts += [f"{k}={_decode(v, operands)}" for k, v in call["kwargs"].items()]
    if op.target.data == "coopt.ring_write_":  # fp8-kv-cache's exact-recent ring (StateUpdateOp's docstring)
        return _ring_write_lines(op, names)
    if op.target.data == "coopt.slice_copy_":  # slice_scatter(buf, src, dim, start, end, step) in place
        buffer, src, *rest = parts
        return [
            f"torch.ops.aten.slice.Tensor({', '.join([buffer, *rest])}).copy_({src})",
            f"{names.new(op.results[0])} = {buffer}",
        ]
    expr = f"{callable_expr(op.target.data)}({', '.join(parts)})"
    written = op.inputs[call["args"][0]["$t"]] if isinstance(op, StateUpdateOp) else None
    if written is not None and getattr(written.owner, "target", None) is not None \
            and written.owner.target.data == "aten.slice.Tensor":
        # a dynamic batch's rows written in place through a slice view: the result is the buffer
        sliced = written.owner
        return [expr, f"{names.new(op.results[0])} = {names[sliced.inputs[sliced.call['args'][0]['$t']]]}"]
    results = [names.new(r) for r in op.results]
    if not results:
        return [expr]
    if "results" not in call:
        return [f"{results[0]} = {expr}"]
    tmp = f"_t_{results[0]}"
    return [f"{tmp} = {expr}"] + [f"{r} = {tmp}[{i}]" for r, i in zip(results, call["results"])]


def _high_level(op, names: Names) -> str:
    out = names.new(op.results[0])
    if isinstance(op, LinearOp):
        x, w = names[op.x], names[op.w]
        b = names[op.bias] if op.bias is not None else "None"
        if op.b_layout.data == "nk":
            return f"{out} = torch.nn.functional.linear({x}, {w}, {b})"
        return f"{out} = torch.matmul({x}, {w})" + (f" + {b}" if op.bias is not None else "")
    if isinstance(op, ElementwiseOp):
        operands = [names[v] for v in op.inputs]
        refs = {f"in{i}": n for i, n in enumerate(operands)}
        program_args = [a["$f"] if isinstance(a, dict) else f"in{a}" for a in op.arg_refs]
        (line,) = render_program([["r", op.fn.data, program_args]], refs, dialect="torch")
        return f"{out} = {line.split(' = ', 1)[1]}"
    if isinstance(op, (RMSNormOp, LayerNormOp)):
        x = names[op.x]
        w = names[op.weight] if op.weight is not None else "None"
        eps = op.eps.value.data
        if isinstance(op, RMSNormOp):
            return f"{out} = torch.nn.functional.rms_norm({x}, ({x}.shape[-1],), {w}, {eps!r})"
        b = names[op.bias] if op.bias is not None else "None"
        return f"{out} = torch.nn.functional.layer_norm({x}, ({x}.shape[-1],), {w}, {b}, {eps!r})"
    if isinstance(op, SoftmaxOp):
        return f"{out} = torch.softmax({names[op.x]}, -1)"
    if isinstance(op, LogSoftmaxOp):
        return f"{out} = torch.log_softmax({names[op.x]}, -1)"
    if isinstance(op, RopeOp):
        x, cos, sin = names[op.x], names[op.cos], names[op.sin]
        half = f"{x}.shape[-1] // 2"
        return f"{out} = {x} * {cos} + torch.cat((-{x}[..., {half}:], {x}[..., :{half}]), -1) * {sin}"
    if isinstance(op, AttentionOp):
        q, k, v = names[op.q], names[op.k], names[op.v]
        causal = bool(op.causal.value.data)
        scale = op.scale.value.data
        gqa = f"{q}.shape[1] != {k}.shape[1]"
        return (
            f"{out} = torch.nn.functional.scaled_dot_product_attention({q}, {k}, {v}, is_causal={causal}, "
            f"scale={scale!r}, enable_gqa={gqa})"
        )
    if isinstance(op, (CacheAttentionOp, DecodeAttentionOp)):
        q, k, v, lengths = names[op.q], names[op.k], names[op.v], names[op.lengths]
        # [queries, S_max]: per query position (a prompt), or per sequence (decode) as [B, 1, 1, S_max]
        mask = f"(torch.arange({k}.shape[2], device={k}.device)[None, :] < {lengths}[:, None])"
        if isinstance(op, DecodeAttentionOp):
            mask += "[:, None, None, :]"
        keys, values = _dequantized_cache(op, names)
        return (
            f"{out} = torch.nn.functional.scaled_dot_product_attention({q}, {keys}, {values}, attn_mask={mask}, "
            f"scale={op.scale.value.data!r}, enable_gqa={q}.shape[1] != {k}.shape[1])"
        )
    if isinstance(op, QuantizeFp8Op):
        return _quantize_fp8_line(op, out, names)
    raise NotImplementedError(type(op).__name__)


# fp8 KV cache (docs/kv-cache.md): how a scale of each granularity broadcasts against a
# [B, Hkv, T, D] tensor (per-tensor [1], per-head [Hkv], per-token [B, Hkv, T])
_SCALE_BROADCAST = {"per-tensor": "", "per-head": "[:, None, None]", "per-token": "[..., None]"}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _quantize_fp8_line(op: QuantizeFp8Op, out: str, names: Names) -> str:
    """clamp(x / s, -448, 448) in fp32, rounded to float8_e4m3fn (nearest even) by the cast."""
    scale = names[op.scale] + _SCALE_BROADCAST[op.granularity.data]
    return f"{out} = torch.clamp({names[op.x]}.float() / {scale}, -{FP8_MAX!r}, {FP8_MAX!r}).to(torch.float8_e4m3fn)"


def _dequantized_cache(op, names: Names) -> tuple[str, str]:
    """The k and v a cache attention reads: as they are, or from an fp8 cache k * k_scale
    (broadcast by granularity) in q's dtype."""
    k, v = names[op.k], names[op.v]
    if op.kv_scale is None:
        return k, v
    broadcast, dtype = _SCALE_BROADCAST[op.kv_scale.data], f"{names[op.q]}.dtype"
    return (f"({k}.float() * {names[op.k_scale]}{broadcast}).to({dtype})",
            f"({v}.float() * {names[op.v_scale]}{broadcast}).to({dtype})")


def _exact_recent_lines(op, names: Names) -> list[str]:
    """A cache attention whose queries read their newest `recent` keys unrounded (fp8-kv-cache's
    exact-recent; the op's docstring has the semantics), written out in fp32: each query's window
    rows [B, Hkv, T, N, D] gathered (this call's rows counted back from its own, then the rings'),
    its scores over the cache before the window and over the window in one softmax, the kv heads
    repeated for their query heads. Its temporaries are deleted at once."""
    out = names.new(op.result)
    q, k, lengths = names[op.q], names[op.k], names[op.lengths]
    keys, values = _dequantized_cache(op, names)
    window = op.recent.value.data
    t = {name: f"{out}_{name}" for name in ("d", "back", "mine", "pos", "k", "v", "kw", "vw", "s", "sw", "p")}
    decode = isinstance(op, DecodeAttentionOp)
    # per query: its position [B, 1, T or 1, 1] (decode: one per sequence), its index in the call
    position = f"({lengths} - 1)[:, None, None, None]" if decode else f"({lengths} - 1)[None, None, :, None]"
    lines = [
        f"{t['d']} = torch.arange({window}, device={q}.device)",  # d: how far back in the window
        f"{t['back']} = torch.arange({q}.shape[2], device={q}.device)[:, None] - {t['d']}",  # [T, N]: i - d
        f"{t['mine']} = {t['back']} >= 0",  # a row this call wrote
        f"{t['pos']} = {position} - {t['d']}",  # [B or 1, 1, T, N]: the window's positions
    ]
    repeat = f".repeat_interleave({q}.shape[1] // {k}.shape[1], 1)"
    for name, rows, ring in (("kw", op.k_exact, op.k_recent), ("vw", op.v_exact, op.v_recent)):
        own = f"{names[rows]}.float()[:, :, {t['back']}.clamp(min=0)]"  # [B, Hkv, T, N, D]
        if ring is None:
            lines.append(f"{t[name]} = {own}")
            continue
        slots = f"({t['pos']} % {window}).expand({q}.shape[0], 1, {q}.shape[2], {window})"
        from_ring = (f"torch.stack([{names[ring]}[:{q}.shape[0]].float()[b][:, {slots}[b, 0]] "
                     f"for b in range({q}.shape[0])])")
        lines.append(f"{t[name]} = torch.where({t['mine']}[None, None, :, :, None], {own}, {from_ring})")
    newest = f"({position} - {t['d']}[-1])"  # the window's oldest position: keys before it from the cache
    return lines + [
        f"{t['k']}, {t['v']} = {keys}.float(){repeat}, {values}.float(){repeat}",
        f"{t['kw']}, {t['vw']} = {t['kw']}{repeat}, {t['vw']}{repeat}",
        f"{t['s']} = ({q}.float() @ {t['k']}.transpose(-1, -2)).masked_fill("
        f"torch.arange({k}.shape[2], device={q}.device) >= {newest}.clamp(min=0), float('-inf'))",
        f"{t['sw']} = ({q}.float()[:, :, :, None, :] * {t['kw']}).sum(-1).masked_fill({t['pos']} < 0, "
        "float('-inf'))",
        f"{t['p']} = torch.softmax(torch.cat([{t['s']}, {t['sw']}], -1) * {op.scale.value.data!r}, -1)",
        f"{out} = ({t['p']}[..., :{k}.shape[2]] @ {t['v']} + ({t['p']}[..., {k}.shape[2]:, None] * {t['vw']}).sum(-2)).to({q}.dtype)",
        f"del {', '.join(t.values())}",
    ]


def op_lines(op, names: Names, *, weight_expr, state_expr, kernel_expr) -> list[str]:
    """Python lines for one op. The three callbacks say how the surrounding module reaches
    weights, state buffers and kernels (the program uses attributes; references never do).
    State writes are block_lines' own: a run of them becomes one line (_state_writes_line)."""
    if isinstance(op, WeightOp):
        return [f"{names.new(op.result)} = {weight_expr(op.ref.data)}"]
    if isinstance(op, (AtenOp, FallbackOp, StateUpdateOp)):
        return aten_call(op, names)
    if isinstance(op, KernelOp):
        outs = [names.new(r) for r in op.results]
        args = ", ".join(names[v] for v in op.inputs)
        return [f"{', '.join(outs)}{',' if len(outs) == 1 else ''} = {kernel_expr(op.sym_name.data)}({args})"]
    if isinstance(op, (CacheAttentionOp, DecodeAttentionOp)) and op.recent is not None:
        return _exact_recent_lines(op, names)
    return [_high_level(op, names)]


def _state_writes_line(writes: list[StateWriteOp], names: Names, state_expr) -> str:
    """A run of state writes to distinct buffers as one torch._foreach_copy_: on a GPU one
    multi-tensor launch instead of one copy kernel a buffer (transformers' StaticCache keeps a
    cumulative_length a layer, and every step writes them all); each pair keeps copy_'s
    semantics (dtype cast, broadcast)."""
    if len(writes) == 1:
        return f"{state_expr(writes[0].ref.data)}.copy_({names[writes[0].value]})"
    buffers = ", ".join(state_expr(w.ref.data) for w in writes)
    values = ", ".join(names[w.value] for w in writes)
    return f"torch._foreach_copy_([{buffers}], [{values}])"


def block_lines(block: Block, names: Names, **callbacks) -> tuple[list[str], list[str]]:
    """Lines for every op of `block` but its terminator, and the names the terminator returns.
    Consecutive state writes to distinct buffers become one line (_state_writes_line)."""
    lines: list[str] = []
    returned: list[str] = []
    run: list[StateWriteOp] = []

    def flush():
        if run:
            lines.append(_state_writes_line(run, names, callbacks["state_expr"]))
            run.clear()

    for op in block.ops:
        if isinstance(op, StateWriteOp):
            if any(w.ref.data == op.ref.data for w in run):  # the same buffer twice: in order, not in one launch
                flush()
            run.append(op)
            continue
        flush()
        if isinstance(op, (func.ReturnOp, YieldOp)):
            returned = [names[v] for v in op.operands]
        else:
            lines += op_lines(op, names, **callbacks)
    flush()
    return lines, returned


_VALUE_NAME = re.compile(r"\bv\d+\b")


def with_releases(lines: list[str], returned: list[str]) -> list[str]:
    """`lines` with a `del` after the last line that names each value the function does not
    return: a flat generated function would otherwise hold every intermediate until it returns
    (a 131072-token prompt through 8 Llama-3-8B layers: ~17 GB of activations a layer, all alive
    at once, where eager frees each as its last reader finishes). A view keeps its base alive as
    in eager; `del` only drops the name."""
    last_use: dict[str, int] = {}
    for i, line in enumerate(lines):
        for name in _VALUE_NAME.findall(line):
            last_use[name] = i
    kept = {name for expr in returned for name in _VALUE_NAME.findall(expr)}
    released: dict[int, list[str]] = {}
    for name, i in last_use.items():
        if name not in kept:
            released.setdefault(i, []).append(name)
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        if i in released:
            out.append("del " + ", ".join(sorted(released[i], key=lambda n: int(n[1:]))))
    return out


def _no_weights(name):  # references receive weights as inputs; reaching one is a fusion bug
    raise AssertionError(f"weight '{name}' referenced inside a kernel region")


def reference_module_source(kernel: KernelOp) -> str:
    """Source of the eager reference of a region: `run(*inputs)` over its body, unfused."""
    names = Names()
    block = kernel.body.block
    params = [names.new(a) for a in block.args]
    lines, returned = block_lines(
        block, names, weight_expr=_no_weights, state_expr=_no_weights, kernel_expr=_no_weights
    )
    body = [f"{', '.join(params)}{',' if len(params) == 1 else ''} = inputs", "_device = inputs[0].device",
            *with_releases(lines, returned)]
    body.append(f"return ({', '.join(returned)}{',' if len(returned) == 1 else ''})")
    header = f'"""Reference for region {kernel.sym_name.data}: the ops it replaced, run by eager PyTorch."""\n\n'
    return header + PRELUDE + "\n\ndef run(*inputs):\n" + "".join(f"    {l}\n" for l in body)
