"""Random inputs for timing a region: deterministic, the region's dtypes, on the timing device.

Values are standard normal, never zeros: zeros can run faster than real data and hide wrong
indexing (METHOD.md saw a bf16 matmul 13% faster on zeros). Several independent input sets can be
made so repeated runs rotate through buffers instead of re-reading L2-resident data.
"""

from __future__ import annotations

import re

from coopt.ir.region import DTYPE_BYTES, RegionSummary, kv_write_inputs, lengths_offset

# Rotation: at most this many input sets, and together at most this many bytes. do_bench already
# flushes L2 between runs on a GPU, so rotation is a second line of defence, not worth GBs.
MAX_INPUT_SETS = 4
ROTATION_BUDGET_BYTES = 512 * 2**20

# Integer inputs (indices, positions) get small non-negative values; the four current families
# have none, and a family that needs a valid index range should bring its own generator.
_INT_HIGH = 8

_SYMBOL = re.compile(r"[A-Za-z_]\w*")


def resolve_dims(region: RegionSummary, dims: dict[str, int] | None = None) -> dict[str, int]:
    """The region's example dims overridden by `dims`; raises ValueError if a symbolic dim lacks one.

    >>> from coopt.ir.region import TensorSpec
    >>> r = RegionSummary("r", "elementwise", (TensorSpec(("B", 8), "float32"),), (), example_dims={"B": 2})
    >>> resolve_dims(r, {"B": 4})
    {'B': 4}
    """
    resolved = {**region.example_dims, **(dims or {})}
    # A str dim is a symbol ("s0") or an expression of symbols ("4*s0"): collect the symbols.
    symbolic = {
        symbol
        for spec in (*region.inputs, *region.outputs)
        for d in spec.shape
        if isinstance(d, str)
        for symbol in _SYMBOL.findall(d)
    }
    missing = sorted(symbolic - resolved.keys())
    if missing:
        raise ValueError(f"region {region.name}: no value for symbolic dims {missing}")
    return {name: int(value) for name, value in resolved.items()}


def input_bytes(region: RegionSummary, dims: dict[str, int]) -> int:
    """Bytes of one input set at `dims`."""
    total = 0
    for spec in region.inputs:
        n = 1
        for d in spec.concrete(dims):
            n *= d
        total += n * DTYPE_BYTES.get(spec.dtype, 4)
    return total


def rotation_count(region: RegionSummary, dims: dict[str, int]) -> int:
    """How many input sets to rotate through: up to MAX_INPUT_SETS within ROTATION_BUDGET_BYTES."""
    one_set = max(1, input_bytes(region, dims))
    return max(1, min(MAX_INPUT_SETS, ROTATION_BUDGET_BYTES // one_set))


def make_inputs(region: RegionSummary, dims: dict[str, int], *, device: str = "cpu", seed: int = 0) -> list:
    """One input set (a list of tensors in `region.inputs` order), the same for the same seed."""
    import torch

    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    tensors = []
    lengths_input = region.attrs.get("lengths_input")
    for index, spec in enumerate(region.inputs):
        shape = spec.concrete(dims)
        dtype = getattr(torch, spec.dtype)
        if index == lengths_input:
            # valid lengths, not random small integers: time the length the region plans for
            # (attrs example_length), else the whole cache (lengths_bound names its dim); for a
            # prompt over the cache, the lengths of a prompt written from position 0
            source, dim = region.attrs["lengths_bound"]
            bound = region.inputs[source].concrete(dims)[dim]
            if region.family == "attention":  # one length per query: a prompt from position 0
                tensor = torch.arange(1, shape[0] + 1, device=device).clamp(max=bound).to(dtype)
            else:
                length = region.attrs.get("example_length", bound)
                tensor = torch.full(shape, length - lengths_offset(region), dtype=dtype, device=device)
        elif index == kv_write_inputs(region):
            # the write folded into a decode attention: the step's position, the last key it attends
            source, dim = region.attrs["lengths_bound"]
            length = region.attrs.get("example_length", region.inputs[source].concrete(dims)[dim])
            tensor = torch.full(shape, length - 1, dtype=dtype, device=device)
        elif region.family == "kv_write" and index == 2:
            # a step's cache positions: distinct and inside the cache (a prompt written from 0)
            tensor = (torch.arange(shape[0], device=device) % region.inputs[0].concrete(dims)[2]).to(dtype)
        elif index == region.attrs.get("index_input"):
            # rows of a table (embedding_rows' token ids): any row of it, as a step's tokens are
            source, dim = region.attrs["index_bound"]
            bound = region.inputs[source].concrete(dims)[dim]
            tensor = torch.randint(0, bound, shape, generator=generator, device=device, dtype=dtype)
        elif dtype == torch.bool:
            tensor = torch.randint(0, 2, shape, generator=generator, device=device).to(torch.bool)
        elif not dtype.is_floating_point:
            tensor = torch.randint(0, _INT_HIGH, shape, generator=generator, device=device, dtype=dtype)
        else:
            # fp8 has no randn kernel: draw in fp32 and cast, which also keeps the values the same
            # distribution for every float dtype.
            tensor = torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
        tensors.append(tensor)
    return tensors


def make_input_sets(
    region: RegionSummary, dims: dict[str, int], n_sets: int, *, device: str = "cpu", seed: int = 0
) -> list[list]:
    """`n_sets` independent input sets (seeds seed, seed+1, ...) for rotation between timed runs."""
    return [make_inputs(region, dims, device=device, seed=seed + i) for i in range(n_sets)]

