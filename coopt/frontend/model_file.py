"""Load a KernelBench-style model file: `Model`, `get_inputs()`, `get_init_inputs()`.

Optional hooks: `load_weights(model)` (real checkpoints), `dynamic_shapes()` (the
`dynamic_shapes` argument of torch.export: which input dims vary), `entry_points()` (more
ways to call the same model, built into the same artifact and sharing its weights and state:
`{"prefill": (example_inputs, dynamic_shapes or None)}` next to the decode step of get_inputs)
and `calibration_inputs()` (a list of input tuples of the main forward: what an fp8 KV cache's
calibrated scales are measured on, e.g. a decoder prefilling a prompt; default the example
inputs).
Every failure becomes a one-line ModelFileError (exit code 3) naming the file and the cause.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from coopt.errors import ModelFileError


@dataclass
class LoadedModel:
    path: Path
    module: ModuleType
    model: torch.nn.Module
    example_inputs: tuple
    dynamic_shapes: object | None
    # name -> (example inputs, dynamic_shapes or None): extra entry points (entry_points())
    entry_points: dict = field(default_factory=dict)
    calibration_inputs: list | None = None  # [input tuple, ...] (calibration_inputs()), or None


def _where(exc: BaseException, path: Path) -> str:
    """'model.py:12' for the deepest frame inside the model file, else ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    return f"{path.name}:{frames[-1].lineno}: " if frames else f"{path.name}: "


def import_model_file(path: str | Path) -> ModuleType:
    path = Path(path).resolve()
    if not path.is_file():
        raise ModelFileError(f"model file '{path}' not found")
    try:
        source = path.read_text()
        compile(source, str(path), "exec")
    except SyntaxError as exc:
        raise ModelFileError(f"{path.name}:{exc.lineno}: syntax error: {exc.msg}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"cannot read model file '{path}': {exc}") from exc
    name = f"coopt_user_model_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ModelFileError(f"{_where(exc, path)}importing the model file failed: {type(exc).__name__}: {exc}") from exc
    return module


def _call_hook(module: ModuleType, path: Path, hook: str, *args):
    try:
        return getattr(module, hook)(*args)
    except Exception as exc:
        raise ModelFileError(f"{_where(exc, path)}{hook}() failed: {type(exc).__name__}: {exc}") from exc


def load_model_file(path: str | Path, seed: int = 0) -> LoadedModel:
    """Import the file, construct `Model(*get_init_inputs())` in eval mode, get example inputs.

    The hooks run with torch's random generators seeded with `seed` (and the caller's generator
    states restored after), as KernelBench seeds before building a model: a file whose weights
    and example inputs are random builds the same artifact every time."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _load_model_file(Path(path).resolve())


def _load_model_file(path: Path) -> LoadedModel:
    module = import_model_file(path)
    if not isinstance(getattr(module, "Model", None), type):
        raise ModelFileError(f"{path.name} defines no class `Model` (KernelBench convention)")
    if not callable(getattr(module, "get_inputs", None)):
        raise ModelFileError(f"{path.name} defines no function `get_inputs()` returning example inputs")
    init_inputs = _call_hook(module, path, "get_init_inputs") if hasattr(module, "get_init_inputs") else []
    try:
        model = module.Model(*init_inputs)
    except Exception as exc:
        raise ModelFileError(f"{_where(exc, path)}Model(*get_init_inputs()) failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(f"{path.name}: Model(...) is not a torch.nn.Module")
    if hasattr(module, "load_weights"):
        _call_hook(module, path, "load_weights", model)
    model.eval()
    inputs = _call_hook(module, path, "get_inputs")
    if not isinstance(inputs, (list, tuple)):
        raise ModelFileError(f"{path.name}: get_inputs() must return a list or tuple, got {type(inputs).__name__}")
    dynamic = _call_hook(module, path, "dynamic_shapes") if hasattr(module, "dynamic_shapes") else None
    entries = _entry_points(_call_hook(module, path, "entry_points"), path) if hasattr(module, "entry_points") else {}
    calibration = _calibration_inputs(_call_hook(module, path, "calibration_inputs"), path) if hasattr(module, "calibration_inputs") else None
    return LoadedModel(path, module, model, tuple(inputs), dynamic, entries, calibration)


def _calibration_inputs(value, path: Path) -> list:
    """[input tuple, ...] from what calibration_inputs() returned."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, (list, tuple)) for v in value):
        raise ModelFileError(f"{path.name}: calibration_inputs() must return a non-empty list of input tuples "
                             f"(each what forward takes), got {type(value).__name__}")
    return [tuple(v) for v in value]


def _entry_points(value, path: Path) -> dict:
    """{name: (inputs tuple, dynamic_shapes or None)} from what entry_points() returned."""
    if not isinstance(value, dict):
        raise ModelFileError(f"{path.name}: entry_points() must return a dict name -> (inputs, dynamic_shapes), got {type(value).__name__}")
    entries = {}
    for name, spec in value.items():
        if not isinstance(name, str) or not name.isidentifier() or name == "forward":
            raise ModelFileError(f"{path.name}: entry_points(): {name!r} is not a usable entry name (an identifier other than 'forward')")
        inputs, dynamic = spec if isinstance(spec, tuple) and len(spec) == 2 else (spec, None)
        if not isinstance(inputs, (list, tuple)):
            raise ModelFileError(f"{path.name}: entry_points()[{name!r}] must be (inputs list, dynamic_shapes or None)")
        entries[name] = (tuple(inputs), dynamic)
    return entries
