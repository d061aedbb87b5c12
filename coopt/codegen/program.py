"""The emitted program: plain Python over the final IR (like Inductor's output code)."""

from __future__ import annotations

import re

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp

from coopt.codegen.input_bounds import derive_input_bounds
from coopt.codegen.torch_lines import Names, block_lines, with_releases
from coopt.ir.summary import symbol_table, tensor_spec
from coopt.passes.fp8_kv_cache import scale_buffers
from coopt.templates.base import render_template


UNBOUNDED = 1 << 20  # coopt.frontend.importer's stand-in for an unbounded dim


def weight_attr(name: str) -> str:
    return "w_" + re.sub(r"\W", "_", name)


def forward_function(module: ModuleOp) -> func.FuncOp:
    return next(op for op in module.walk() if isinstance(op, func.FuncOp) and op.sym_name.data == "forward")


def _input_contract(name: str, value, symbols: dict) -> tuple:
    """(name, dtype, shape): a dim is its static size, its symbol (range in DIMS) or None (an
    expression of symbols, not checked)."""
    spec = tensor_spec(value)
    return (name, spec.dtype, [d if isinstance(d, int) or d in symbols else None for d in spec.shape])


def _exported_range(symbol: list[int]) -> tuple:
    # the importer caps an unbounded max at 2**20: None (no limit) rather than a false one
    low, high = symbol[:2]
    return (low, high if high < UNBOUNDED else None)


def _input_names(params: list[str], count: int) -> list[str]:
    # forward's parameters name the flat inputs when each parameter is one tensor
    return list(params) if len(params) == count else [f"input {i}" for i in range(count)]


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
    symbols = symbol_table(module)
    bounds = derive_input_bounds(module, fn, symbols)
    inputs = [_input_contract(n, a, symbols) for n, a in zip(_input_names(params, len(block.args)), block.args)]
    used = {d for _, _, shape in inputs for d in shape if isinstance(d, str)}
    return render_template(
        "program.py.j2",
        model_name=model_name,
        target=target,
        # Python literals (repr), not JSON: None and True must read back as Python
        weights_repr=repr(weights),
        regions_repr=repr(regions),
        inputs_repr=repr(inputs),
        dims_repr=repr({s: _exported_range(symbols[s]) for s in sorted(used)}),
        index_bounds_repr=_rows([(b.input, b.low, b.high, b.reason) for b in bounds.index]),
        size_bounds_repr=_rows([(b.input, b.dim, b.high, b.reason) for b in bounds.size]),
        decoder_repr=repr(bounds.decoder),
        paged_repr=repr(bounds.paged),
        keep_dtype_repr=repr(scale_buffers(module)),
        out_spec=out_spec,
        params=params,
        unpack=unpack,
        lines=with_releases(lines, returned),
        returned=returned,
    )


def _rows(rows: list[tuple]) -> str:
    """A list literal with one row per line (the bounds are read by people too)."""
    return "[\n" + "".join(f"    {row!r},\n" for row in rows) + "]" if rows else "[]"
