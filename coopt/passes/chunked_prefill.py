"""chunked-prefill: a decoder's dynamic prompt length is bounded by a chunk, not by the cache.

A prefill entry point exported with a dynamic prompt length accepts anything up to the KV
cache's length, so every buffer its program allocates (activations of [B, T, ...], the
attention's scores) is sized for the whole prompt. A long prompt is better processed as chunks
at positions [s, s + chunk), each attending to the cache already written for [0, s): exactly
what the entry computes for a chunk (its cache attention takes one length per query position).

The pass narrows the prompt-length symbol (the symbol of the tokens input's dim 1 of a DECODER
step, codegen/input_bounds.py) to at most `chunk` in the module attribute `coopt.dims`, so
everything read from it afterwards — region dims for verification and planning, the program's
DIMS and DECODER["length"] — is bounded by the chunk, and records the chunk as the module
attribute `coopt.prefill_chunk` (DECODER["prefill_chunk"]; `coopt.generate` calls the entry once
per chunk). It changes no op: not lossy. A module without a dynamic prompt length is a pipeline
error (exit 5), never a silent no-op.

    coopt build examples/llama/model.py -o out/llama --prefill-chunk 512
    coopt opt prefill.mlir -p 'chunked-prefill{chunk=16}'
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, i64

from coopt.errors import ConfigError
from coopt.ir.dialect import json_prop
from coopt.passes.base import CooptPass
from coopt.passes.stats import count

DIMS_ATTR = "coopt.dims"  # symbol -> [min, max, example], set by the importer
CHUNK_ATTR = "coopt.prefill_chunk"  # set by this pass, read into DECODER["prefill_chunk"]


def prompt_length_symbol(module: ModuleOp) -> str | None:
    """The symbol of a DECODER step's dynamic prompt length (tokens' dim 1), else None."""
    from coopt.codegen.input_bounds import derive_input_bounds
    from coopt.ir.summary import symbol_table
    from coopt.passes.shapes import dims

    fn = _forward(module)
    if fn is None:
        return None
    symbols = symbol_table(module)
    bounds = derive_input_bounds(module, fn, symbols)
    # a DECODER step, or a paged-kv prompt step (tokens [B, T], positions [T], page_table)
    if bounds.decoder is None and (bounds.paged is None or bounds.paged["per_row"]):
        return None
    length = dims(fn.body.block.args[0])[1]
    return length if isinstance(length, str) and length in symbols else None


def _forward(module: ModuleOp) -> func.FuncOp | None:
    return next((op for op in module.walk() if isinstance(op, func.FuncOp) and op.sym_name.data == "forward"), None)


def prefill_chunk(module: ModuleOp) -> int | None:
    """The chunk recorded by the pass, or None."""
    attr = module.attributes.get(CHUNK_ATTR)
    return attr.value.data if isinstance(attr, IntegerAttr) else None


@dataclass(frozen=True)
class ChunkedPrefill(CooptPass):
    name = "chunked-prefill"
    summary = "a decoder's dynamic prompt length bounded by the chunk: long prompts are prefilled chunk by chunk over the cache"

    chunk: int = 512  # tokens per prefill call: a power of two >= 16

    def __post_init__(self):
        chunk = self.chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1):
            raise ConfigError(f"chunked-prefill: knob chunk={chunk!r} must be a power of two >= 16")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        symbol = prompt_length_symbol(op)
        if symbol is None:
            raise ConfigError(
                "chunked-prefill: the model has no dynamic prompt length to chunk (a decoder step forward(tokens [B, T], "
                "positions [T]) over a KV cache, exported with T dynamic); drop --prefill-chunk / the chunked-prefill pass")
        symbols = json.loads(op.attributes[DIMS_ATTR].data)
        low, high, example = symbols[symbol]
        if low > self.chunk:
            raise ConfigError(f"chunked-prefill: chunk={self.chunk} is below the prompt length's exported minimum {low}")
        symbols[symbol] = [low, min(high, self.chunk), min(example, self.chunk)]
        op.attributes[DIMS_ATTR] = json_prop(symbols)
        op.attributes[CHUNK_ATTR] = IntegerAttr(self.chunk, i64)
        count("chunked_prefill.narrowed" if high > self.chunk else "chunked_prefill.within_chunk")


def fit_example_inputs(module: ModuleOp, example_inputs: tuple) -> tuple:
    """The example inputs cut to the chunk along the narrowed prompt length (its first chunk):
    the build's end-to-end check calls the program with them, and it refuses a longer call."""
    import torch

    from coopt.ir.summary import symbol_table
    from coopt.passes.shapes import dims

    if prefill_chunk(module) is None:
        return example_inputs
    symbols = symbol_table(module)
    fitted = list(example_inputs)
    for index, arg in enumerate(_forward(module).body.block.args):
        value = fitted[index] if index < len(fitted) else None
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(dims(arg)):
            if isinstance(size, str) and size in symbols and value.shape[dim] > symbols[size][1]:
                value = value.narrow(dim, 0, symbols[size][1])
        fitted[index] = value
    return tuple(fitted)
