"""`coopt.kernel` ops → RegionSummary (the plain-data view everything after fusion reads)."""

from __future__ import annotations

import json

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import SSAValue

from coopt.ir.dialect import KernelOp, WeightOp
from coopt.ir.region import RegionSummary, TensorSpec

_DTYPE_NAMES = {
    "f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64",
    "f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2", "i64": "int64", "i32": "int32", "i1": "bool",
}


def dtype_name(value: SSAValue) -> str:
    return _DTYPE_NAMES[str(value.type.element_type)]


def tensor_spec(value: SSAValue) -> TensorSpec:
    from coopt.passes.shapes import dims

    return TensorSpec(tuple(dims(value)), dtype_name(value))


def symbol_table(module: ModuleOp) -> dict[str, list[int]]:
    """symbol -> [min, max, example] as the importer recorded it."""
    attr = module.attributes.get("coopt.dims")
    return json.loads(attr.data) if attr is not None else {}


def kernels(module: ModuleOp) -> list[KernelOp]:
    return [op for op in module.walk() if isinstance(op, KernelOp)]


def name_regions(module: ModuleOp) -> None:
    """r0_<family>, r1_<family>, ... in program order: stable names for files and reports."""
    from xdsl.dialects.builtin import StringAttr

    for i, kernel in enumerate(kernels(module)):
        kernel.properties["sym_name"] = StringAttr(f"r{i}_{kernel.family.data}")


def summarize(kernel: KernelOp, symbols: dict[str, list[int]]) -> RegionSummary:
    inputs = tuple(tensor_spec(v) for v in kernel.inputs)
    outputs = tuple(tensor_spec(v) for v in kernel.results)
    used = {d for spec in (*inputs, *outputs) for d in spec.shape if isinstance(d, str)}
    free = {s for s in symbols if any(s in expr for expr in used)}
    return RegionSummary(
        name=kernel.sym_name.data,
        family=kernel.family.data,
        inputs=inputs,
        outputs=outputs,
        attrs=kernel.family_attrs,
        dims={s: (symbols[s][0], symbols[s][1]) for s in sorted(free)},
        example_dims={s: symbols[s][2] for s in sorted(free)},
        input_names=tuple(v.owner.ref.data if isinstance(v.owner, WeightOp) else "" for v in kernel.inputs),
    )
