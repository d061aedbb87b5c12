"""What a call of the built program must satisfy beyond dtypes and static shapes, read off the
final IR: the bounds that keep a KV-cache write or a table lookup inside its buffer.

- index bounds: an integer user input that (through value-preserving ops only: views, reshapes,
  casts) indexes a static dim of a weight or state buffer (`aten.index`, `index_put(_)`,
  `index_select`, `index_copy(_)`, `embedding`) must lie in [low, size). `low` is 0 for a state
  buffer (one the model writes: a position < 0 would wrap around the cache) and for embedding
  tables; -size for other weights, where PyTorch's negative indices are legal.
- size bounds: a dynamic dim of a user input that ends a slice `[:n]` of a weight's static dim
  (`k_cache[:batch]`, as `slice(buffer, d, 0, sym_size(tokens, 0))`) whose result torch.export
  typed with n's symbol must be <= that size (export assumed so; a slice would clamp a larger n
  and break every shape traced after it).
- decoder: a gpt-fast-style step `forward(tokens [B, T] int, positions [T] int) -> [B, T, V]`
  whose positions index a state buffer: what `generate` needs to know (cache length, batch
  and length ranges of one call, and the prefill chunk a `chunked-prefill` build records).

Anything computed from an input (`input_pos + 1` used as an index) is not traced: no bound is
derived for it; but the first element of a one-element input, and `arange(1) + v` (0 + v), hold
the input's values (transformers 5's cache positions are `arange(1) + cache_position[0]`). Every
derived bound is necessary (a call outside it indexes out of range, wraps a cache position, or
breaks a shape export assumed), so checking it rejects no correct call.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects import func
from xdsl.ir import Block, BlockArgument, SSAValue

from coopt.ir.dialect import KernelOp, StateUpdateOp, StateWriteOp, WeightOp
from coopt.ir.summary import tensor_spec
from coopt.passes.base import literal_arg, tensor_arg, zero_based_arange
from coopt.passes.chunked_prefill import prefill_chunk
from coopt.passes.paged_kv import paged_record
from coopt.passes.shapes import dims

# ops whose result holds exactly the values of operand 0 (same set of values, maybe reshaped or
# cast to another integer type): an index computed by them is bounded as the input itself
_SAME_VALUES = {
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.alias.default",
    "aten.clone.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
    "aten.squeeze.default", "aten.permute.default", "aten.transpose.int", "aten.t.default",
    "aten.expand.default", "aten.flatten.using_ints", "aten._to_copy.default", "aten.lift_fresh_copy.default",
}
# ops whose result is (a view of) part of operand 0: the indexed tensor is still that buffer
_VIEW_OF = _SAME_VALUES | {"aten.slice.Tensor", "aten.select.int", "aten.narrow.default", "aten.index_put.default"}

# indexing ops: target -> (position of the indexed tensor, how to find the indices)
#   ("list", p): args[p] is a list whose entry k indexes dim k
#   ("dim", p, q): args[q] indexes dim args[p]
_INDEXING = {
    "aten.index.Tensor": (0, ("list", 1)),
    "aten.index_put.default": (0, ("list", 1)),
    "aten.index_put_.default": (0, ("list", 1)),
    "aten.index_select.default": (0, ("dim", 1, 2)),
    "aten.index_copy.default": (0, ("dim", 1, 2)),
    "aten.index_copy_.default": (0, ("dim", 1, 2)),
    "aten.embedding.default": (0, ("fixed", 0, 1)),
}
_SLICING = {"aten.slice.Tensor": 1, "aten.slice_scatter.default": 2, "coopt.slice_copy_": 2}  # -> position of dim


@dataclass(frozen=True)
class IndexBound:
    input: int  # user input index
    low: int
    high: int  # low <= value < high
    reason: str  # "dim 2 (size 128) of the state buffer 'layers.0.attention.k_cache'"
    state: bool  # indexes a buffer the model writes (a KV cache)


@dataclass(frozen=True)
class SizeBound:
    input: int
    dim: int
    high: int  # shape[dim] <= high
    reason: str


@dataclass
class InputBounds:
    index: list[IndexBound]
    size: list[SizeBound]
    decoder: dict | None
    paged: dict | None = None  # a paged-kv program's contract (the runtime's PAGED), else None


def _source(value: SSAValue) -> SSAValue:
    """Through a kernel body's block argument to the value the kernel was called with."""
    while isinstance(value, BlockArgument) and isinstance(value.owner.parent_op(), KernelOp):
        value = value.owner.parent_op().inputs[value.index]
    return value


def _call_target(op) -> str | None:
    target = getattr(op, "target", None)
    return target.data if target is not None else None


def _operand(op, arg) -> SSAValue | None:
    return op.inputs[arg["$t"]] if isinstance(arg, dict) and "$t" in arg else None


def _same_values_operand(op) -> SSAValue | None:
    """The operand whose values op's result holds unchanged: operand 0 of a _SAME_VALUES op; x of
    select(x, 0, 0) over a one-element x; v of arange(1) + v (transformers 5 makes its cache
    positions so: arange(1) + cache_position[0]). Else None."""
    target = _call_target(op)
    if target in _SAME_VALUES and op.inputs:
        return op.inputs[0]
    if target == "aten.select.int" and dims(op.inputs[0]) == [1] and literal_arg(op, 2) in (0, -1):
        return op.inputs[0]
    if target == "aten.add.Tensor" and len(op.inputs) == 2 and literal_arg(op, 2, "alpha", 1) == 1:
        for zero, other in (op.inputs, op.inputs[::-1]):
            if zero_based_arange(_source(zero)) == 1:
                return other
    return None


def _user_input(value: SSAValue, inputs: Block) -> int | None:
    """Index of the user input whose values `value` carries unchanged, if any."""
    value = _source(value)
    while not (isinstance(value, BlockArgument) and value.owner is inputs):
        operand = _same_values_operand(value.owner)
        if operand is None:
            return None
        value = _source(operand)
    return value.index


def _weight_root(value: SSAValue) -> WeightOp | None:
    """The weight / buffer that `value` is a view (or in-place update) of, if any."""
    value = _source(value)
    while not isinstance(value.owner, WeightOp):
        op = value.owner
        inplace = op.family_attrs.get("inplace") if isinstance(op, KernelOp) else None
        if inplace and value.index < len(inplace):
            # an in-place region's result i is its input inplace[i] after the write (a kv_write;
            # a decode attention with the write folded in returns its output after them)
            value = _source(op.inputs[inplace[value.index]])
            continue
        if not (isinstance(op, StateUpdateOp) or _call_target(op) in _VIEW_OF) or not op.inputs:
            return None
        value = _source(op.inputs[0])
    return value.owner


def _indices(op, how) -> list[tuple[int, SSAValue]]:
    """(dim, index value) pairs of an indexing op."""
    kind = how[0]
    if kind == "list":
        entries = literal_arg(op, how[1]) or []
        return [(k, _operand(op, e)) for k, e in enumerate(entries) if _operand(op, e) is not None]
    if kind == "dim":
        dim, index = literal_arg(op, how[1]), tensor_arg(op, how[2])
        return [(dim, index)] if isinstance(dim, int) and index is not None else []
    index = tensor_arg(op, how[2])
    return [(how[1], index)] if index is not None else []


def _is_index_type(value: SSAValue) -> bool:
    # int64 / int32 only: bool and 8-bit indices (a uint8 index is a mask) select, not address
    return str(value.type.element_type) in ("i64", "i32")


def _describe(weight: WeightOp, dim: int, size: int, state: bool) -> str:
    kind = "state buffer" if state else "weight"
    return f"dim {dim} (size {size}) of the {kind} '{weight.ref.data}'"


def _slice_bound(op, position: int, inputs: Block, written: set[str]) -> SizeBound | None:
    """`weight[:n]` along a static dim, n = a user input's dynamic size, and the slice typed
    with n's symbol: torch.export assumed n <= the dim's size (a slice clamps, so a larger n
    would break the shapes everything after it was traced with)."""
    sliced = op.inputs[0]
    weight, shape = _weight_root(sliced), dims(sliced)
    dim, start, end, step = (literal_arg(op, position + k) for k in range(4))
    end = _operand(op, end)
    if weight is None or not shape or not isinstance(dim, int) or start not in (None, 0) or step not in (None, 1) or end is None:
        return None
    dim %= len(shape)
    size_of = _source(end).owner
    if _call_target(size_of) != "aten.sym_size.int" or not isinstance(shape[dim], int):
        return None
    source, input_dim = _user_input(tensor_arg(size_of, 0), inputs), literal_arg(size_of, 1)
    if source is None or not isinstance(input_dim, int):
        return None
    input_shape = dims(inputs.args[source])
    input_dim %= len(input_shape)
    # the slice's own extent (slice: its result; slice_scatter / slice_copy_: the source written)
    piece = op.results[0] if position == 1 else tensor_arg(op, 1)
    if piece is None or dims(piece)[dim] != input_shape[input_dim]:
        return None
    reason = _describe(weight, dim, shape[dim], weight.ref.data in written)
    return SizeBound(source, input_dim, shape[dim], reason)


_WRITES = {"aten.index_put.default", "aten.index_put_.default", "aten.index_copy.default", "aten.index_copy_.default"}


def _reads_written_state(value: SSAValue, written: set[str]) -> bool:
    """Whether `value` is computed from a state buffer the program writes (through any op; a
    copy(dst, src) holds src's values, so only src counts)."""
    stack, seen = [value], set()
    while stack:
        value = _source(stack.pop())
        if value in seen or isinstance(value, BlockArgument):
            continue
        seen.add(value)
        op = value.owner
        if isinstance(op, WeightOp):
            if op.ref.data in written:
                return True
            continue
        operands = list(op.operands)
        if _call_target(op) == "aten.copy.default" and len(operands) == 2:
            operands = operands[1:]
        stack.extend(operands)
    return False


def state_moved_writes(module) -> list[str]:
    """State buffers the program writes at positions computed from state it writes itself (a
    cache written at offset + rel, offset a buffer that every call moves): each call of the
    same inputs writes elsewhere. A decoder's positions come from its inputs (transformers'
    cumulative_length is a copy of cache_position, not a source of it), so a timed loop that
    repeats one call rewrites one row; over such a buffer it walks off the end (on a GPU a
    device-side assert, which ends the process's CUDA context)."""
    written = {op.ref.data for op in module.walk() if isinstance(op, (StateUpdateOp, StateWriteOp))}
    moved = []
    for op in module.walk():
        target = _call_target(op)
        if target not in _WRITES:
            continue
        position, how = _INDEXING[target]
        indexed = tensor_arg(op, position)
        weight = _weight_root(indexed) if indexed is not None else None
        if weight is None or weight.ref.data not in written or weight.ref.data in moved:
            continue
        if any(_reads_written_state(index, written) for _, index in _indices(op, how)):
            moved.append(weight.ref.data)
    return moved


def derive_input_bounds(module, fn: func.FuncOp, symbols: dict[str, list[int]]) -> InputBounds:
    """Index and size bounds of `fn`'s user inputs, and its decoder contract if it is one.
    `symbols` is the importer's table: symbol -> [min, max, example]."""
    inputs = fn.body.block
    written = {op.ref.data for op in module.walk() if isinstance(op, (StateUpdateOp, StateWriteOp))}
    index: dict[tuple, IndexBound] = {}
    size: dict[tuple, SizeBound] = {}
    for op in module.walk():
        target = _call_target(op)
        if target in _INDEXING:
            position, how = _INDEXING[target]
            indexed = tensor_arg(op, position)
            weight = _weight_root(indexed) if indexed is not None else None
            if weight is None:
                continue
            shape = dims(indexed)
            state = weight.ref.data in written
            for dim, value in _indices(op, how):
                source = _user_input(value, inputs)
                if source is None or not shape or not (_is_index_type(value) and _is_index_type(inputs.args[source])):
                    continue
                dim %= len(shape)
                if not isinstance(shape[dim], int):
                    continue
                low = 0 if state or target == "aten.embedding.default" else -shape[dim]
                bound = IndexBound(source, low, shape[dim], _describe(weight, dim, shape[dim], state), state)
                index.setdefault((source, low, shape[dim]), bound)
        elif target in _SLICING:
            bound = _slice_bound(op, _SLICING[target], inputs, written)
            if bound is not None:
                size.setdefault((bound.input, bound.dim, bound.high), bound)
    paged = paged_record(module)
    if paged is not None and paged.get("positions_input") is not None:
        # paged-kv: positions reach the pools only through page arithmetic (not traced above);
        # a position must lie within what a sequence can hold
        what = (f"the positions of the paged KV cache ({paged['max_seq']} per sequence: pages of "
                f"{paged['page_size']} through a page table of {paged['max_pages']})")
        index.setdefault((paged["positions_input"], 0, paged["max_seq"]),
                         IndexBound(paged["positions_input"], 0, paged["max_seq"], what, True))
    if paged is not None and paged.get("ring_slots_input") is not None:
        slots = paged["ring_slots"]  # exact-recent: a row's ring slot indexes the ring pools
        index.setdefault((paged["ring_slots_input"], 0, slots),
                         IndexBound(paged["ring_slots_input"], 0, slots, f"the exact-recent ring slots ({slots})", True))
    # tightest first: the first bound a call breaks is the one its error message names
    index_bounds = sorted(index.values(), key=lambda b: (b.input, b.high - b.low))
    size_bounds = sorted(size.values(), key=lambda b: (b.input, b.dim, b.high))
    decoder = _decoder(fn, index_bounds, size_bounds, symbols)
    if decoder is not None and prefill_chunk(module) is not None:
        # chunked-prefill bounded the length by it (already in "length"); absent: no chunk set
        decoder["prefill_chunk"] = prefill_chunk(module)
    contract = _paged_contract(fn, paged, index_bounds, symbols, prefill_chunk(module)) if paged is not None else None
    return InputBounds(index_bounds, size_bounds, decoder, contract)


def _paged_contract(fn: func.FuncOp, paged: dict, index_bounds, symbols: dict, chunk: int | None) -> dict | None:
    """What `coopt.runtime.serve.PagedDecoder` needs of a paged-kv program forward(tokens [B, T],
    positions ([B] per row, T = 1; else [T]), page_table [B, max_pages][, ring_slots [B]]): the
    pool's geometry, the batch and tokens per call, the vocabulary, and with exact-recent rings
    their slots."""
    args = fn.body.block.args
    rings = paged.get("ring_slots_input") is not None  # exact-recent rings: ring_slots [B] after the table
    if paged.get("positions_input") != 1 or paged.get("page_table_input") != 2 or len(args) != 3 + rings \
            or (rings and paged["ring_slots_input"] != 3):
        return None
    tokens = dims(args[0])
    length = _range(tokens[1], symbols, paged["max_seq"]) if len(tokens) == 2 else None
    token_bounds = [b for b in index_bounds if b.input == 0]
    vocab = [max(b.low for b in token_bounds), min(b.high for b in token_bounds)] if token_bounds else None
    contract = {
        "tokens": 0, "positions": 1, "page_table": 2, "dtype": tensor_spec(args[0]).dtype,
        "per_row": bool(paged["per_row"]), "batch": paged["batch"], "length": length, "token_range": vocab,
        **{k: paged[k] for k in ("page_size", "num_pages", "max_pages", "max_seq")},
        "pools": sorted(paged["pools"]),
    }
    if rings:  # row b's sequence's ring slot, one of num_ring_slots
        contract.update({"ring_slots": 3, "num_ring_slots": paged["ring_slots"], "rings": sorted(paged["rings"])})
    if chunk is not None:
        contract["prefill_chunk"] = chunk
    return contract


def _range(dim, symbols: dict, cap: int | None = None) -> list[int] | None:
    """[min, max] of a dim one call accepts: the static size, or the symbol's exported range
    (capped); None for a dim that is an expression of symbols."""
    if isinstance(dim, int):
        return [dim, dim]
    if dim not in symbols:
        return None
    low, high = symbols[dim][:2]
    return [low, high if cap is None else min(high, cap)]


def _decoder(fn: func.FuncOp, index_bounds, size_bounds, symbols: dict) -> dict | None:
    """`generate`'s view of a decoder step forward(tokens [B, T], positions [T]) -> [B, T, V]
    whose positions index a state buffer; None for any other program."""
    args = fn.body.block.args
    outputs = fn.function_type.outputs.data
    if len(args) != 2 or len(outputs) != 1 or len(outputs[0].get_shape()) != 3:
        return None
    tokens, positions = (dims(a) for a in args)
    if len(tokens) != 2 or len(positions) != 1 or tokens[1] != positions[0] or not all(_is_index_type(a) for a in args):
        return None
    cache = [b.high for b in index_bounds if b.input == 1 and b.state and b.low == 0]
    if not cache:
        return None
    max_seq = min(cache)
    batch_cap = min((b.high for b in size_bounds if b.input == 0 and b.dim == 0), default=None)
    batch, length = _range(tokens[0], symbols, batch_cap), _range(tokens[1], symbols, max_seq)
    if batch is None or length is None:
        return None
    token_bounds = [b for b in index_bounds if b.input == 0]  # an embedding: the vocabulary
    vocab = [max(b.low for b in token_bounds), min(b.high for b in token_bounds)] if token_bounds else None
    return {
        "tokens": 0, "positions": 1, "dtype": tensor_spec(args[0]).dtype, "max_seq": max_seq,
        "batch": batch, "length": length, "token_range": vocab,
    }
