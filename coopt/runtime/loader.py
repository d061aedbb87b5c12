"""coopt.load(out_dir): the built model as an nn.Module (torch + triton only)."""

from __future__ import annotations

from pathlib import Path

from coopt.runtime.kernel_loader import load_module_from_file


def load(out_dir, device=None):
    """Load a build directory: `coopt.load("out/mlp")(x)` runs the built model.

    `device` is where the weights go: by default the GPU when there is one (coopt builds for
    GPUs), else the CPU. Move the module later with `.to(...)` as any nn.Module.
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = Path(out_dir)
    program = out_dir / "program.py"
    from coopt.errors import InputFileError

    if not program.is_file():
        raise InputFileError(f"'{out_dir}' is not a coopt build directory (no program.py)")
    if not (out_dir / "weights.pt").is_file():  # copied without it, or kept by bench/decode.py without --keep-weights
        raise InputFileError(f"'{out_dir}' has no weights.pt: the build's weights were removed or not copied")
    module = load_module_from_file(program, name=None)
    return module.load(out_dir, device=device)
