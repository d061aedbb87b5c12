"""Import a generated kernel module from a file, in Triton's interpreter when there is no GPU."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


def use_interpreter_without_gpu() -> bool:
    """Set TRITON_INTERPRET=1 when no CUDA device is present; must run before kernels are defined.

    `triton.jit` reads the variable when a kernel is decorated, so this is called before any
    generated module is imported. Returns whether the interpreter is in use.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET") == "1"


def load_module_from_file(path: str | Path, name: str | None = None) -> ModuleType:
    """Import `path` as a fresh module (unique name per path+content, so re-renders reload)."""
    path = Path(path)
    use_interpreter_without_gpu()
    digest = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
    name = name or f"coopt_generated_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a later load must retry and report the real error
        raise
    return module


def load_module_from_source(source: str, directory: str | Path, stem: str) -> ModuleType:
    """Write `source` to `directory/stem.py` and import it (Triton needs real files for inspect)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}.py"
    path.write_text(source)
    return load_module_from_file(path)
