"""Elementwise programs (see coopt.ir.region) rendered as Triton, CUDA C++ and torch expressions.

The renderings come from tables side by side so the kernels and the eager reference agree on what
each fn means. Triton lines compute in fp32: callers load inputs with `.to(tl.float32)`; CUDA
lines declare `const float` locals over float operands.
"""

from __future__ import annotations

import math

from coopt.ir.region import ELEMENTWISE_FNS

# fn -> Triton expression over fp32 operands {0}, {1}
_TRITON = {
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "mul": "{0} * {1}",
    "div": "{0} / {1}",
    # NaN in, NaN out, as torch: Triton's maximum / minimum return the other operand by default
    "maximum": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "minimum": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "pow": "tl.exp2(tl.log2({0}) * {1})",
    "neg": "-{0}",
    "relu": "tl.maximum({0}, 0.0, propagate_nan=tl.PropagateNan.ALL)",
    "silu": "{0} / (1.0 + tl.exp(-{0}))",
    "sigmoid": "1.0 / (1.0 + tl.exp(-{0}))",
    "gelu": "0.5 * {0} * (1.0 + tl.erf({0} * 0.7071067811865476))",
    # tanh(u) = 2*sigmoid(2u) - 1, written without tl.tanh (absent from older Triton releases)
    "gelu_tanh": "0.5 * {0} * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * (0.7978845608028654 * ({0} + 0.044715 * {0} * {0} * {0})))) - 1.0))",
    "tanh": "2.0 / (1.0 + tl.exp(-2.0 * {0})) - 1.0",
    "exp": "tl.exp({0})",
    "log": "tl.log({0})",
    "sqrt": "tl.sqrt({0})",
    "rsqrt": "tl.rsqrt({0})",
    "abs": "tl.abs({0})",
    "square": "{0} * {0}",
    "reciprocal": "1.0 / {0}",
    "sin": "tl.sin({0})",
    "cos": "tl.cos({0})",
    "erf": "tl.erf({0})",
    "hardsigmoid": "tl.minimum(tl.maximum({0} + 3.0, 0.0, propagate_nan=tl.PropagateNan.ALL), 6.0, propagate_nan=tl.PropagateNan.ALL) / 6.0",
    "hardswish": "{0} * tl.minimum(tl.maximum({0} + 3.0, 0.0), 6.0) / 6.0",
    "where": "tl.where({0} != 0, {1}, {2})",
    "to_f32": "{0}",
    "to_bf16": "{0}.to(tl.bfloat16).to(tl.float32)",  # round to nearest even (Triton's interpreter truncates)
    "to_f16": "{0}.to(tl.float16).to(tl.float32)",
    "bf16_to_f32": "{0}.to(tl.bfloat16).to(tl.float32)",
    "f16_to_f32": "{0}.to(tl.float16).to(tl.float32)",
}

# fn -> torch expression (module `torch` in scope), used by the eager reference
_TORCH = {
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "mul": "{0} * {1}",
    "div": "{0} / {1}",
    "maximum": "torch.maximum({0}, {1})",  # (with a number operand: _TORCH_WITH_NUMBER)
    "minimum": "torch.minimum({0}, {1})",
    "pow": "torch.pow({0}, {1})",
    "neg": "-{0}",
    "relu": "torch.relu({0})",
    "silu": "torch.nn.functional.silu({0})",
    "sigmoid": "torch.sigmoid({0})",
    "gelu": "torch.nn.functional.gelu({0})",
    "gelu_tanh": "torch.nn.functional.gelu({0}, approximate='tanh')",
    "tanh": "torch.tanh({0})",
    "exp": "torch.exp({0})",
    "log": "torch.log({0})",
    "sqrt": "torch.sqrt({0})",
    "rsqrt": "torch.rsqrt({0})",
    "abs": "torch.abs({0})",
    "square": "{0} * {0}",
    "reciprocal": "torch.reciprocal({0})",
    "sin": "torch.sin({0})",
    "cos": "torch.cos({0})",
    "erf": "torch.erf({0})",
    "hardsigmoid": "torch.nn.functional.hardsigmoid({0})",
    "hardswish": "torch.nn.functional.hardswish({0})",
    "where": "torch.where({0} != 0, {1}, {2})",
    "to_f32": "{0}.to(torch.float32)",
    "to_bf16": "{0}.to(torch.bfloat16)",
    "to_f16": "{0}.to(torch.float16)",
    "bf16_to_f32": "{0}.to(torch.float32)",  # eager's operand is a bf16 tensor already: exact
    "f16_to_f32": "{0}.to(torch.float32)",
}

# torch.maximum / minimum take tensors only; with a number (clamp's bound) the tensor's own dtype
# and NaN propagation come from clamp_min / clamp_max: fn -> expression over (tensor, number)
_TORCH_WITH_NUMBER = {"maximum": "torch.clamp_min({0}, {1})", "minimum": "torch.clamp_max({0}, {1})"}

# fn -> CUDA C++ expression over float operands (the CUDA templates' epilogues: templates/cuda/),
# the fast intrinsics where Triton's lowering uses the same approximations (exp, log)
_CUDA = {
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "mul": "{0} * {1}",
    "div": "{0} / {1}",
    # NaN in, NaN out, as torch (fmaxf / fminf return the other operand)
    "maximum": "({0} != {0} || {1} != {1} ? {0} + {1} : fmaxf({0}, {1}))",
    "minimum": "({0} != {0} || {1} != {1} ? {0} + {1} : fminf({0}, {1}))",
    "pow": "exp2f(log2f({0}) * {1})",
    "neg": "-{0}",
    "relu": "({0} != {0} ? {0} : fmaxf({0}, 0.0f))",
    "silu": "{0} / (1.0f + __expf(-{0}))",
    "sigmoid": "1.0f / (1.0f + __expf(-{0}))",
    "gelu": "0.5f * {0} * (1.0f + erff({0} * 0.7071067811865476f))",
    "gelu_tanh": "0.5f * {0} * (1.0f + tanhf(0.7978845608028654f * ({0} + 0.044715f * {0} * {0} * {0})))",
    "tanh": "tanhf({0})",
    "exp": "__expf({0})",
    "log": "__logf({0})",
    "sqrt": "sqrtf({0})",
    "rsqrt": "rsqrtf({0})",
    "abs": "fabsf({0})",
    "square": "{0} * {0}",
    "reciprocal": "1.0f / {0}",
    # the full-range forms: rotary tables take sin / cos of positions times frequencies, far
    # outside the [-pi, pi] where __sinf / __cosf are accurate
    "sin": "sinf({0})",
    "cos": "cosf({0})",
    "erf": "erff({0})",
    "hardsigmoid": "({0} != {0} ? {0} : fminf(fmaxf({0} + 3.0f, 0.0f), 6.0f) / 6.0f)",
    "hardswish": "{0} * fminf(fmaxf({0} + 3.0f, 0.0f), 6.0f) / 6.0f",
    "where": "({0} != 0.0f ? {1} : {2})",
    "to_f32": "{0}",
    "to_bf16": "round_bf16({0})",  # cuda/_prelude.cuh.j2
    "to_f16": "round_f16({0})",
    "bf16_to_f32": "round_bf16({0})",
    "f16_to_f32": "round_f16({0})",
}

assert set(_TRITON) == set(ELEMENTWISE_FNS) == set(_TORCH) == set(_CUDA)


def _operand(arg, names: dict[str, str], dialect: str = "triton") -> str:
    if isinstance(arg, (int, float)):
        if dialect == "cuda":
            if not math.isfinite(arg):
                raise ValueError(f"no CUDA literal for {arg}")
            return f"{float(arg)!r}f"
        return repr(float(arg))
    return f"({names[arg]})" if dialect == "cuda" else names[arg]


def render_program(program: list, names: dict[str, str], dialect: str = "triton") -> list[str]:
    """Statements computing `program`, one per instruction.

    `names` maps program names ("in0", "acc", ...) to expressions already in scope; each result
    is assigned to a fresh local `v_<name>` and added to `names` (the dict is updated in place,
    so callers can look up the outputs afterwards).
    """
    table = {"triton": _TRITON, "torch": _TORCH, "cuda": _CUDA}[dialect]
    lines = []
    for result, fn, args in program:
        if fn not in table:
            raise ValueError(f"unknown elementwise fn '{fn}'")
        template = table[fn]
        if dialect == "torch" and fn in _TORCH_WITH_NUMBER and any(isinstance(a, (int, float)) for a in args):
            template = _TORCH_WITH_NUMBER[fn]  # (both fns commute: the tensor operand goes first)
            args = sorted(args, key=lambda a: isinstance(a, (int, float)))
        expr = template.format(*(_operand(a, names, dialect) for a in args))
        local = f"v_{result}"
        lines.append(f"const float {local} = {expr};" if dialect == "cuda" else f"{local} = {expr}")
        names[result] = local
    return lines
