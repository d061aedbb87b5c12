"""Hypothesis strategies for a region: symbolic dims, a value seed and a magnitude.

An `Example` is all that is needed to rebuild the inputs of one check: the size of every
symbolic dim, an integer seed for `torch.Generator` and a magnitude. Hypothesis draws and
shrinks only these few integers; tensors are generated from them by `make_inputs` (drawing
tensors element by element through Hypothesis would be far too slow).

Dims: each symbolic dim is drawn from its (min, max) range in `RegionSummary.dims` (capped by
the profile): a third of the time the minimum, a third an edge value (1, small odd sizes,
non-powers of two, the example's size, the maximum), a third anywhere in the range. Shrinking
moves toward the minimum. `anchor_examples` adds fixed examples checked on every run. Static
dims are ints in the spec, so regions whose attrs pin a dim need nothing here.

Values: standard normal times a magnitude drawn from (1, 1e-3, 30, 1e3), one magnitude per
example for all inputs; shrinking moves toward 1. An integer input that the region names as
valid lengths (attrs {"lengths_input": i, "lengths_bound": [j, d]}: every value of input i lies
in [1, inputs[j].shape[d]], as decode_attention's lengths [B] against S_max) gets such lengths,
chosen per element from the example's seed (see `valid_lengths`); examples of even seed (the anchors of a build's default seed 0 among them) pass a
single length expanded over the batch, the stride-0 view a decode step really passes (with
attrs "lengths_offset": c the input holds lengths - c, so those lengths less c). An
integer input named as an index (attrs {"index_input": i, "index_bound": [j, d]}: every value in
[0, inputs[j].shape[d]), as a ragged kv_write's per-row positions [B] into the cache's S_max)
gets such lengths minus one: every row its own position, the first and last among them.

Paged regions (paged-kv: attrs "page_size": P, "page_table_input": i, "pool_input": j) get a
valid page table: page ids in [0, inputs[j].shape[0]), a permutation of the pool laid out column
by column, so rows never share a page while the pool has a page for each slot (`valid_page_table`);
their lengths and index bounds count positions through the table (max_pages * P), not the
pool's page dim. A paged write (an in-place region with an index input) then gets a page of its
own for every table entry it writes through (`distinct_written_pages`), however small the pool.

Exact-recent rings read through paged-kv's ring slots (attrs "ring_slots_input") get distinct
slots of the ring pools (`valid_ring_slots`), one a row, as a caller gives each live sequence.

Sums of squares (a matmul_epilogue whose prologue is "rms_norm_stats", fuse-norm-statistics:
input `squares_input`, sq [C, M] fp32, C chunks of K / C columns of each row's h^2) are positive,
(K / C) * magnitude^2 within a factor of two: the chunk sums of rows of the example's magnitude,
so that rsqrt(sum / K + eps) is defined and the normed product has the example's magnitude too.

Rotary tables a decode attention applies itself (`rotary_tables`: the query's cos, sin and a
folded write's K tables) are cos and sin of one uniform angle per element, whatever the
magnitude, as every rotary table is: at magnitude 30 random tables would rotate q and K into
values of 900 and scores of ~1e6, where one ulp of a product moves the softmax more than the
fp32 floor allows, eager fp32 included (session 13: a folded write's check failed on the H200 at
2.4e-3 of S against the floor's 1e-5). A rotation keeps the data's magnitude.

fp8 (an fp8 KV cache, docs/kv-cache.md): a quantizer fills the format's range, so fp8 inputs
are N(0, 1) * max / 4 whatever the magnitude (every exponent of e4m3, subnormals included),
with outliers at exactly +-max (448 for e4m3) and, in half the examples, one all-zero head
(slice [i, j] of a rank >= 3 tensor: head j of sequence i of a cache); never NaN. The scale
inputs a region names (`scale_inputs`: k_scale, v_scale of an attention over an fp8 cache, the
scales of a quantizing kv_write) are positive, magnitude / (max / 4) within a factor of two, so
that the dequantized cache has the example's magnitude like every other input.

    >>> from coopt.ir.region import RegionSummary, TensorSpec
    >>> region = RegionSummary("r0", "elementwise", (TensorSpec(("n", 8), "float32"),),
    ...                        (TensorSpec(("n", 8), "float32"),), dims={"n": (1, 4096)})
    >>> example = Example((("n", 3),), seed=7, magnitude=30.0)
    >>> [tuple(t.shape) for t in make_inputs(region, example)]
    [(3, 8)]
    >>> examples(region, resolve_profile("ci"))  # a SearchStrategy[Example]  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from coopt.ir.region import (
    RegionSummary,
    kv_write_rope,
    lengths_offset,
    rope_at,
    squares_input,
)
from coopt.verify.profiles import Profile, resolve_profile  # noqa: F401  (doctest)
from coopt.verify.tolerances import torch_dtype

MAGNITUDES = (1.0, 1e-3, 30.0, 1e3)
# Odd sizes and non-powers of two that catch tail-masking bugs, plus powers of two that catch
# off-by-one at block boundaries.
_INTERESTING_SIZES = (3, 7, 17, 31, 33, 63, 65, 127, 129, 1000, 1023, 1025, 4095, 4097)
_MAX_SEED = 2**31 - 1
# fp8 inputs: values of N(0, 1) * max / _FP8_SPREAD_DIVISOR, one element in _FP8_OUTLIER_EVERY at
# +-max (a quantizer's saturated values).
_FP8_SPREAD_DIVISOR = 4.0
_FP8_OUTLIER_EVERY = 64


@dataclass(frozen=True)
class Example:
    """One point of the search: sizes of the symbolic dims, a value seed and a magnitude."""

    dims: tuple[tuple[str, int], ...]
    seed: int
    magnitude: float

    def dim_values(self) -> dict[str, int]:
        return dict(self.dims)

    def describe(self) -> str:
        """'dims n=3 m=1, seed 7, magnitude 30' (the form failures and repros print)."""
        dims = " ".join(f"{name}={value}" for name, value in self.dims) or "(static)"
        return f"dims {dims}, seed {self.seed}, magnitude {self.magnitude:g}"

    def to_json(self) -> dict:
        return {"dims": dict(self.dims), "seed": self.seed, "magnitude": self.magnitude}

    @staticmethod
    def from_json(data: dict) -> "Example":
        return Example(tuple(data["dims"].items()), int(data["seed"]), float(data["magnitude"]))


def symbolic_dims(region: RegionSummary) -> list[str]:
    """Symbolic dim names in order of first appearance in the inputs, then the outputs."""
    names: list[str] = []
    for spec in (*region.inputs, *region.outputs):
        for dim in spec.shape:
            if isinstance(dim, str) and dim not in names:
                names.append(dim)
    return names


def dim_range(region: RegionSummary, name: str, profile: Profile) -> tuple[int, int]:
    """(min, max) of a symbolic dim after the profile's cap.

    A dim missing from `region.dims` ranges over 1..its example size.
    """
    default_hi = max(1, region.example_dims.get(name, profile.dim_cap or 1))
    lo, hi = region.dims.get(name, (1, default_hi))
    lo = max(int(lo), 0)
    hi = max(int(hi), lo)
    if profile.dim_cap is not None:
        hi = max(lo, min(hi, profile.dim_cap))
    return lo, hi


def edge_values(lo: int, hi: int, example_size: int | None = None) -> list[int]:
    """Edge sizes within [lo, hi], the minimum first (it is where shrinking ends up)."""
    wanted = [lo, 1, 2, *_INTERESTING_SIZES, example_size, hi - 1, hi]
    edges: list[int] = []
    for size in wanted:
        if size is not None and lo <= size <= hi and size not in edges:
            edges.append(size)
    return edges


def _dim_strategy(lo: int, hi: int, example_size: int | None) -> st.SearchStrategy[int]:
    # The minimum gets a branch of its own (about a third of the draws): "wrong only when
    # dim == 1" is the commonest shape bug. one_of shrinks toward its first branch, so
    # failures end on the minimum, or else on an edge value, when one of those fails.
    return st.one_of(st.just(lo), st.sampled_from(edge_values(lo, hi, example_size)),
                     st.integers(lo, hi))


def examples(region: RegionSummary, profile: Profile) -> st.SearchStrategy[Example]:
    """The strategy Hypothesis draws `Example`s from for `region` under `profile`."""
    names = symbolic_dims(region)
    per_dim = {
        name: _dim_strategy(*dim_range(region, name, profile), region.example_dims.get(name))
        for name in names
    }
    dims = st.fixed_dictionaries(per_dim).map(lambda d: fit_dims(region, d, profile))
    return st.builds(
        lambda dim_values, seed, magnitude: Example(
            tuple((n, dim_values[n]) for n in names), seed, magnitude),
        dims,
        st.integers(0, _MAX_SEED),
        st.sampled_from(MAGNITUDES),
    )


def anchor_examples(region: RegionSummary, profile: Profile, seed: int) -> list[Example]:
    """Fixed examples always checked, whatever Hypothesis drew: the example dims; each
    symbolic dim alone at its minimum (the others at the example's); all at the maximum."""
    names = symbolic_dims(region)
    ranges = {name: dim_range(region, name, profile) for name in names}
    example_dims = {n: min(max(region.example_dims.get(n, ranges[n][1]), ranges[n][0]),
                           ranges[n][1]) for n in names}
    candidates = [example_dims]
    candidates += [{**example_dims, n: ranges[n][0]} for n in names]
    candidates.append({n: ranges[n][1] for n in names})
    anchors: list[Example] = []
    for dims in candidates:
        fitted = fit_dims(region, dims, profile)
        example = Example(tuple((n, fitted[n]) for n in names), seed % (_MAX_SEED + 1), 1.0)
        if example not in anchors:
            anchors.append(example)
    return anchors


def fit_dims(region: RegionSummary, dims: dict[str, int], profile: Profile) -> dict[str, int]:
    """Apply family constraints, then halve the largest symbolic dims of any tensor larger
    than the profile's element budget (deterministic, so shrinking still works)."""
    dims = _family_constraints(region, dict(dims), profile)
    if profile.max_elements is None:
        return dims
    for spec in (*region.inputs, *region.outputs):
        while _numel(spec.concrete(dims)) > profile.max_elements:
            shrinkable = [d for d in spec.shape if isinstance(d, str)
                          and dims[d] > dim_range(region, d, profile)[0]]
            if not shrinkable:
                break  # static dims alone exceed the budget: nothing to do
            largest = max(shrinkable, key=lambda d: dims[d])
            dims[largest] = max(dim_range(region, largest, profile)[0], dims[largest] // 2)
    return dims


def _family_constraints(region: RegionSummary, dims: dict[str, int], profile: Profile):
    # Causal attention with Sq > Sk fully masks some query rows (softmax of all -inf is NaN in
    # the reference); such inputs never occur in a model (queries are the newest keys).
    if region.family == "attention" and region.attrs.get("causal") and len(region.inputs) >= 2:
        sq, sk = region.inputs[0].shape[2], region.inputs[1].shape[2]
        if isinstance(sq, str) and isinstance(sk, str) and sq != sk and dims[sq] > dims[sk]:
            sk_hi = dim_range(region, sk, profile)[1]
            dims[sk] = min(dims[sq], sk_hi)
            dims[sq] = min(dims[sq], dims[sk])
    return dims


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_inputs(region: RegionSummary, example: Example, device: str | torch.device = "cpu"):
    """The example's input tensors, in `region.inputs` order, identical on every machine.

    Values are drawn on `device` itself from torch.Generator(device).manual_seed(seed): the
    same numbers on every machine of a device type (CPU and GPU streams differ). Drawing
    tens of millions of values on the CPU per example and copying them was the likeliest cost
    behind a 128 s build of two 4096x16384 GEMM regions on the H200 (inferred, not profiled).
    Floating inputs: N(0, 1) *
    magnitude; fp8 inputs and the region's scale inputs as the module docstring says; integer
    inputs: uniform in [0, 8), or valid lengths for the region's lengths input; bool: fair coin.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(example.seed)
    dims = example.dim_values()
    scales = scale_inputs(region)
    squares_at = squares_input(region)
    fp8_spread = _fp8_spread(region)
    rotary = rotary_tables(region)
    sines = {}  # sin's index -> the sine of the angles drawn for its cos
    tensors = []
    for index, spec in enumerate(region.inputs):
        shape = spec.concrete(dims)
        dtype = torch_dtype(spec.dtype)
        if index in sines:
            tensor = sines.pop(index).to(dtype)
        elif index in rotary and dtype.is_floating_point:
            angles = torch.rand(shape, generator=generator, dtype=torch.float32, device=device) * (2 * torch.pi)
            tensor, sines[index + 1] = angles.cos().to(dtype), angles.sin()
        elif index == squares_at and dtype.is_floating_point:
            # each chunk's sum of h^2 for rows of the example's magnitude: positive, about
            # (K / C) * magnitude^2
            chunk_width = region.inputs[0].concrete(dims)[-1] / max(shape[0], 1)
            factor = torch.exp2(torch.rand(shape, generator=generator, device=device) * 2 - 1)
            tensor = (factor * (chunk_width * example.magnitude ** 2)).to(dtype)
        elif index in scales and dtype.is_floating_point:
            # positive, within a factor of two of magnitude / spread: dequantized values of the
            # example's magnitude
            factor = torch.exp2(torch.rand(shape, generator=generator, device=device) * 2 - 1)
            tensor = (factor * (example.magnitude / fp8_spread)).to(dtype)
        elif dtype.is_floating_point and dtype.itemsize == 1:
            tensor = fp8_values(shape, dtype, generator, device)
        elif dtype.is_floating_point:
            values = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
            tensor = (values * example.magnitude).to(dtype)
        elif dtype == torch.bool:
            tensor = torch.randint(0, 2, shape, generator=generator, device=device).bool()
        elif index == region.attrs.get("page_table_input"):
            pool = region.inputs[region.attrs.get("pool_input", 0)].concrete(dims)[0]
            tensor = valid_page_table(shape, pool, example.seed).to(dtype).to(device)
        elif index == region.attrs.get("ring_slots_input"):
            rings = region.inputs[region.attrs["exact_rows_input"] + 2].concrete(dims)[0]
            tensor = valid_ring_slots(shape[0], rings, example.seed).to(dtype).to(device)
        elif index == region.attrs.get("lengths_input"):
            # with attrs lengths_offset the input holds lengths - offset (a step's positions)
            lengths = valid_lengths(shape, _max_length(region, dims), example.seed)
            tensor = (lengths - lengths_offset(region)).to(dtype).to(device)
            if example.seed % 2 == 0 and tensor.dim() == 1 and tensor.numel() > 1:
                # as a decode step passes them: one length expanded over the batch (a stride-0
                # view; a kernel reading it as contiguous gets garbage past element 0)
                tensor = tensor[:1].expand(tensor.shape[0])
        elif index == region.attrs.get("index_input"):
            bound = _bound_of(region, "index_bound", dims)
            tensor = (valid_lengths(shape, bound, example.seed) - 1).to(dtype).to(device)
        else:
            tensor = torch.randint(0, 8, shape, generator=generator, dtype=dtype, device=device)
        tensors.append(tensor)
    table_at, positions_at = region.attrs.get("page_table_input"), region.attrs.get("index_input")
    if table_at is not None and positions_at is not None and region.attrs.get("inplace"):
        tensors[table_at] = distinct_written_pages(
            tensors[table_at], tensors[positions_at], region.attrs["page_size"],
            region.inputs[region.attrs.get("pool_input", 0)].concrete(dims)[0], example.seed,
            per_row=region.attrs.get("positions") == "per-row")
    return tensors


def distinct_written_pages(table: torch.Tensor, positions: torch.Tensor, page_size: int, num_pages: int,
                           seed: int, per_row: bool) -> torch.Tensor:
    """`table` with a page of its own for every entry a paged write uses: row b's entry for
    positions[b] // P (`per_row`: positions [B]) or every row's entries for the pages of all
    positions ([T], shared by the rows). A pool smaller than B x max_pages makes
    valid_page_table repeat pages across columns, and two rows writing one slot of one page would
    leave the in-place result to the order of the writes. Unchanged when the pool has fewer pages
    than the entries written.

        >>> table = torch.tensor([[0, 1], [1, 0]])  # rows share both pages
        >>> distinct_written_pages(table, torch.tensor([20, 3]), 16, 2, 0, per_row=True).tolist()
        [[0, 0], [1, 0]]

    (row 0 writes through entry [0, 1], page 0; row 1 through [1, 0], page 1)
    """
    batch = table.shape[0]
    columns = (positions.long() // page_size).tolist()
    if per_row:
        entries = sorted(set(enumerate(columns)))
    else:
        entries = sorted({(b, c) for b in range(batch) for c in columns})
    if len(entries) > num_pages:
        return table
    table = table.clone()
    pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    for page, (b, c) in zip(pages.tolist(), entries):
        table[b, c] = page
    return table


def rotary_tables(region: RegionSummary) -> tuple[int, ...]:
    """Indices of the cos inputs (each sin follows it) of the rotary tables a decode_attention
    region applies: the query's (attrs "rope") and a folded write's own K tables.

        >>> rotary_tables(RegionSummary("r", "decode_attention", (), (), {"rope": True, "page_size": 16}))
        (5,)
        >>> rotary_tables(RegionSummary("r", "decode_attention", (), (), {"rope": True,
        ...     "kv_write": {"positions_input": 6, "rope": True, "rope_tables_input": 9}}))
        (4, 9)
    """
    return tuple(sorted({i for i in (rope_at(region), kv_write_rope(region)) if i is not None}))


def scale_inputs(region: RegionSummary) -> tuple[int, ...]:
    """Indices of the fp8 scale inputs (fp32, positive) the region's schema names.

    k_scale, v_scale: inputs 4, 5 of a decode_attention / attention over an fp8 cache (attrs
    "kv_scale"), after the page table of a paged one (attrs "page_size") and the query's cos,
    sin of one with "rope"; of a quantizing kv_write (attrs "quant" not "none") the two after
    k, v and, with "rope", cos, sin (coopt/ir/region.py).

        >>> from coopt.ir.region import TensorSpec
        >>> kv = TensorSpec((1, 2, 8, 16), "float8_e4m3fn")
        >>> scale_inputs(RegionSummary("r", "decode_attention", (), (), {"kv_scale": "per-head"}))
        (4, 5)
        >>> scale_inputs(RegionSummary("r", "decode_attention", (), (), {"kv_scale": "per-head", "page_size": 16}))
        (5, 6)
        >>> scale_inputs(RegionSummary("w", "kv_write", (), (), {"rope": True, "quant": "per-token"}))
        (7, 8)
        >>> scale_inputs(RegionSummary("w", "kv_write", (), (), {"rope": True, "quant": "per-head", "values_only": True}))
        (7,)
    """
    if region.attrs.get("kv_scale") is not None:
        first = 4 + (region.attrs.get("page_size") is not None) + 2 * bool(region.attrs.get("rope"))
        return (first, first + 1)
    if region.family == "kv_write" and region.attrs.get("quant", "none") != "none":
        first = 7 if region.attrs.get("rope") else 5
        # values-only: V's scale alone (the keys stay in their dtype)
        return (first,) if region.attrs.get("values_only") else (first, first + 1)
    return ()


def _fp8_spread(region: RegionSummary) -> float:
    """The standard deviation of the region's fp8 inputs (e4m3 unless it has only e5m2)."""
    fp8 = [torch_dtype(s.dtype) for s in region.inputs if torch_dtype(s.dtype).is_floating_point
           and torch_dtype(s.dtype).itemsize == 1]
    return torch.finfo(fp8[0] if fp8 else torch.float8_e4m3fn).max / _FP8_SPREAD_DIVISOR


def fp8_values(shape, dtype: torch.dtype, generator: torch.Generator, device) -> torch.Tensor:
    """fp8 values as a quantizer writes them: N(0, 1) * max / 4, some exactly +-max, in half the
    draws (rank >= 3) one all-zero slice [i, j] (a cache's head j of sequence i); never NaN.
    Drawn in fp32 and cast (the cast from within the range is exact enough and never NaN)."""
    limit = torch.finfo(dtype).max
    values = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    values = (values * (limit / _FP8_SPREAD_DIVISOR)).clamp(-limit, limit)
    flat = values.view(-1)
    if flat.numel() == 0:
        return values.to(dtype)
    count = max(1, flat.numel() // _FP8_OUTLIER_EVERY)
    where = torch.randint(0, flat.numel(), (count,), generator=generator, device=device)
    signs = torch.randint(0, 2, (count,), generator=generator, device=device) * 2 - 1
    flat[where] = signs.to(torch.float32) * limit
    if len(shape) >= 3:
        coin, i, j = (int(torch.randint(0, n, (1,), generator=generator, device=device))
                      for n in (2, shape[0], shape[1]))
        if coin:
            values[i, j] = 0.0
    return values.to(dtype)


# Tile sizes whose boundaries (a multiple, one before, one after) lengths should hit.
_LENGTH_BLOCKS = (16, 32, 64, 128)


def valid_lengths(shape, max_length: int, seed: int) -> torch.Tensor:
    """int64 lengths in [1, max_length], each element independently one of: 1, max_length, a
    tile boundary (the first, the last or any multiple of 16/32/64/128 in range, or one off
    it) or uniform; so a batch mixes lengths.

    Drawn on the CPU from their own generator (a few values): the same on every machine, and
    independent of how many floating values the other inputs took.

        >>> valid_lengths((6,), 40, seed=3).tolist()
        [31, 1, 40, 20, 1, 1]
    """
    max_length = max(1, int(max_length))
    generator = torch.Generator().manual_seed(seed)
    count = _numel(tuple(shape))
    kind = torch.randint(0, 4, (count,), generator=generator).tolist()
    uniform = torch.randint(1, max_length + 1, (count,), generator=generator).tolist()
    block = torch.randint(0, len(_LENGTH_BLOCKS), (count,), generator=generator).tolist()
    multiple = torch.randint(0, 3, (count,), generator=generator).tolist()
    offset = torch.randint(-1, 2, (count,), generator=generator).tolist()
    lengths = []
    for i in range(count):
        size = _LENGTH_BLOCKS[block[i]]
        boundary = size * max(1, (1, max_length // size, uniform[i] // size)[multiple[i]]) + offset[i]
        lengths.append((1, max_length, boundary, uniform[i])[kind[i]])
    return torch.tensor(lengths, dtype=torch.int64).clamp(1, max_length).reshape(tuple(shape))


def _max_length(region: RegionSummary, dims: dict[str, int]) -> int:
    """The bound of a lengths input: the size of the dim `attrs["lengths_bound"]` names (paged:
    what the page table addresses, max_pages * page_size)."""
    table = region.attrs.get("page_table_input")
    if region.attrs.get("page_size") and table is not None:
        return region.inputs[table].concrete(dims)[1] * region.attrs["page_size"]
    return _bound_of(region, "lengths_bound", dims)


def valid_page_table(shape, num_pages: int, seed: int) -> torch.Tensor:
    """int64 page ids [B, max_pages] in [0, num_pages): a seeded permutation of the pool laid out
    column by column (entry [b, j] = perm[(j * B + b) % num_pages]), so that the rows of one
    column never share a page, and no two entries do while num_pages >= B * max_pages.

        >>> valid_page_table((2, 3), 8, seed=0).tolist()
        [[4, 7, 2], [0, 3, 5]]
    """
    batch, width = shape
    perm = torch.randperm(max(1, num_pages), generator=torch.Generator().manual_seed(seed))
    slots = (torch.arange(width)[None, :] * batch + torch.arange(batch)[:, None]) % max(1, num_pages)
    return perm[slots]


def valid_ring_slots(batch: int, num_slots: int, seed: int) -> torch.Tensor:
    """int64 [batch]: each row's exact-recent ring slot, distinct rows in distinct slots of
    [0, num_slots) (a seeded permutation's first entries; a caller gives each live sequence its
    own), so that no two rows write one ring.

        >>> valid_ring_slots(3, 8, seed=0).tolist()
        [4, 0, 7]
    """
    slots = max(1, num_slots)
    return torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[torch.arange(batch) % slots]


def _bound_of(region: RegionSummary, attr: str, dims: dict[str, int]) -> int:
    """The size of the dim `attrs[attr]` ([input, dim]) names."""
    bound = region.attrs.get(attr)
    if bound is None:
        raise ValueError(f"region {region.name}: '{attr.replace('bound', 'input')}' needs '{attr}' [input, dim]")
    tensor_index, dim_index = bound
    size = region.inputs[tensor_index].concrete(dims)[dim_index]
    if region.attrs.get("page_size") and tensor_index == region.attrs.get("page_table_input"):
        size *= region.attrs["page_size"]  # a page table's dim 1 counts pages: positions are P per page
    return size
