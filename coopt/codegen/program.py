"""The emitted program: plain Python over the final IR (like Inductor's output code)."""

from __future__ import annotations

import re

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp

from coopt.codegen.torch_lines import Names, block_lines
from coopt.ir.region import TensorSpec
from coopt.ir.summary import tensor_spec
from coopt.templates.base import render_template


def weight_attr(name: str) -> str:
    return "w_" + re.sub(r"\W", "_", name)


def forward_function(module: ModuleOp) -> func.FuncOp:
    return next(op for op in module.walk() if isinstance(op, func.FuncOp) and op.sym_name.data == "forward")


def _input_contract(spec: TensorSpec) -> list:
    return [spec.dtype, [d if isinstance(d, int) else None for d in spec.shape]]


def program_source(module: ModuleOp, *, model_name: str, target: str, params: list[str], out_spec: str, regions: list[str]) -> str:
    fn = forward_function(module)
    block = fn.body.block
    names = Names()
    args = [names.new(a) for a in block.args]
    weights: dict[str, str] = {}

    def weight_expr(name: str) -> str:
        weights[weight_attr(name)] = name
        return f"self.{weight_attr(name)}"

    lines, returned = block_lines(
        block,
        names,
        weight_expr=weight_expr,
        state_expr=weight_expr,
        kernel_expr=lambda region: f"self._kernels[{region!r}]",
    )
    unpack = ", ".join(args) + ("," if len(args) == 1 else "") if args else "_"
    return render_template(
        "program.py.j2",
        model_name=model_name,
        target=target,
        # Python literals (repr), not JSON: None and True must read back as Python
        weights_repr=repr(weights),
        regions_repr=repr(regions),
        inputs_repr=repr([_input_contract(tensor_spec(a)) for a in block.args]),
        out_spec=out_spec,
        params=params,
        unpack=unpack,
        lines=lines,
        returned=returned,
    )
