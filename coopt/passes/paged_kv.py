"""paged-kv: each KV cache becomes a page pool shared by the batch through a page table.

A static cache [B_max, Hkv, S_max, D] holds S_max positions for every sequence whatever its
length; a pool of `num-pages` pages [num_pages, Hkv, P, D] holds only the pages sequences use
(coopt/runtime/paged.py hands them out). Position p of sequence b is row p % P of page
page_table[b, p // P]; `page_table` [B, max_pages] int32 (max_pages = cdiv(S_max, P)) becomes a
new last input of the program.

Matched, on the raised IR (after raise-patterns and fp8-kv-cache, before fusion): every 4-D state
buffer written once by `coopt.state_update` index_put_ with indices [None, None, positions] (one
position per token, shared by the batch: a prefill or a plain decode step; the whole batch) or
[arange(B), None, positions] (one position per row: a ragged decode step), and read only by
decode / cache attentions (as k or v, through `[:B]` slices of dim 0); and, with per-token fp8
scales (fp8-kv-cache{granularity=per-token}), every 3-D scale buffer [B_max, Hkv, S_max] written
and read the same way (as k_scale or v_scale): a cache and its scales are paged alike, position p
of sequence b in row p % P of the same page. Rewritten:
- the buffer: a pool weight of the same state name and dtype (fp8 stays fp8), [N, Hkv, P, D]
  (a scale buffer: [N, Hkv, P] fp32);
- the write: `pool.index_put_([page_ids, None, slots], value)` with page_ids =
  page_table[rows, positions // P] (per row; value [B, Hkv, D]) or page_table[:, positions // P]
  (shared: [B, T], value permuted to [B, T, Hkv, D]) and slots = positions % P (scales: the
  same without D);
- each attention read: the sequences' pages gathered in table order, pool[page_table]
  [B, max_pages, Hkv, P, D] permuted and reshaped to [B, Hkv, max_pages * P, D] (`paged_view`;
  scales [B, Hkv, max_pages * P]): the attention and its lengths are unchanged. fuse-attention
  takes a decode attention over such views (`read_paged_attention`) into a decode_attention
  region in paged mode (inputs q, k_pages, v_pages, lengths, page_table[, k_scale, v_scale
  pools]: the kernel reads through the table, nothing is gathered), and a prompt's cache
  attention into an attention region in paged mode with the same inputs (likewise).
  fuse-kv-write takes the paged writes (a cache's and its scales') into a kv_write region in
  paged mode.

With fp8-kv-cache's exact-recent, each ring [B_max, Hkv, W, D] (a batch row's newest W rows)
becomes a pool of `max-sequences` ring slots [R, Hkv, W, D] and the program takes a last input
`ring_slots` [B] int32 (row b's sequence's slot; a paged caller moves sequences between rows):
attentions read index_select(pool, 0, ring_slots) (`ring_view`), the ring writes store at
[ring_slots[b], :, p % W]; fuse-attention takes the selects into the attention's region.

The pass touches no data: it records {"page_size", "num_pages", "max_pages", "batch",
"max_seq", "pools": {ref: [N, Hkv, P, D] or, scales, [N, Hkv, P]}, "page_table_input",
"positions_input", "per_row"[, "rings": {ref: [R, Hkv, W, D]}, "ring_slots": R,
"ring_slots_input"]} in
the module attribute `coopt.paged_kv`; the emitter lays each cache's contents out as pages
(`coopt.runtime.paged_layout.cache_to_pages`, sequence b in pages b*J .. b*J+J-1) and the program's
PAGED contract tells the runtime (`coopt.runtime.serve.PagedDecoder`) how to call it. Not
lossy. Refused with a one-line configuration error (exit 5): a model without a KV cache, a
cache written or read otherwise (a dynamic batch's sliced write, a functional update), fusion
already run, per-token scales that cannot be paged with their cache.

    coopt build examples/llama/model.py -o out/paged --paged-kv 16
    coopt opt step.mlir -p 'paged-kv{page-size=16 num-pages=64}'
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import FunctionType, ModuleOp, StringAttr, TensorType, i32
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.errors import ConfigError
from coopt.ir.dialect import (
    CacheAttentionOp,
    DecodeAttentionOp,
    KernelOp,
    StateUpdateOp,
    WeightOp,
)
from coopt.passes.base import (
    CooptPass,
    aten_arange,
    aten_target,
    insert_aten,
    literal_arg,
    tensor_arg,
)
from coopt.passes.fp8_kv_cache import RING_WRITE
from coopt.passes.shapes import dims, typed
from coopt.passes.stats import count
from coopt.runtime.pages import PAGE_SIZES

PAGED_ATTR = "coopt.paged_kv"
PAGE_TABLE = "page_table"  # the name of the new input in the program
RING_SLOTS = "ring_slots"  # with exact-recent rings: the input naming each row's ring slot
DEFAULT_RING_SLOTS = 256  # ring slots when max-sequences is 0 (and the pool has as many pages)
# permutations, truncated to the rank of what they move (a cache, or its per-token scales without D):
_TOKENS_FIRST = [0, 2, 1, 3]  # a shared write's value [B, Hkv, T, D] -> [B, T, Hkv, D], as the page ids index it
_PAGES_IN_ORDER = [0, 2, 1, 3, 4]  # gathered pages [B, max_pages, Hkv, P, D] -> [B, Hkv, max_pages, P, D]


def paged_record(module: ModuleOp) -> dict | None:
    """What the pass recorded (module attribute coopt.paged_kv), or None."""
    attr = module.attributes.get(PAGED_ATTR)
    return json.loads(attr.data) if attr is not None else None


@dataclass(frozen=True)
class PagedKv(CooptPass):
    name = "paged-kv"
    summary = "KV caches → page pools [num_pages, Hkv, P, D] read and written through a page_table input"

    page_size: int = 16  # positions per page: a power of two, 16 .. 256
    num_pages: int = 0  # pages in each pool; 0: as many as the static caches hold (B_max * cdiv(S_max, P))
    # with fp8-kv-cache's exact-recent: ring slots, the sequences that can be live at once (one
    # slot each, one more for a caller's padding rows); 0: min(num-pages, 256)
    max_sequences: int = 0

    def __post_init__(self):
        size, pages = self.page_size, self.num_pages
        slots = self.max_sequences
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0 or slots == 1:
            raise ConfigError(f"paged-kv: knob max-sequences={slots!r} must be an int >= 2 (0: min(num-pages, 256))")
        if isinstance(size, bool) or not isinstance(size, int) or size not in PAGE_SIZES:
            raise ConfigError(f"paged-kv: knob page-size={size!r} must be one of {', '.join(map(str, PAGE_SIZES))}")
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 0:
            raise ConfigError(f"paged-kv: knob num-pages={pages!r} must be an int >= 1 (0: the static caches' capacity)")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        fn = next((o for o in op.walk() if isinstance(o, func.FuncOp) and o.sym_name.data == "forward"), None)
        caches = [_read_cache(w) for w in op.walk() if isinstance(w, WeightOp) and _is_cache_candidate(w)]
        caches = [c for c in caches if c is not None]
        if fn is None or not caches:
            raise ConfigError("paged-kv: the model has no KV cache to page (no state buffer written by index_put and read "
                              "as k/v by a decode or cache attention); drop --paged-kv / the paged-kv pass")
        problems = [c for c in caches if isinstance(c, str)]
        if problems:
            raise ConfigError(f"paged-kv: {problems[0]}")
        batches = {c.batch for c in caches}
        max_seq = max(c.shape[2] for c in caches)
        if len(batches) != 1:
            raise ConfigError(f"paged-kv: the caches are written for different batches {sorted(batches)}")
        batch = batches.pop()
        unpaged = _unpaged_scales(caches)
        if unpaged:
            raise ConfigError(f"paged-kv: {unpaged}")
        size = self.page_size
        max_pages = -(-max_seq // size)
        num_pages = self.num_pages or max(c.shape[0] for c in caches) * max_pages
        table = _add_input(fn, TensorType(i32, [batch, max_pages]))
        pools = {}
        for cache in caches:
            pools[cache.ref] = _pool_shape(cache, num_pages, size)
            _page(cache, table, size, num_pages)
            count("paged_kv.caches" if len(cache.shape) == 4 else "paged_kv.scale_buffers")
        record = {
            "page_size": size, "num_pages": num_pages, "max_pages": max_pages, "batch": batch, "max_seq": max_seq,
            "pools": pools, "page_table_input": table.index, "positions_input": _positions_input(caches),
            "per_row": caches[0].rows is not None,
        }
        rings = _rings(op)
        if rings:  # exact-recent: each sequence's newest rows, in a ring slot the caller names per row
            record.update(_page_rings(fn, rings, batch, self.max_sequences or min(num_pages, DEFAULT_RING_SLOTS)))
        op.attributes[PAGED_ATTR] = StringAttr(json.dumps(record, sort_keys=True))


class _Cache:
    """A cache buffer (or the per-token scale buffer of one), its one write, and the attention
    operands that read it (through views)."""

    def __init__(self, weight: WeightOp, update: StateUpdateOp, positions: SSAValue, rows: Operation | None,
                 value: SSAValue, reads: list[tuple[Operation, int]], views: list[Operation]):
        self.weight, self.update, self.positions, self.rows, self.value = weight, update, positions, rows, value
        self.reads, self.views = reads, views
        self.ref = weight.ref.data
        self.shape = list(weight.results[0].type.get_shape())
        self.batch = dims(positions)[0] if rows is not None else self.shape[0]


def _attention_reads(user: Operation, index: int, rank: int) -> bool:
    """Whether operand `index` of `user` is an attention reading a buffer of `rank` that pages
    can hold: k / v (4-D caches) or, with per-token fp8 scales, k_scale / v_scale (3-D scale
    buffers [B_max, Hkv, S_max], one scale per cached row)."""
    if not isinstance(user, (DecodeAttentionOp, CacheAttentionOp)):
        return False
    if rank == 4:
        return index in (1, 2)
    return rank == 3 and index in (4, 5) and _per_token(user)


def _per_token(attention) -> bool:
    return attention.kv_scale is not None and attention.kv_scale.data == "per-token"


def _is_cache_candidate(weight: WeightOp) -> bool:
    """A 4-D (3-D: scales) buffer outside kernels that an attention reads as k / v (k_scale /
    v_scale) (maybe through views)."""
    rank = len(weight.results[0].type.get_shape())
    if isinstance(weight.parent_op(), KernelOp) or rank not in (3, 4):
        return False
    frontier, seen = [weight.results[0]], set()
    while frontier:
        value = frontier.pop()
        if value in seen:
            continue
        seen.add(value)
        for use in value.uses:
            if _attention_reads(use.operation, use.index, rank):
                return True
            if isinstance(use.operation, KernelOp) and use.operation.family.data in ("decode_attention", "attention", "kv_write"):
                return True
            if isinstance(use.operation, StateUpdateOp) or aten_target(use.operation) == "aten.slice.Tensor":
                frontier.extend(use.operation.results)
    return False


def _read_cache(weight: WeightOp) -> _Cache | str:
    """The cache's write and reads, or why it cannot be paged."""
    ref = weight.ref.data
    uses = list(weight.results[0].uses)
    if any(isinstance(u.operation, KernelOp) for u in uses):
        return f"buffer '{ref}' is already inside a kernel region: run paged-kv before the fusion passes"
    updates = [u.operation for u in uses if isinstance(u.operation, StateUpdateOp) and u.index == 0]
    if len(uses) != 1 or len(updates) != 1:
        return (f"buffer '{ref}' is not written exactly once by an in-place index_put before it is read "
                f"(run inplace-state-writes first; a dynamic batch's sliced write is not paged yet)")
    update = updates[0]
    indices = literal_arg(update, 1)
    if update.target.data != "aten.index_put_.default" or not isinstance(indices, list) or len(indices) != 3 \
            or indices[1] is not None or literal_arg(update, 3, "accumulate", False):
        return f"buffer '{ref}' is written by {update.target.data}, not index_put_ with indices [None | rows, None, positions]"
    positions = update.inputs[indices[2]["$t"]] if isinstance(indices[2], dict) else None
    rows = None
    if indices[0] is not None:
        rows = aten_arange(update.inputs[indices[0]["$t"]])
        if rows is None:
            return f"buffer '{ref}' is written at rows that are not arange(batch)"
    value = tensor_arg(update, 2)
    shape = list(weight.results[0].type.get_shape())
    rank, row = len(shape), [shape[1], *shape[3:]]  # one position of one sequence: [Hkv, D] ([Hkv]: scales)
    if positions is None or value is None or len(dims(positions)) != 1:
        return f"buffer '{ref}': its write's positions are not one index per token or per row"
    tokens = dims(positions)[0]
    if rows is not None and (dims(value) != [tokens, *row] or not isinstance(tokens, int)):
        return f"buffer '{ref}': a per-row write of shape {dims(value)} is not one {row} row per sequence"
    if rows is None and dims(value)[-rank:] != [shape[0], shape[1], tokens, *shape[3:]] \
            and not (shape[0] == 1 and dims(value) == [shape[1], tokens, *shape[3:]]):
        return f"buffer '{ref}': a write of shape {dims(value)} does not cover the cache's whole batch"
    reads, views = [], []
    frontier = [update.results[0]]
    while frontier:
        current = frontier.pop()
        for use in current.uses:
            user = use.operation
            if _attention_reads(user, use.index, rank):
                reads.append((user, use.index))
            elif aten_target(user) == "aten.slice.Tensor" and literal_arg(user, 1) == 0 and literal_arg(user, 2) in (0, None):
                views.append(user)
                frontier.extend(user.results)
            else:
                return f"buffer '{ref}' is read by {getattr(user, 'name', user)} (only decode / cache attentions can read pages)"
    if not reads:
        return f"buffer '{ref}' is written but no attention reads it"
    return _Cache(weight, update, positions, rows, value, reads, views)


def _unpaged_scales(caches: list[_Cache]) -> str | None:
    """Why an attention over per-token fp8 caches would read paged caches with scales that are not
    paged alike (k at operand 1 goes with k_scale at 4, v at 2 with v_scale at 5), or None."""
    reads = {read for cache in caches for read in cache.reads}
    for cache in caches:
        for attention, index in cache.reads:
            if index in (1, 2) and _per_token(attention) and (attention, index + 3) not in reads:
                return (f"buffer '{cache.ref}' has per-token fp8 scales that cannot be paged with it (a scale buffer "
                        f"[B_max, Hkv, S_max] written once at the cache's positions and read only by its attentions)")
    return None


def _pool_shape(cache: _Cache, num_pages: int, size: int) -> list[int]:
    """[N, Hkv, P, D] for a cache, [N, Hkv, P] for its per-token scales."""
    return [num_pages, cache.shape[1], size, *cache.shape[3:]]


def _positions_input(caches: list[_Cache]) -> int | None:
    from xdsl.ir import BlockArgument

    value = caches[0].positions
    return value.index if isinstance(value, BlockArgument) else None


# -- building the IR -----------------------------------------------------------------------------


def _add_input(fn: func.FuncOp, type_: TensorType):
    block = fn.body.block
    arg = block.insert_arg(type_, len(block.args))
    inputs = [a.type for a in block.args]
    fn.properties["function_type"] = FunctionType.from_lists(inputs, list(fn.function_type.outputs.data))
    return arg


def _page(cache: _Cache, table: SSAValue, size: int, num_pages: int) -> None:
    element = cache.weight.results[0].type.element_type
    pool = WeightOp(cache.ref, TensorType(element, _pool_shape(cache, num_pages, size)))
    for name, attr in cache.weight.attributes.items():
        pool.attributes[name] = attr
    Rewriter.insert_op(pool, InsertPoint.after(cache.weight))
    written = _paged_write(cache, pool.results[0], table, size)
    for attention, index in cache.reads:
        operands = list(attention.operands)
        operands[index] = paged_view(written, table, size, before=attention)
        attention.operands = operands
    count("paged_kv.writes")
    count("paged_kv.attention_reads", len(cache.reads))
    for op in [*reversed(cache.views), cache.update]:
        op.detach()
        op.erase()
    if cache.rows is not None and not cache.rows.results[0].uses:
        cache.rows.detach()
        cache.rows.erase()
    cache.weight.detach()
    cache.weight.erase()


def _paged_write(cache: _Cache, pool: SSAValue, table: SSAValue, size: int) -> SSAValue:
    """pool.index_put_([page_ids, None, slots], value) in place of the cache's write; returns
    the pool after it."""
    update, positions = cache.update, cache.positions
    position_dims = dims(positions)
    page_index = insert_aten("aten.floor_divide.Scalar", [{"$t": 0}, size], [positions], positions.type, update)
    slots = insert_aten("aten.remainder.Scalar", [{"$t": 0}, size], [positions], positions.type, update)
    value = cache.value
    if cache.rows is not None:  # row b's page: page_table[b, positions[b] // P]
        page_ids = insert_aten("aten.index.Tensor", [{"$t": 0}, [{"$t": 1}, {"$t": 2}]],
                               [table, cache.rows.results[0], page_index], typed(i32, position_dims), update)
    else:  # token t of every row b: page_table[b, positions[t] // P], the value as [B, T, Hkv, D]
        batch = dims(table)[0]
        page_ids = insert_aten("aten.index.Tensor", [{"$t": 0}, [None, {"$t": 1}]], [table, page_index],
                               typed(i32, [batch, *position_dims]), update)
        if len(dims(value)) == len(cache.shape) - 1:  # a batch-1 export writes [Hkv, T, D]
            value = insert_aten("aten.unsqueeze.default", [{"$t": 0}, 0], [value],
                                typed(value.type.element_type, [1, *dims(value)]), update)
        order = _TOKENS_FIRST[:len(dims(value))]  # (scales: [B, Hkv, T] -> [B, T, Hkv])
        value = insert_aten("aten.permute.default", [{"$t": 0}, order], [value],
                            typed(value.type.element_type, [dims(value)[i] for i in order]), update)
    call = {"args": [{"$t": 0}, [{"$t": 1}, None, {"$t": 2}], {"$t": 3}], "kwargs": {}}
    paged = StateUpdateOp(cache.ref, "aten.index_put_.default", call, [pool, page_ids, slots, value], pool.type)
    Rewriter.insert_op(paged, InsertPoint.before(update))
    return paged.results[0]


def paged_view(pool: SSAValue, table: SSAValue, size: int, before: Operation) -> SSAValue:
    """The sequences' caches as pages in table order: pool[page_table] permuted and reshaped to
    [B, Hkv, max_pages * P, D] (three ATen ops, inserted before `before`); per-token scale pools
    [N, Hkv, P] the same without D."""
    _, heads, _, *head_dim = dims(pool)
    batch, max_pages = dims(table)
    element = pool.type.element_type
    gathered_shape = [batch, max_pages, heads, size, *head_dim]
    order = _PAGES_IN_ORDER[:len(gathered_shape)]
    gathered = insert_aten("aten.index.Tensor", [{"$t": 0}, [{"$t": 1}]], [pool, table], typed(element, gathered_shape), before)
    ordered = insert_aten("aten.permute.default", [{"$t": 0}, order], [gathered],
                          typed(element, [gathered_shape[i] for i in order]), before)
    return insert_aten("aten.reshape.default", [{"$t": 0}, [batch, heads, max_pages * size, *head_dim]], [ordered],
                       typed(element, [batch, heads, max_pages * size, *head_dim]), before)


# -- exact-recent rings ---------------------------------------------------------------------------


def _rings(module: ModuleOp) -> list[WeightOp]:
    """The exact-recent rings (fp8-kv-cache): state buffers [B_max, Hkv, N, D] that attentions
    read as k_recent / v_recent."""
    rings = {}
    for op in module.walk():
        if isinstance(op, (DecodeAttentionOp, CacheAttentionOp)) and op.k_recent is not None:
            for ring in (op.k_recent, op.v_recent):
                if not isinstance(ring.owner, WeightOp) or isinstance(ring.owner.parent_op(), KernelOp):
                    raise ConfigError("paged-kv: an exact-recent ring is not a state buffer outside kernels: run paged-kv "
                                      "before the fusion passes")
                rings[ring.owner.ref.data] = ring.owner
    return list(rings.values())


def _page_rings(fn: func.FuncOp, rings: list[WeightOp], batch: int, slots: int) -> dict:
    """Each ring [B_max, Hkv, N, D] -> a pool of `slots` rings [slots, Hkv, N, D] indexed by a
    new last input `ring_slots` [B] int32 (row b's sequence's slot): a paged caller moves
    sequences between rows, so a ring cannot follow the row. Attentions read
    index_select(pool, 0, ring_slots); ring writes store at [ring_slots[b], :, p % N]."""
    if slots < max(batch, 2):
        raise ConfigError(f"paged-kv: knob max-sequences={slots} is under {max(batch, 2)}: each of a call's {batch} rows "
                          "names an exact-recent ring slot, and a caller's padding rows hold one of their own")
    slot_input = _add_input(fn, TensorType(i32, [batch]))
    shapes = {}
    for ring in rings:
        _, heads, window, head_dim = ring.results[0].type.get_shape()
        shape = [slots, heads, window, head_dim]
        pool = WeightOp(ring.ref.data, TensorType(ring.results[0].type.element_type, shape))
        Rewriter.insert_op(pool, InsertPoint.after(ring))
        for use in list(ring.results[0].uses):
            user = use.operation
            if isinstance(user, (DecodeAttentionOp, CacheAttentionOp)):
                operands = list(user.operands)
                operands[use.index] = ring_view(pool.results[0], slot_input, before=user)
                user.operands = operands
            elif isinstance(user, StateUpdateOp) and user.target.data == RING_WRITE and use.index == 0:
                call = {"args": [*user.call["args"][:5], {"$t": 3}], "kwargs": {}}
                written = StateUpdateOp(user.ref.data, RING_WRITE, call, [pool.results[0], *user.inputs[1:3], slot_input],
                                        pool.results[0].type)
                Rewriter.replace_op(user, written)
            else:
                raise ConfigError(f"paged-kv: the ring '{ring.ref.data}' is read by {user.name} (only exact-recent "
                                  "attentions and their ring writes can read a paged ring)")
        ring.detach()
        ring.erase()
        shapes[pool.ref.data] = shape
        count("paged_kv.rings")
    return {"rings": shapes, "ring_slots": slots, "ring_slots_input": slot_input.index}


def ring_view(pool: SSAValue, slots: SSAValue, before: Operation) -> SSAValue:
    """The rings of a call's rows: index_select(pool, 0, ring_slots) [B, Hkv, N, D] (inserted
    before `before`)."""
    shape = [dims(slots)[0], *dims(pool)[1:]]
    return insert_aten("aten.index_select.default", [{"$t": 0}, 0, {"$t": 1}], [pool, slots],
                       typed(pool.type.element_type, shape), before)


def read_ring_view(value: SSAValue) -> tuple[SSAValue, SSAValue] | None:
    """(pool, ring_slots) when `value` is a `ring_view`, else None."""
    select = value.owner
    if aten_target(select) != "aten.index_select.default" or literal_arg(select, 1) != 0 \
            or not isinstance(select.inputs[0].owner, WeightOp) or len(list(select.results[0].uses)) != 1:
        return None
    return select.inputs[0], select.inputs[1]


# -- recognising what the pass built (for the fusion passes) -------------------------------------


@dataclass
class PagedView:
    pool: SSAValue
    table: SSAValue
    page_size: int
    ops: list  # gather, permute, reshape


def read_paged_view(value: SSAValue) -> PagedView | None:
    """The pool, page table and page size when `value` is a `paged_view`, else None."""
    reshape = value.owner
    if aten_target(reshape) != "aten.reshape.default":
        return None
    permute = reshape.inputs[0].owner
    if aten_target(permute) != "aten.permute.default":
        return None
    gather = permute.inputs[0].owner
    if aten_target(gather) != "aten.index.Tensor" or len(gather.inputs) != 2 or len(literal_arg(gather, 1) or []) != 1:
        return None
    pool, table = gather.inputs
    if len(dims(pool)) not in (3, 4) or len(dims(table)) != 2 or not isinstance(dims(pool)[2], int):
        return None
    if literal_arg(permute, 1) != _PAGES_IN_ORDER[:len(dims(pool)) + 1]:
        return None
    if any(len(list(v.uses)) != 1 for v in (gather.results[0], permute.results[0])):
        return None
    return PagedView(pool, table, dims(pool)[2], [gather, permute, reshape])


@dataclass
class PagedReads:
    """The pools an attention reads through one page table: k / v and, with per-token fp8
    scales, k_scale / v_scale (else `scales` is empty); `ops` are the views' ops."""

    table: SSAValue
    page_size: int
    pools: list  # k pool, v pool
    scales: list  # k_scale pool, v_scale pool (per-token), or []
    ops: list


def read_paged_attention(attention) -> PagedReads | None:
    """What a decode or prompt attention reads through one page table when all its paged reads
    are `paged_view`s of it (k, v and per-token scales alike), else None."""
    operands = [attention.k, attention.v]
    if _per_token(attention):
        operands += [attention.k_scale, attention.v_scale]
    views = [read_paged_view(v) for v in operands]
    if any(v is None for v in views) or any(v.table is not views[0].table or v.page_size != views[0].page_size
                                            for v in views):
        return None
    return PagedReads(views[0].table, views[0].page_size, [v.pool for v in views[:2]], [v.pool for v in views[2:]],
                      [op for v in views for op in v.ops])


@dataclass
class PagedWrite:
    table: SSAValue
    positions: SSAValue
    page_size: int
    rows: Operation | None
    index_ops: list  # floor_divide, remainder, index (and the permute of a shared write's value)
    value: SSAValue  # what the cache write stores before the permute: [B, Hkv, D] per row, [B, Hkv, T, D] shared
    # (a per-token scale write: the same without D)


def read_paged_write(update: StateUpdateOp) -> PagedWrite | None:
    """The page table, positions and page size of a write `_paged_write` built, else None."""
    indices = literal_arg(update, 1)
    if update.target.data != "aten.index_put_.default" or not isinstance(indices, list) or len(indices) != 3 \
            or indices[1] is not None or not all(isinstance(i, dict) for i in (indices[0], indices[2])):
        return None
    page_ids, slots = update.inputs[indices[0]["$t"]].owner, update.inputs[indices[2]["$t"]].owner
    if aten_target(page_ids) != "aten.index.Tensor" or aten_target(slots) != "aten.remainder.Scalar":
        return None
    positions, size = slots.inputs[0], literal_arg(slots, 1)
    which = literal_arg(page_ids, 1)
    page_index = page_ids.inputs[which[-1]["$t"]].owner if isinstance(which, list) and which and which[-1] else None
    if aten_target(page_index) != "aten.floor_divide.Scalar" or page_index.inputs[0] is not positions \
            or literal_arg(page_index, 1) != size:
        return None
    table = page_ids.inputs[0]
    rows = None
    if len(which) == 2 and which[0] is not None:
        rows = aten_arange(page_ids.inputs[which[0]["$t"]])
        if rows is None:
            return None
    elif not (len(which) == 2 and which[0] is None):
        return None
    ops = [page_index, slots, page_ids]
    value = tensor_arg(update, 2)
    if rows is None:  # the shared form's value is permute(x, [0, 2, 1, 3]) ([0, 2, 1]: scales)
        permute = value.owner
        if aten_target(permute) != "aten.permute.default" \
                or literal_arg(permute, 1) != _TOKENS_FIRST[:len(dims(permute.inputs[0]))]:
            return None
        ops.append(permute)
        value = permute.inputs[0]
    if any(len(list(op.results[0].uses)) != 1 for op in ops):
        return None
    return PagedWrite(table, positions, size, rows, ops, value)
