"""Capture with torch.export, then functionalise (in-place buffer writes become outputs)."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

from coopt.errors import CaptureError


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _user_frame(exc: BaseException, model_path: Path | None) -> str:
    if model_path is None:
        return ""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == model_path]
    if frames:
        return f" at {model_path.name}:{frames[-1].lineno} ({frames[-1].line})"
    # torch.export errors often carry the user frame only in the message text
    for line in str(exc).splitlines():
        if model_path.name in line:
            return f" at {line.strip()}"
    return ""


def capture(model: torch.nn.Module, example_inputs: tuple, dynamic_shapes=None, model_path: Path | None = None):
    """torch.export the model on its example inputs; returns a functional ExportedProgram.

    `run_decompositions({})` functionalises without decomposing: linear, layer_norm, softmax
    and scaled_dot_product_attention stay whole, so raise-patterns sees them as written.
    """
    try:
        with torch.no_grad():
            program = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=False)
            return program.run_decompositions({})
    except Exception as exc:  # torch.export raises many types; all mean "could not capture"
        hint = "" if dynamic_shapes is not None else "; if an input size varies, define dynamic_shapes() in the model file"
        raise CaptureError(
            f"torch.export failed{_user_frame(exc, model_path)}: {type(exc).__name__}: {_first_line(exc)}{hint}"
        ) from exc
