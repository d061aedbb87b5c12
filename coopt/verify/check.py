"""One differential check: a candidate vs the region's reference on one `Example`.

Used by the Hypothesis search (runner.py) and by repro scripts (repro.py), so a repro applies
exactly the rule that failed the build.

    >>> example = Example((("n", 3),), seed=0, magnitude=1.0)
    >>> outcome = check_example(region, reference_module, candidate_module, example,
    ...                         "cpu")  # doctest: +SKIP
    >>> outcome.ok, outcome.failure  # doctest: +SKIP
    (True, None)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from coopt.ir.region import RegionSummary, kv_write_inputs
from coopt.runtime.kernel_loader import load_module_from_file
from coopt.verify.strategies import Example, distinct_written_pages, make_inputs
from coopt.verify.tolerances import compare, family_slack


@dataclass(frozen=True)
class ExampleOutcome:
    ok: bool
    max_abs_err: float
    max_rel_err: float
    failure: str | None = None  # one line, without the example's description


def check_example(
    region: RegionSummary,
    reference: ModuleType,
    candidate: ModuleType,
    example: Example,
    device: str | torch.device,
) -> ExampleOutcome:
    """Run reference (float64; native; native on the float32 inputs one ulp away and, where the
    candidate fails without them, on the bf16 / fp16 inputs one ulp of their dtype away in
    LOW_NUDGES draws) and candidate on the example's inputs and compare (verify/tolerances.py
    has the rule).

    An in-place region (attrs "inplace": a KV-cache write) writes its inputs: every run gets its
    own copies, and its outputs are the whole written buffers, so positions it must not touch
    are compared too."""
    inputs = example_inputs(region, example, device)
    with torch.inference_mode():
        try:
            ref_hi = run_upcast(reference, inputs, keep=_fp8_written(region))
        except Exception as error:  # noqa: BLE001 - a broken reference fails every candidate
            return _failed(f"reference raised {one_line(error)}")
        try:
            ref_native = _as_outputs(reference.run(*_clones(inputs)))
        except Exception:  # noqa: BLE001 - eager may lack a kernel (fp8): judge by the floor
            ref_native = None
        ref_near = _run_near(reference, inputs, example.seed) if ref_native is not None else None
        try:
            outputs = candidate.run(*_clones(inputs))
            _synchronize(device)  # GPU faults surface asynchronously: attribute them here
        except (Exception, SystemExit) as error:  # noqa: BLE001 - candidate errors are verdicts
            return _failed(f"candidate raised {one_line(error)}")
        outcome = _compare_outputs(region, example, outputs, ref_hi, ref_native, ref_near)
        if outcome.ok or ref_native is None:
            return outcome
        # only for a failing output: eager on the 16-bit inputs one ulp away (a bf16 GEMM's eager
        # runs are slow on a CPU; most candidates pass without them)
        ref_near_low = _runs_near_low(reference, inputs, example.seed)
    return _compare_outputs(region, example, outputs, ref_hi, ref_native, ref_near, ref_near_low) if ref_near_low else outcome


def example_inputs(region: RegionSummary, example: Example, device: str | torch.device) -> list[torch.Tensor]:
    """The inputs of one example as verification draws them (a cache write's positions distinct
    and inside the cache: cache_write_inputs); repro scripts and the probes in bench/ rebuild
    them with it."""
    return cache_write_inputs(region, make_inputs(region, example, device), example.seed)


SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def nudged(inputs: list[torch.Tensor], seed: int, dtypes=(torch.float32,)) -> list[torch.Tensor] | None:
    """Copies of `inputs` with every element of the given dtypes moved one ulp of its dtype up or
    down (a coin per element, from `seed`); None when no input has one of them. Other inputs are
    copied unchanged."""
    if not any(t.dtype in dtypes for t in inputs):
        return None
    generator = torch.Generator().manual_seed(seed)
    moved = []
    for t in _clones(inputs):
        if t.dtype in dtypes:
            up = torch.rand(t.shape, generator=generator) < 0.5
            inf = torch.tensor(float("inf"), dtype=t.dtype)
            t = torch.nextafter(t, torch.where(up, inf, -inf).to(t.device))
        moved.append(t)
    return moved


def _run_near(reference: ModuleType, inputs: list[torch.Tensor], seed: int,
              dtypes=(torch.float32,)) -> tuple[torch.Tensor, ...] | None:
    """The reference in native precision on the inputs of `dtypes` one ulp away (`nudged`), for
    the native test (verify/tolerances.py); None without such inputs or where it raises."""
    moved = nudged(inputs, seed, dtypes)
    if moved is None:
        return None
    try:
        return _as_outputs(reference.run(*moved))
    except Exception:  # noqa: BLE001 - judged by ref_native and the floor alone
        return None


# Draws of the 16-bit inputs one ulp away: each flips a near tie with some chance (one draw
# swapped session 19's two keys with probability ~1/2), so two.
LOW_NUDGES = 2


def _runs_near_low(reference: ModuleType, inputs: list[torch.Tensor], seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Eager on the bf16 / fp16 inputs one ulp of their dtype away, LOW_NUDGES draws (seeds
    apart from the float32 draw's); none without such inputs."""
    runs = (_run_near(reference, inputs, seed + 1 + n, SIXTEEN_BIT) for n in range(LOW_NUDGES))
    return [run for run in runs if run is not None]


def load_module(path: str | Path) -> ModuleType | str:
    """The candidate module at `path`, or a one-line reason it cannot be used."""
    try:
        module = load_module_from_file(path)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - a broken file is a verdict
        return f"failed to import: {one_line(error)}"
    if not callable(getattr(module, "run", None)):
        return f"{Path(path).name} defines no run()"
    return module


def run_upcast(reference: ModuleType, inputs: list[torch.Tensor], keep=frozenset()) -> tuple[torch.Tensor, ...]:
    """The reference on floating inputs upcast to float64 (float32 if float64 is unsupported);
    inputs at the indices in `keep` are copied as they are."""
    try:
        return _as_outputs(reference.run(*_upcast(inputs, torch.float64, keep)))
    except Exception:  # noqa: BLE001 - e.g. an op without a float64 kernel on this device
        return _as_outputs(reference.run(*_upcast(inputs, torch.float32, keep)))


def cache_write_inputs(region: RegionSummary, inputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """A kv_write region's positions (input 2; a decode attention's with the write folded in:
    attrs kv_write's positions_input) as a real step has them: distinct cache
    positions in [0, S_max), drawn from `seed` (random small integers could repeat a position,
    whose write order is unspecified, or leave the cache). A paged write's S_max is what its page
    table addresses (max_pages x P: positions cross pages), and every entry it then writes through
    gets a page of its own (`distinct_written_pages`). Other regions' inputs are returned as they
    are."""
    at = 2 if region.family == "kv_write" else kv_write_inputs(region)
    if at is None or len(inputs) <= at:
        return inputs
    size, table_at = region.attrs.get("page_size"), region.attrs.get("page_table_input")
    paged = bool(size) and table_at is not None
    cache = inputs[region.attrs["inplace"][0]]
    positions, s_max = inputs[at], inputs[table_at].shape[1] * size if paged else cache.shape[2]
    count = positions.numel()
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.randperm(s_max, generator=generator)[:count] if count <= s_max else torch.arange(count) % s_max
    inputs = [*inputs[:at], drawn.to(positions.dtype).to(positions.device).reshape(positions.shape), *inputs[at + 1:]]
    if paged:
        pages = inputs[region.attrs.get("pool_input", 0)].shape[0]
        table = distinct_written_pages(inputs[table_at].cpu(), inputs[at].cpu(), size, pages, seed,
                                       per_row=region.attrs.get("positions") == "per-row")
        inputs[table_at] = table.to(inputs[table_at].dtype).to(inputs[table_at].device)
    return inputs


def _fp8_written(region: RegionSummary) -> frozenset[int]:
    """Written fp8 buffers stay fp8 in the float64 reference run: the value written into them
    is quantized to fp8 there too, and index_put_ wants both of one dtype."""
    return frozenset(i for i in region.attrs.get("inplace", ()) if i < len(region.inputs)
                     and region.inputs[i].dtype.startswith("float8"))


def _compare_outputs(region, example, outputs, ref_hi, ref_native, ref_near=None, ref_near_low=()) -> ExampleOutcome:
    if not isinstance(outputs, (tuple, list)):
        return _failed(f"run() returned {type(outputs).__name__}, expected a tuple of tensors")
    if len(outputs) != len(region.outputs):
        return _failed(f"run() returned {len(outputs)} outputs, expected {len(region.outputs)}")
    if len(ref_hi) != len(region.outputs):
        return _failed(f"reference returned {len(ref_hi)} outputs, expected {len(region.outputs)}")
    dims = example.dim_values()
    max_abs = max_rel = 0.0
    for i, spec in enumerate(region.outputs):
        output = outputs[i]
        if isinstance(output, torch.Tensor) and output.device.type != ref_hi[i].device.type:
            return _failed(f"output {i}: on {output.device.type}, expected "
                           f"{ref_hi[i].device.type}")
        native = ref_native[i] if ref_native is not None and len(ref_native) > i else None
        near = ref_near[i] if ref_near is not None and len(ref_near) > i else None
        near_low = tuple(run[i] for run in ref_near_low if len(run) > i)
        verdict = compare(output, ref_hi[i], native, dtype=spec.dtype, shape=spec.concrete(dims),
                          slack=family_slack(region.family, spec.dtype), ref_near=near, ref_near_low=near_low)
        max_abs = _nanmax(max_abs, verdict.max_abs_err)
        max_rel = _nanmax(max_rel, verdict.max_rel_err)
        if not verdict.ok:
            return ExampleOutcome(False, max_abs, max_rel, f"output {i}: {verdict.reason}")
    return ExampleOutcome(True, max_abs, max_rel)


def _upcast(inputs, dtype: torch.dtype, keep=frozenset()) -> list[torch.Tensor]:
    return [t.to(dtype, copy=True) if t.is_floating_point() and i not in keep else t.clone() for i, t in enumerate(inputs)]


def _clones(inputs) -> list[torch.Tensor]:
    # Each module gets its own copies: an in-place candidate must not corrupt the reference's.
    return [_clone_keeping_layout(t) for t in inputs]


def _clone_keeping_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy with `t`'s own strides: a stride-0 expand (decode lengths) stays one, where
    `clone()` would hand the kernel a contiguous tensor and hide how it reads the real one."""
    if t.is_contiguous():
        return t.clone()
    elements = t.untyped_storage().nbytes() // t.element_size()
    storage = torch.as_strided(t, (elements,), (1,), 0).clone()
    return storage.as_strided(t.size(), t.stride(), t.storage_offset())


def _as_outputs(result) -> tuple:
    if isinstance(result, torch.Tensor):
        return (result,)
    return tuple(result)


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _nanmax(a: float, b: float) -> float:
    return b if b > a else a  # a NaN b (no measurement) never wins


def one_line(error: BaseException, limit: int = 300) -> str:
    """'ValueError: first line of the message' (at most `limit` characters)."""
    message = str(error).strip().splitlines()
    text = type(error).__name__ + (f": {message[0]}" if message else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failed(failure: str) -> ExampleOutcome:
    nan = float("nan")
    return ExampleOutcome(False, nan, nan, failure)
