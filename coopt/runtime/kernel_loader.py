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
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreting:
        _interpret_helpers_decorated_before()
    return interpreting


def _interpret_helpers_decorated_before() -> None:
    """Make triton.language's own jit helpers (tl.cdiv, tl.sigmoid, ...) callable in the interpreter
    when triton was imported before the interpreter was switched on.

    `triton.jit` picks compiled or interpreted when it decorates, and triton.language decorates
    its helpers at import: imported earlier (transformers imports triton; so does a strict
    torch.export, through TorchDynamo) they are compiled-mode JITFunctions, and a kernel run in
    the interpreter fails on its first tl.cdiv with "Cannot call @triton.jit'd outside of the
    scope of a kernel" (measured). Each is swapped for an interpreted function of the same body;
    helpers decorated after the switch are interpreted already."""
    loaded = [m for name, m in list(sys.modules.items())
              if m is not None and (name == "triton.language" or name.startswith("triton.language."))]
    if not loaded:
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    swapped: dict[int, InterpretedFunction] = {}  # one replacement per helper, re-exported or not
    for module in loaded:
        for attr, value in list(vars(module).items()):
            if type(value) is JITFunction:
                setattr(module, attr, swapped.setdefault(id(value), InterpretedFunction(value.fn)))
    # the tensor methods they lend (`x.sum(0)` is tl.sum): as triton does when interpreting, a plain
    # function forwarding to it, which binds the tensor as its first argument
    tensor = getattr(sys.modules.get("triton.language.core"), "tensor", None)
    for attr, value in list(vars(tensor).items()) if tensor is not None else []:
        if type(value) is JITFunction:
            helper = swapped.setdefault(id(value), InterpretedFunction(value.fn))
            setattr(tensor, attr, lambda *args, _helper=helper, **kwargs: _helper(*args, **kwargs))


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
