"""ATen graph (functional ExportedProgram) → xDSL module in the `coopt` dialect.

One `func.func @forward` whose arguments are the flattened user inputs and whose results are
the flattened user outputs. Parameters, buffers and lifted constants become `coopt.weight` ops
by state-dict name; buffer mutations become `coopt.state_write` ops before the return.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind, OutputKind
from xdsl.dialects import func
from xdsl.dialects.builtin import (
    DYNAMIC_INDEX,
    ArrayAttr,
    BFloat16Type,
    DictionaryAttr,
    Float8E4M3FNType,
    Float8E5M2Type,
    IndexType,
    IntegerType,
    ModuleOp,
    StringAttr,
    TensorType,
    UnitAttr,
    f16,
    f32,
    f64,
    i1,
    i32,
    i64,
)
from xdsl.ir import Attribute, Block, Region

from coopt.errors import CaptureError
from coopt.frontend.aten_table import EXPORT_METADATA_CHECKS, KNOWN
from coopt.ir.dialect import AtenOp, FallbackOp, StateWriteOp, WeightOp, json_prop

_DTYPES = {
    torch.float32: f32,
    torch.float16: f16,
    torch.bfloat16: BFloat16Type(),
    torch.float64: f64,
    torch.float8_e4m3fn: Float8E4M3FNType(),
    torch.float8_e5m2: Float8E5M2Type(),
    torch.int64: i64,
    torch.int32: i32,
    torch.bool: i1,
    torch.int8: IntegerType(8),
    torch.uint8: IntegerType(8),
}


@dataclass
class ImportResult:
    module: ModuleOp
    user_input_names: list[str]  # placeholder names of user inputs, flattened order
    state_names: list[str]  # every weight/buffer/constant name the graph reads
    fallback_targets: dict[str, int] = field(default_factory=dict)  # target -> count


def tensor_type(value) -> Attribute:
    """xDSL type of an FX meta value (FakeTensor, SymInt, or plain number)."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPES:
            raise CaptureError(f"tensors of dtype {value.dtype} are not supported")
        shape, names = [], []
        for d in value.shape:
            if isinstance(d, int):
                shape.append(d)
                names.append("")
            else:
                shape.append(DYNAMIC_INDEX)
                names.append(str(d.node.expr))
        encoding = ArrayAttr([StringAttr(n) for n in names]) if any(names) else None
        return TensorType(_DTYPES[value.dtype], shape, encoding) if encoding else TensorType(_DTYPES[value.dtype], shape)
    return IndexType()  # SymInt / int results (sizes)


def target_name(target) -> str:
    """'aten.linear.default' for OpOverloads, 'operator.mul' for Python operators."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or "builtins"
    if module == "_operator":
        module = "operator"
    return f"{module}.{target.__name__}"


class _ArgEncoder:
    """Encodes FX call arguments as JSON, collecting tensor/size operands."""

    def __init__(self, values: dict):
        self.values = values
        self.operands: list = []

    def __call__(self, arg):
        if isinstance(arg, torch.fx.Node):
            value = self.values[arg]
            if value not in self.operands:
                self.operands.append(value)
            return {"$t": self.operands.index(value)}
        if isinstance(arg, (list, tuple)):
            return [self(a) for a in arg]
        if isinstance(arg, float) and not math.isfinite(arg):
            return {"$f": repr(arg)}
        if arg is None or isinstance(arg, (bool, int, float, str)):
            return arg
        if isinstance(arg, torch.dtype):
            return {"$dtype": str(arg).removeprefix("torch.")}
        if isinstance(arg, torch.device):
            return {"$device": str(arg)}
        if isinstance(arg, torch.memory_format):
            return {"$memory_format": str(arg).removeprefix("torch.")}
        if isinstance(arg, torch.layout):
            return {"$layout": str(arg).removeprefix("torch.")}
        raise CaptureError(f"unsupported argument of type {type(arg).__name__} in the captured graph")


def _bound(value, default: int) -> int:
    """An int from a sympy bound; `default` for infinities (oo, int_oo)."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return default


def _symbol_table(program, user_placeholders, example_inputs) -> dict:
    """symbol -> [min, max, example] from torch.export's range constraints (unbounded max
    capped at 2**20) and the example inputs' sizes."""
    examples = {}
    for node, tensor in zip(user_placeholders, example_inputs):
        for fake, real in zip(node.meta["val"].shape, getattr(tensor, "shape", ())):
            if not isinstance(fake, int):
                examples[str(fake.node.expr)] = int(real)
    table = {}
    for sym, rng in program.range_constraints.items():
        lo, hi = _bound(rng.lower, 1), _bound(rng.upper, 1 << 20)
        table[str(sym)] = [lo, hi, examples.get(str(sym), lo)]
    return table


def _is_causal_mask(tensor) -> bool:
    """A buffer of lower-triangular ones (minGPT's `bias`/`mask`): masked_fill(mask == 0, -inf)
    with it is causal attention. Checked on the values, once, at import."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or tensor.shape[-1] != tensor.shape[-2]:
        return False
    if tensor.numel() > (1 << 26) or tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.bool):
        return False
    ones = torch.ones(tensor.shape[-2:], dtype=torch.bool, device=tensor.device).tril()
    return bool((tensor.bool() == ones).all() and ((tensor == 0) | (tensor == 1)).all())


def _is_arange(tensor) -> bool:
    """A 1-D integer buffer holding 0, 1, ..., n-1 (gpt-fast's cache positions)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.dtype not in (torch.int64, torch.int32):
        return False
    return bool((tensor == torch.arange(tensor.numel(), device=tensor.device, dtype=tensor.dtype)).all())


def import_program(program, example_inputs=()) -> ImportResult:
    """Import a functional ExportedProgram; `example_inputs` give the example value of each symbol."""
    sig = program.graph_signature
    input_kinds = {spec.arg.name: spec for spec in sig.input_specs}
    graph = program.graph_module.graph

    state = {**program.state_dict, **program.constants}
    user_placeholders = [
        n for n in graph.nodes if n.op == "placeholder" and input_kinds[n.name].kind == InputKind.USER_INPUT
    ]
    arg_types = [tensor_type(n.meta["val"]) for n in user_placeholders]
    block = Block(arg_types=arg_types)
    values: dict = {n: block.args[i] for i, n in enumerate(user_placeholders)}
    state_names: list[str] = []
    fallback: dict[str, int] = {}
    ops = []

    for node in graph.nodes:
        if node.op == "placeholder":
            spec = input_kinds[node.name]
            if spec.kind == InputKind.USER_INPUT:
                continue
            if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                raise CaptureError(f"unsupported graph input kind {spec.kind.name} for '{node.name}'")
            op = WeightOp(spec.target, tensor_type(node.meta["val"]))
            if _is_causal_mask(state.get(spec.target)):
                op.attributes["coopt.causal_mask"] = UnitAttr()  # lets raise-patterns see causal masking
            if _is_arange(state.get(spec.target)):
                op.attributes["coopt.arange"] = UnitAttr()  # cache positions: masks over them are lengths
            state_names.append(spec.target)
            ops.append(op)
            values[node] = op.result
        elif node.op == "call_function":
            if node.target is operator.getitem:
                source, index = node.args
                values[node] = values[source][index] if isinstance(values[source], list) else values[source]
                continue
            name = target_name(node.target)
            if name in EXPORT_METADATA_CHECKS:
                continue
            encoder = _ArgEncoder(values)
            call = {"args": encoder(list(node.args)), "kwargs": {k: encoder(v) for k, v in node.kwargs.items()}}
            meta = node.meta.get("val")
            multi = isinstance(meta, (list, tuple))
            metas = list(meta) if multi else [meta]
            result_types = [tensor_type(m) for m in metas if m is not None]
            if multi:  # which positions of the returned tuple the results are (None ones dropped)
                call["results"] = [i for i, m in enumerate(metas) if m is not None]
            op_class = AtenOp if name in KNOWN else FallbackOp
            if op_class is FallbackOp:
                fallback[name] = fallback.get(name, 0) + 1
            op = op_class(name, call, encoder.operands, result_types)
            ops.append(op)
            results = list(op.results)
            if multi:  # keep positions of None results so getitem indices stay right
                it = iter(results)
                values[node] = [next(it) if m is not None else None for m in metas]
            else:
                values[node] = results[0] if results else None
        elif node.op == "output":
            outputs = node.args[0]
        else:
            raise CaptureError(f"unsupported FX node '{node.op}'")

    user_outputs = []
    for spec, out in zip(sig.output_specs, outputs):
        if spec.kind == OutputKind.USER_OUTPUT:
            if not isinstance(out, torch.fx.Node):
                raise CaptureError("the model returns a non-tensor constant; return tensors only")
            user_outputs.append(values[out])
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            ops.append(StateWriteOp(spec.target, values[out]))
        else:
            raise CaptureError(f"unsupported output kind {spec.kind.name} (the model mutates its inputs?)")

    ops.append(func.ReturnOp(*user_outputs))
    block.add_ops(ops)
    fn = func.FuncOp("forward", ([a.type for a in block.args], [v.type for v in user_outputs]), Region(block))
    module = ModuleOp([fn])
    module.attributes["coopt.dims"] = json_prop(_symbol_table(program, user_placeholders, example_inputs))
    return ImportResult(module, [n.name for n in user_placeholders], state_names, fallback)
