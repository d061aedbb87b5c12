"""`verify_end_to_end`: the whole built model against the original, on fresh random inputs.

Per trial, inputs of the example inputs' shapes (trial 0), or with the dynamic dims at their
minimum (trial 1) or at random sizes up to the example's (later trials), are drawn afresh:
floating inputs ~ N(mean, std) of the corresponding example input, integer inputs uniform in
the example's [min, max] (token ids stay in the vocabulary), bool inputs a fair coin. Non-tensor
inputs are passed through.

References, as in tolerances.py: `ref_hi` is a float64 deep copy of the original module run on
upcast inputs (where a whole copy would not fit in the device's free memory, the module itself
run with each submodule's tensors cast as it runs: `reference_copy`, StreamedCopy); `ref_native`
the original itself. When the module cannot be copied or run at that precision, ref_hi falls back to the native outputs (the rule then reduces to the floor
around eager). Every tensor leaf of the (nested tuple/list/dict) output is compared with `compare` at
the dtype of the original's output; non-tensor leaves must be equal.

A lossy build (fp8 KV cache) checks its kernels against its reference program (the transform on
ATen ops at the build's dtype) as `original_module`, with `high_model` the float64 copy of the
unquantized model: both programs approximate that function, and quantization decides a value
near a rounding boundary either way (a kernel's one-ulp difference upstream moves it by an fp8
ulp), so a float64 copy of the reference program, which quantizes its own float64 values, is no
closer to either; the kernels may be NATIVE_FACTOR times less accurate than the reference
program, as any kernel against eager. `errors_from="original"` then reports the errors as the
distance from the reference program.

    >>> result = verify_end_to_end(model, built, (torch.randn(2, 16),), trials=3)  # doctest: +SKIP
    >>> result.ok  # doctest: +SKIP
    True
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping, Sequence

import torch

from coopt.verify.check import one_line
from coopt.verify.result import VerifyResult
from coopt.verify.tolerances import compare


def verify_end_to_end(
    original_module: torch.nn.Module,
    built_module,
    example_inputs: Sequence,
    *,
    dynamic_shapes: Sequence[Mapping[int, object] | None] | None = None,
    trials: int = 3,
    seed: int = 0,
    high_reference: bool = True,
    high_model: torch.nn.Module | None = None,
    errors_from: str = "high",
) -> VerifyResult:
    """Compare `built_module(*inputs)` with `original_module(*inputs)` over `trials` trials.

    `dynamic_shapes` (optional) is aligned with `example_inputs`, in torch.export's form: per
    input None or {dim_index: torch.export.Dim(name, min=, max=)} (or a (name, min, max)
    tuple); dims sharing a name get the same size. Modules and inputs stay on their device.
    `high_reference=False` skips the high-precision copy (float64 takes 4x the memory of bf16);
    `high_model` is one made beforehand by `reference_copy` (repeated checks, as bisection runs,
    then copy the model once; the caller restores its state between checks), or for a lossy
    build the unquantized model's (module docstring). `errors_from` says what the reported
    max_abs_err / max_rel_err measure from: the high-precision reference ("high") or
    `original_module`'s own outputs ("original"); the verdict is the same.
    """
    if errors_from not in ("high", "original"):
        raise ValueError(f"errors_from={errors_from!r}: 'high' or 'original'")
    if high_model is not None:
        hi_model = high_model
    else:
        hi_model = reference_copy(original_module)[0] if high_reference else None
    sizes_rng = random.Random(seed)
    max_abs = max_rel = 0.0
    for trial in range(trials):
        sizes = _trial_sizes(example_inputs, dynamic_shapes, trial, sizes_rng)
        generator = torch.Generator().manual_seed(seed * 1000 + trial)
        inputs = [_fresh_like(x, sizes.get(i), generator) for i, x in enumerate(example_inputs)]
        where = f"trial {trial}, input shapes {_shapes(inputs)}"
        with torch.inference_mode():
            # the reference first: a streamed one (StreamedCopy) reads the original's state, which
            # the original's own call then writes
            hi = _run_high(hi_model, inputs)
            native = original_module(*_clones(inputs))
            try:
                built = built_module(*_clones(inputs))
            except torch.OutOfMemoryError:
                raise  # the device's memory, not the kernels: no verdict (bisection would blame them)
            except Exception as error:  # noqa: BLE001 - a failing build is a verdict
                return VerifyResult.failed(f"built model raised {one_line(error)} [{where}]",
                                           trial + 1)
        hi_leaves = _leaves(hi) if hi is not None else None
        native_leaves, built_leaves = _leaves(native), _leaves(built)
        if [p for p, _ in built_leaves] != [p for p, _ in native_leaves]:
            return VerifyResult.failed(
                f"output structure {[p for p, _ in built_leaves]} differs from the original's "
                f"{[p for p, _ in native_leaves]} [{where}]", trial + 1)
        for i, ((path, native_leaf), (_, built_leaf)) in enumerate(
                zip(native_leaves, built_leaves)):
            hi_leaf = hi_leaves[i][1] if hi_leaves and len(hi_leaves) > i else None
            reason, abs_err, rel_err = _compare_leaf(native_leaf, built_leaf, hi_leaf)
            if errors_from == "original":
                abs_err, rel_err = _distance(built_leaf, native_leaf, (abs_err, rel_err))
            max_abs = abs_err if abs_err > max_abs else max_abs
            max_rel = rel_err if rel_err > max_rel else max_rel
            if reason is not None:
                return VerifyResult(False, trial + 1, max_abs, max_rel,
                                    f"{path}: {reason} [{where}]")
    return VerifyResult(True, trials, max_abs, max_rel)


def _compare_leaf(native, built, hi) -> tuple[str | None, float, float]:
    if not isinstance(native, torch.Tensor):
        same = built == native
        return (None if same else f"{built!r} != {native!r}"), 0.0, 0.0
    dtype, shape = native.dtype, tuple(native.shape)
    if hi is None or not isinstance(hi, torch.Tensor) or tuple(hi.shape) != shape:
        hi, native = native, None  # no high-precision reference: judge by the floor around eager
    verdict = compare(built, hi.double(), native, dtype=dtype, shape=shape)
    return verdict.reason, verdict.max_abs_err, verdict.max_rel_err


def _distance(built, native, otherwise: tuple[float, float]) -> tuple[float, float]:
    """(max |built - native|, that over max |native|) of a floating leaf of the same shape, else
    `otherwise`."""
    if not (isinstance(native, torch.Tensor) and native.is_floating_point() and native.numel()
            and isinstance(built, torch.Tensor) and built.shape == native.shape):
        return otherwise
    error = float((built.double() - native.double()).abs().max())
    return error, error / max(float(native.double().abs().max()), torch.finfo(native.dtype).tiny)


# A high-precision copy may take at most this share of its device's free memory: a decode step
# built for many rows holds KV caches of tens of GB, whose float64 copy ran an H200 out of memory
# in the middle of a build (session 8: 96 rows x 4096 positions x 8 Llama-3-8B layers, 62 GB).
# The rest is for the copy's forward pass: a GQA attention in eager expands the cache per query
# head, transients up to half the copy's size. The share is of what is free once the build is
# loaded beside it (its weights and state as large as the module's own): 32 Llama-3-8B layers
# at 32 rows x 4096 positions (32 GB native) took a float32 copy (64 GB) of 107 GB free, and the
# build's load then ran the H200 out of memory (session 9).
# Where no whole copy fits, the reference is streamed (StreamedCopy): only one submodule's tensors
# are cast at a time (32 Llama-3-8B layers at 32 rows x 4096 positions: a float32 copy did not fit
# beside the build, and the bf16 floor alone rejected the build, session 10).
COPY_SHARE = 0.5
STREAMED = "streamed module by module"


class StreamedCopy:
    """`module` run at `dtype` without a whole copy: for the length of each submodule's forward its
    own floating parameters and buffers are replaced by `dtype` casts (a forward pre-hook), then
    put back (a forward hook), so the peak is one submodule's cast tensors. Writes into the cast
    buffers (a KV cache's new rows) are dropped with them: the module's state is never changed.
    So a call reads the module's state as it is: run it before the module's own call of a trial
    (verify_end_to_end does), and it reads what a deep copy would hold, except rows that earlier
    calls wrote, which it reads at the module's precision. Tensors a module reads from another
    (a tied weight used outside its owner's forward) meet the dtypes mixed: the call raises and
    the check falls back to the floor around eager (_run_high)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.module, self.dtype = module, dtype

    def __call__(self, *inputs):
        saved: dict[torch.nn.Module, list] = {}

        def cast_in(module, args):
            saved.setdefault(module, []).append((dict(module._parameters), dict(module._buffers)))
            for store in (module._parameters, module._buffers):
                store.update({name: t.detach().to(self.dtype) for name, t in store.items()
                              if t is not None and t.is_floating_point()})

        def put_back(module, *_):
            parameters, buffers = saved[module].pop()
            module._parameters.update(parameters)
            module._buffers.update(buffers)

        owners = [m for m in self.module.modules() if any(t.is_floating_point() for t in _own_tensors(m))]
        handles = [hook for m in owners
                   for hook in (m.register_forward_pre_hook(cast_in), m.register_forward_hook(put_back))]
        try:
            return self.module(*inputs)
        finally:
            for handle in handles:
                handle.remove()
            for module, stack in saved.items():  # a forward that raised skipped its put_back
                while stack:
                    put_back(module)


def reference_copy(module) -> tuple[torch.nn.Module | StreamedCopy | None, str]:
    """(the high-precision reference of `module`, what it is): a float64 deep copy where it fits in
    COPY_SHARE of the device's free memory; else a float64 StreamedCopy, or a float32 one, where one
    submodule's cast tensors fit; else None (native outputs judge: the floor around eager), also
    when the module cannot be copied. Free memory counts less what the build that is checked will
    take when loaded (the module's own bytes)."""
    free = _free_bytes(module)
    if free is not None:
        free = max(0, free - native_bytes(module))
    if free is None or _copy_bytes(module, torch.float64) <= COPY_SHARE * free:
        try:
            return _converted_copy(module, torch.float64), "float64"
        except torch.OutOfMemoryError:
            pass  # the estimate missed (fragmentation): stream instead
        except Exception as error:  # noqa: BLE001 - uncopyable module: fall back to native outputs
            return None, f"none: the model cannot be copied ({one_line(error)})"
    if _plain(module):  # a module that casts by its own rules (fp8 caches) is never cast piecewise
        for dtype in (torch.float64, torch.float32):
            if free is None or _streamed_bytes(module, dtype) <= COPY_SHARE * free:
                return StreamedCopy(module, dtype), f"{str(dtype).removeprefix('torch.')}, {STREAMED}"
    return None, (f"none: even one submodule's float32 copy needs {_streamed_bytes(module, torch.float32) / 2**30:.1f} "
                  f"GiB, more than {COPY_SHARE:.0%} of the {free / 2**30:.1f} GiB free beside the loaded build")


def _tensors(module):
    return [*module.parameters(), *module.buffers()]


def _own_tensors(module) -> list[torch.Tensor]:
    """The parameters and buffers `module` holds itself (not its submodules')."""
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def _streamed_bytes(module, dtype: torch.dtype) -> int:
    """What a StreamedCopy at `dtype` holds at once: the largest submodule's own floating tensors."""
    return max(sum(t.numel() * dtype.itemsize for t in _own_tensors(m) if t.is_floating_point())
               for m in module.modules())


def _free_bytes(module) -> int | None:
    """Free memory of the CUDA device `module` lives on (what its caching allocator holds unused
    counts as free), or None off CUDA (no limit checked)."""
    tensor = next(iter(_tensors(module)), None)
    if tensor is None or tensor.device.type != "cuda":
        return None
    return device_free_bytes(tensor.device)


def device_free_bytes(device) -> int:
    """Free memory of a CUDA device, counting what its caching allocator holds unused as free."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def native_bytes(module) -> int:
    """Bytes of the module's parameters and buffers as they are (about what its build loads)."""
    return sum(t.numel() * t.element_size() for t in _tensors(module))


def _plain(module) -> bool:
    """Whether a dtype cast of `module` converts every floating tensor (no module overrides
    _apply, as a built program does to keep its fp8 caches fp8)."""
    return all(type(m)._apply is torch.nn.Module._apply for m in module.modules())


def _copy_bytes(module, dtype: torch.dtype) -> int:
    """Bytes a `dtype` copy of `module` allocates at its peak (a module that casts by its own rules
    is deep-copied first, then cast)."""
    converted = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
                    for t in _tensors(module))
    return converted if _plain(module) else converted + native_bytes(module)


def _converted_copy(module, dtype: torch.dtype):
    """A deep copy of `module` cast to `dtype`. A plain module's tensors are converted as they are
    copied (the memo hands deepcopy the converted tensors), so no copy at the model's own dtype
    is ever held beside the converted one; others are copied, then cast by their own `.to`."""
    if not _plain(module):
        return copy.deepcopy(module).to(dtype)

    def converted(tensor):
        if not tensor.is_floating_point():
            return tensor.detach().clone()
        return tensor.detach().to(dtype, copy=True)

    memo = {}
    for tensor in _tensors(module):
        if id(tensor) not in memo:
            value = converted(tensor)
            memo[id(tensor)] = (torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
                                if isinstance(tensor, torch.nn.Parameter) else value)
    return copy.deepcopy(module, memo)


def _run_high(hi_model, inputs):
    if hi_model is None:
        return None
    # the copy's precision: its widest floating dtype (a built program's copy keeps fp8 caches)
    dtype = hi_model.dtype if isinstance(hi_model, StreamedCopy) else max(
        (t.dtype for t in _tensors(hi_model) if t.is_floating_point()), key=lambda d: d.itemsize, default=torch.float64)
    upcast = [x.to(dtype) if _is_float_tensor(x) else _clone(x) for x in inputs]
    try:
        return hi_model(*upcast)
    except torch.OutOfMemoryError:
        raise  # not a dtype the op lacks: judged by the floor alone a deep model fails, and bisection blames kernels
    except Exception:  # noqa: BLE001 - e.g. a dtype-specific op: fall back to native outputs
        return None


def _trial_sizes(example_inputs, dynamic_shapes, trial: int, rng: random.Random):
    """{input index: {dim index: size}} for this trial; trial 0 keeps the example shapes."""
    if not dynamic_shapes or trial == 0:
        return {}
    chosen: dict[str, int] = {}
    sizes: dict[int, dict[int, int]] = {}
    for i, spec in enumerate(dynamic_shapes):
        if not spec or not isinstance(example_inputs[i], torch.Tensor):
            continue
        for dim_index, dim in spec.items():
            name, lo, hi = _dim_bounds(dim)
            if name is None:
                continue  # Dim.AUTO / Dim.STATIC style markers: keep the example's size
            example_size = example_inputs[i].shape[dim_index]
            lo = max(lo, 1)
            hi = max(lo, min(hi, example_size))  # never larger than the example: cost bound
            if name not in chosen:
                chosen[name] = lo if trial == 1 else rng.randint(lo, hi)
            sizes.setdefault(i, {})[dim_index] = chosen[name]
    return sizes


def _dim_bounds(dim) -> tuple[str | None, int, int]:
    if isinstance(dim, tuple):
        name, lo, hi = dim
        return name, int(lo), int(hi)
    name = getattr(dim, "__name__", None)
    lo, hi = getattr(dim, "min", None), getattr(dim, "max", None)
    if name is None or lo is None or hi is None:
        return None, 0, 0
    try:
        return name, int(lo), int(hi)
    except (TypeError, OverflowError, ValueError):  # unbounded max (int_oo)
        return name, int(lo), 2**31


def _fresh_like(example, sizes: dict[int, int] | None, generator: torch.Generator):
    if not isinstance(example, torch.Tensor):
        return example
    shape = list(example.shape)
    for dim_index, size in (sizes or {}).items():
        shape[dim_index] = size
    if example.is_floating_point():
        stats = example.detach().double()
        mean = float(stats.mean()) if stats.numel() else 0.0
        std = float(stats.std()) if stats.numel() > 1 else 1.0
        std = std if std == std and std > 0 else 1.0
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * std + mean
        return values.to(example.dtype).to(example.device)
    if example.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool().to(example.device)
    return _integers_like(example, shape, generator).to(example.dtype).to(example.device)


def _integers_like(example: torch.Tensor, shape: list[int], generator: torch.Generator) -> torch.Tensor:
    """Integers in the example's range [min, max], keeping two of its properties a model may rely
    on: distinct values stay distinct (drawn without replacement; the range widened upwards where
    a larger dynamic size needs more values) and ascending ones ascend. Positions are why: a
    prompt's positions arange(T) drawn with repeats would make its cache write an index_put with
    duplicate indices, whose winner is undefined on a GPU (eager, its float64 copy and the build
    then each keep another row, and the check judges noise)."""
    flat = example.detach().flatten().to(torch.int64).cpu()
    lo = int(flat.min()) if flat.numel() else 0
    hi = int(flat.max()) if flat.numel() else 1
    count = math.prod(shape)
    if flat.numel() < 2 or int(flat.unique().numel()) < flat.numel():
        return torch.randint(lo, hi + 1, shape, generator=generator, dtype=torch.int64)
    hi = max(hi, lo + count - 1)
    values = lo + torch.randperm(hi - lo + 1, generator=generator)[:count]
    if bool((flat[1:] > flat[:-1]).all()):
        values = values.sort().values
    return values.reshape(shape)


def _leaves(value, path: str = "output") -> list[tuple[str, object]]:
    """(path, leaf) for every leaf of nested tuples/lists/dicts, in order."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, Mapping):
        return [leaf for key, item in value.items() for leaf in _leaves(item, f"{path}[{key!r}]")]
    if isinstance(value, (tuple, list)):
        return [leaf for i, item in enumerate(value) for leaf in _leaves(item, f"{path}[{i}]")]
    return [(path, value)]


def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def _clones(inputs):
    return [_clone(x) for x in inputs]


def _shapes(inputs) -> list:
    return [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in inputs]


def measure_end_to_end(original_module: torch.nn.Module, built_module, example_inputs: Sequence, *, trials: int = 3,
                       seed: int = 0) -> dict:
    """The accuracy cost of a lossy build (fp8 KV cache): the built model against the original
    on the same fresh inputs as `verify_end_to_end`, measured rather than judged.

    Returns {"trials", "max_abs_err", "max_rel_err", "finite"}: the largest |built - original|
    over every floating output element, that error relative to the largest |original| of the
    same output (an error of 1% of the logits' range reads 0.01 whatever their scale), and
    whether every built output was finite.
    """
    max_abs = max_rel = 0.0
    finite = True
    for trial in range(trials):
        generator = torch.Generator().manual_seed(seed * 1000 + trial)
        inputs = [_fresh_like(x, None, generator) for x in example_inputs]
        with torch.inference_mode():
            native = original_module(*_clones(inputs))
            built = built_module(*_clones(inputs))
        for (_, want), (_, got) in zip(_leaves(native), _leaves(built)):
            if not (isinstance(want, torch.Tensor) and want.is_floating_point()) or want.numel() == 0:
                continue
            got, want = got.double(), want.double()
            finite = finite and bool(torch.isfinite(got).all())
            error = float((got - want).abs().max())
            max_abs = max(max_abs, error)
            max_rel = max(max_rel, error / max(float(want.abs().max()), 1e-30))
    return {"trials": trials, "max_abs_err": max_abs, "max_rel_err": max_rel, "finite": finite}
