"""Parse and print IR text in the coopt dialect (used by `coopt opt` and IR tests)."""

from __future__ import annotations

import io

from xdsl.context import Context
from xdsl.dialects.builtin import Builtin, ModuleOp
from xdsl.dialects.func import Func
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.utils.exceptions import ParseError

from coopt.errors import InputFileError
from coopt.ir.dialect import Coopt


def context() -> Context:
    ctx = Context()
    for dialect in (Builtin, Func, Coopt):
        ctx.load_dialect(dialect)
    return ctx


def parse_module(text: str, name: str = "<input>") -> ModuleOp:
    try:
        module = Parser(context(), text, name).parse_module()
        module.verify()
    except ParseError as exc:
        first = str(exc).strip().splitlines()
        raise InputFileError(f"cannot parse {name}: {first[-1].strip() if first else exc}") from None
    except Exception as exc:
        raise InputFileError(f"invalid IR in {name}: {str(exc).strip().splitlines()[0]}") from None
    return module


def print_module(module: ModuleOp) -> str:
    stream = io.StringIO()
    Printer(stream=stream).print_op(module)
    return stream.getvalue() + "\n"
